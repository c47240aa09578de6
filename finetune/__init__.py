"""finetune: fine-tune causal language models across GPUs with Hugging Face Trainer, Accelerate and DeepSpeed."""

__version__ = "0.1.0"
