#!/usr/bin/env python
"""Writes the embedded synthetic instruction dataset (Alpaca-style JSONL with a held-out eval split).

Three tasks a tiny model can learn in minutes on a CPU: reversing, sorting letters, adding numbers.
The output is deterministic: re-running it reproduces the shipped files byte for byte (a test checks).

    python scripts/make_synthetic_data.py [--out finetune/datasets/synthetic]
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

TASKS = ("reverse", "sort", "add")
TRAIN_PER_TASK = 2000
EVAL_PER_TASK = 100
SEED = 1234


def make_example(task: str, rng: random.Random) -> dict:
    if task == "add":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return {"task": task, "instruction": "add", "input": f"{a}+{b}", "output": str(a + b)}
    letters = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))
    output = letters[::-1] if task == "reverse" else "".join(sorted(letters))
    return {"task": task, "instruction": task, "input": letters, "output": output}


def make_splits(seed: int = SEED) -> dict[str, list[dict]]:
    """Eval examples first, then train examples whose inputs never appear in eval."""
    rng = random.Random(seed)
    splits: dict[str, list[dict]] = {"train": [], "eval": []}
    for task in TASKS:
        seen: set[str] = set()
        for split, count in (("eval", EVAL_PER_TASK), ("train", TRAIN_PER_TASK)):
            examples = []
            while len(examples) < count:
                example = make_example(task, rng)
                if split == "train" and example["input"] in seen:
                    continue
                if split == "eval":
                    if example["input"] in seen:
                        continue
                    seen.add(example["input"])
                examples.append(example)
            splits[split].extend(examples)
    random.Random(seed).shuffle(splits["train"])
    return splits


def write_splits(out_dir: Path, seed: int = SEED) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for split, examples in make_splits(seed).items():
        path = out_dir / f"{split}.jsonl"
        path.write_text("".join(json.dumps(example) + "\n" for example in examples))
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_out = Path(__file__).resolve().parents[1] / "finetune" / "datasets" / "synthetic"
    parser.add_argument("--out", type=Path, default=default_out, help="output directory")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    for path in write_splits(args.out, args.seed):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
