"""Data prep against the turns of a conversation: `finetune preprocess` on the same assistant turns arranged 1, 8 and
32 to a conversation, against `apply_chat_template(tokenize=True)` and `trl.pack_dataset` on the same rows.

    python benchmarks/turns.py [--turns 4000] [--repeats 3]

A byte-level BPE tokenizer with learned merges and a ChatML template (the test suite's hub-shaped one, built here
offline) is saved with a model; `--turns` user/assistant exchanges of varied words are written to three JSONL files
(1, 8 and 32 exchanges a conversation, the same exchanges in the same order), and each is preprocessed with packing
into rows of 8,192 tokens (which hold the longest conversation whole: nothing is truncated on either side) by
`finetune preprocess` in this process (start-up and imports excluded: a first run warms them) and by the plain path:
`datasets.map` of the template into tokens, then `pack_dataset(..., 8192, "bfd")`. Prints, the median of
`--repeats`, the milliseconds per assistant turn of each and their ratio. finetune also finds and verifies each
learned span, which the plain path does not (it learns every token).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from datasets import Dataset, disable_caching
from trl.data_utils import pack_dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the hub-shaped tokenizer, built offline
from hub_fixtures import save_hub_model  # noqa: E402

from finetune.cli import main as finetune  # noqa: E402

WORDS = ("the model learns to answer each question with care and a short clear reason while the data holds many "
         "turns of different length").split()
ROW = 8192  # holds a 32-turn conversation whole: nothing truncated on either side


def exchanges(count: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [(" ".join(rng.choices(WORDS, k=rng.randint(5, 40))), " ".join(rng.choices(WORDS, k=rng.randint(5, 80))))
            for _ in range(count)]


def conversations(pairs: list[tuple[str, str]], per_conversation: int) -> list[dict]:
    rows = []
    for start in range(0, len(pairs), per_conversation):
        messages = [{"role": "system", "content": "You are a helpful assistant."}]
        for user, assistant in pairs[start:start + per_conversation]:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        rows.append({"messages": messages})
    return rows


def plain(rows: list[dict], tokenizer) -> float:
    started = time.perf_counter()
    data = Dataset.from_list(rows).map(
        lambda row: {"input_ids": tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=False)},
        remove_columns=["messages"])
    pack_dataset(data, ROW, "bfd")
    return time.perf_counter() - started


def ours(path: Path, model: Path, output_dir: Path) -> float:
    started = time.perf_counter()
    status = finetune(["preprocess", "recipes/demo.yaml", "--model_name_or_path", str(model), "--train_file",
                       str(path), "--output_dir", str(output_dir), "--max_seq_length", str(ROW), "--packing", "true",
                       "--eval_split_ratio", "0", "--generation_eval_samples", "0", "--overlong_policy", "truncate"])
    took = time.perf_counter() - started
    assert status == 0, status
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    disable_caching()
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as directory:
        folder = Path(directory)
        model = save_hub_model(folder / "model", "chatml")
        tokenizer = AutoTokenizer.from_pretrained(model)
        pairs = exchanges(args.turns)
        files = {}
        for per in (1, 8, 32):
            files[per] = folder / f"turns_{per}.jsonl"
            files[per].write_text("".join(json.dumps(row) + "\n" for row in conversations(pairs, per)))
        ours(files[1], model, folder / "warm")  # imports and first-call costs, excluded
        results = {}
        for per, path in files.items():
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            mine = statistics.median(ours(path, model, folder / f"out_{per}_{r}") for r in range(args.repeats))
            theirs = statistics.median(plain(rows, tokenizer) for _ in range(args.repeats))
            results[per] = (1e3 * mine / args.turns, 1e3 * theirs / args.turns)
        print(f"{args.turns:,} assistant turns, BPE tokenizer ({len(tokenizer)} ids) with a ChatML template, "
              f"packed into rows of {ROW}; median of {args.repeats}")
        print("turns a conversation | finetune preprocess ms/turn | apply_chat_template + pack_dataset ms/turn | ratio")
        for per, (mine, theirs) in results.items():
            print(f"{per:20d} | {mine:27.3f} | {theirs:43.3f} | {mine / theirs:5.2f}")
        per_turn = [mine for mine, _ in results.values()]
        print(f"finetune's time per turn, slowest over fastest across 1, 8, 32: {max(per_turn) / min(per_turn):.2f}")


if __name__ == "__main__":
    main()
