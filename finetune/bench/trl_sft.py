"""The peer: TRL's `SFTTrainer` on the bench's model and data, as its docs show it for prompt-completion data (the
loss on the completions only, its fused LM head), at the bench's settings: the same micro-batch, steps, learning
rate and precision, and no gradient checkpointing (TRL turns it on by default; no other row has it). `--packing`
packs rows with its best-fit packer.

    python -m finetune.bench.trl_sft --model_dir DIR|tiny --train_file F --output_dir OUT [--packing] [...]
"""

from __future__ import annotations

import torch
from datasets import load_dataset
from trl import SFTConfig, SFTTrainer

from finetune.bench.plain_trainer import bench_parser, measuring_callbacks, model_and_tokenizer, write_peak_memory


def main() -> None:
    parser = bench_parser(__doc__.splitlines()[0])
    parser.add_argument("--packing", action="store_true")
    args = parser.parse_args()
    model, tokenizer = model_and_tokenizer(args.model_dir)

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
    trainer = SFTTrainer(model=model, args=config, train_dataset=train, processing_class=tokenizer,
                         callbacks=measuring_callbacks())
    trainer.train()
    trainer.save_state()
    write_peak_memory(args.output_dir)


if __name__ == "__main__":
    main()
