"""The peer: TRL's `SFTTrainer` on the bench's model and data, as its docs show it for prompt-completion data (the
loss on the completions only, its fused LM head), at the bench's settings: the same micro-batch, steps, learning
rate and precision, and no gradient checkpointing (TRL turns it on by default; no other row has it). `--packing`
packs rows with its best-fit packer.

    python -m finetune.bench.trl_sft --model_dir DIR|tiny --train_file F --output_dir OUT [--packing] [...]
"""

from __future__ import annotations

import argparse

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

from finetune import outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", required=True, help="a save_pretrained directory, or tiny")
    parser.add_argument("--train_file", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_seq_length", type=int, default=256)
    parser.add_argument("--per_device_train_batch_size", type=int, default=16)
    parser.add_argument("--max_steps", type=int, default=30)
    parser.add_argument("--learning_rate", type=float, default=2e-4)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--packing", action="store_true")
    args = parser.parse_args()

    if args.model_dir == "tiny":  # the embedded default has no directory: it is built in code
        from finetune import presets

        tokenizer = presets.build_tokenizer()
        model = presets.build_model(tokenizer)
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype="auto")

    raw = load_dataset("json", data_files=args.train_file, split="train")
    train = raw.map(lambda row: {"prompt": f"{row['instruction']}\n{row['input']}\n", "completion": row["output"]},
                    remove_columns=raw.column_names)
    config = SFTConfig(
        output_dir=args.output_dir, per_device_train_batch_size=args.per_device_train_batch_size,
        max_steps=args.max_steps, learning_rate=args.learning_rate, bf16=args.bf16, logging_steps=10,
        save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), seed=0, warmup_steps=0,
        max_length=args.max_seq_length, packing=args.packing, gradient_checkpointing=False,
        include_num_input_tokens_seen="non_padding",  # measurement only: the bench reads tokens/s from it
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=train, processing_class=tokenizer)
    trainer.train()
    trainer.save_state()
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated()
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    outputs.write_record(args.output_dir, outputs.PEAK_MEMORY, {"peak_bytes": peak})


if __name__ == "__main__":
    main()
