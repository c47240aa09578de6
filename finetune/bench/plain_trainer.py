"""The baseline: a causal-LM fine-tune written the way the Transformers docs show it, with no toolkit feature.
Tokenize prompt and answer as one text, pad each batch with DataCollatorForLanguageModeling, train with Trainer. It
is measured as every row of the bench is: the toolkit's throughput callback times its steps (tokens/s and MFU of each
logged window, `throughput.json`) and its peak memory is recorded; neither changes a step.

    python -m finetune.bench.plain_trainer --model_dir DIR|tiny --train_file F --output_dir OUT [...]
"""

from __future__ import annotations

import argparse

import torch
from datasets import load_dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainingArguments,
)

from finetune import outputs


def bench_parser(description: str) -> argparse.ArgumentParser:
    """The arguments every baseline the bench runs takes (finetune.bench.harness.command passes them)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model_dir", required=True, help="a save_pretrained directory, or tiny")
    parser.add_argument("--train_file", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_seq_length", type=int, default=256)
    parser.add_argument("--per_device_train_batch_size", type=int, default=16)
    parser.add_argument("--max_steps", type=int, default=30)
    parser.add_argument("--learning_rate", type=float, default=2e-4)
    parser.add_argument("--bf16", action="store_true")
    return parser


def model_and_tokenizer(model_dir: str):
    if model_dir == "tiny":  # the embedded default has no directory: it is built in code
        from finetune import presets

        tokenizer = presets.build_tokenizer()
        return presets.build_model(tokenizer), tokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto"), tokenizer  # as saved, like finetune train


def measuring_callbacks() -> list:
    """What times a baseline's steps as `finetune train` times its own: tokens/s, model TFLOP/s and MFU of each logged
    window after the first step (finetune.train.throughput)."""
    from finetune.train.throughput import ThroughputCallback

    return [ThroughputCallback()]


def write_peak_memory(output_dir: str) -> None:
    """The process's peak as a toolkit run's memory report records it (finetune.memory.ledger.peak_memory): allocated
    and reserved on the GPU, else resident on the host."""
    from finetune.memory.ledger import peak_memory

    outputs.write_record(output_dir, outputs.PEAK_MEMORY, peak_memory())


def main() -> None:
    args = bench_parser(__doc__.splitlines()[0]).parse_args()
    model, tokenizer = model_and_tokenizer(args.model_dir)

    def tokenize(batch):
        texts = [f"{instruction}\n{text}\n{output}{tokenizer.eos_token}"
                 for instruction, text, output in zip(batch["instruction"], batch["input"], batch["output"])]
        return tokenizer(texts, truncation=True, max_length=args.max_seq_length)

    raw = load_dataset("json", data_files=args.train_file, split="train")
    train = raw.map(tokenize, batched=True, remove_columns=raw.column_names)
    training_args = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.per_device_train_batch_size,
        max_steps=args.max_steps, learning_rate=args.learning_rate, bf16=args.bf16, logging_steps=10,
        save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), seed=0,
        include_num_input_tokens_seen="non_padding",  # measurement only: the bench reads tokens/s from it
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=train,
                      data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
                      callbacks=measuring_callbacks())
    trainer.train()
    trainer.save_state()
    write_peak_memory(args.output_dir)


if __name__ == "__main__":
    main()
