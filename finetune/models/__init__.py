"""The model: loading it (and its tokenizer) as the strategy needs, LoRA/QLoRA adapters, trainable dtypes."""
