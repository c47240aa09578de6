"""The pipeline loop's steps padded to their longest row against every step at `max_seq_length`, side by side.

    python benchmarks/pipeline_padding.py [--examples 800] [--max-seq-length 512] [--steps 20] [--repeats 2]

Trains the tiny model on 2 stages (2 CPU processes, `pipeline_parallel_size: 2`, 4 micro-batches of 4 a step) over
the same instruction-like rows of long-tailed lengths (log-normal, median ~55 tokens, a tail to `--max-seq-length`),
once with `pipeline_step_length: longest` (the default: each step padded to its longest row, a multiple of 8) and
once with `max_seq_length` (every step at one shape), interleaved `--repeats` times. Prints the seconds a step, the
tokens the steps computed over their rows' own tokens (from the memory report), the speed-up and both runs' losses,
which must agree: padding after every real token changes no real token's loss.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODES = ("longest", "max_seq_length")


def write_rows(path: Path, count: int, cap: int, seed: int = 0) -> None:
    """Prompt/completion rows of random words, their lengths log-normal as instruction data's are."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    with path.open("w") as file:
        for length in np.clip(rng.lognormal(mean=4.0, sigma=0.8, size=count), 8, cap - 16).astype(int):
            text = "".join(rng.choice(letters, size=length))
            half = length // 2
            file.write(json.dumps({"prompt": f"copy {text[:half]}: ", "completion": text[half:]}) + "\n")


def train(mode: str, data: Path, output_dir: Path, max_seq_length: int, steps: int) -> dict:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "accelerate_configs" / "cpu_ddp.yaml"), "--num_processes", "2", "-m", "finetune", "train",
               str(ROOT / "recipes" / "demo.yaml"), "--output_dir", str(output_dir), "--train_file", str(data),
               "--max_seq_length", str(max_seq_length), "--pipeline_parallel_size", "2",
               "--pipeline_step_length", mode, "--per_device_train_batch_size", "4",
               "--gradient_accumulation_steps", "4", "--max_steps", str(steps), "--logging_steps", "1",
               "--eval_on_start", "false", "--generation_eval_samples", "0", "--save_strategy", "no",
               "--report_to", "none", "--learning_rate", "1e-3", "--warmup_steps", "0"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"{mode}: exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    losses = [entry["loss"] for entry in history if "loss" in entry]
    runtime = next(entry["train_runtime"] for entry in history if "train_runtime" in entry)
    tokens = json.loads((output_dir / "memory_report.json").read_text())["ranks"][0]["tokens"]
    return {"seconds_per_step": runtime / steps, "losses": losses, "computed": tokens["computed"],
            "rows": tokens["rows"], "longest_step": tokens["longest_step"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=800)
    parser.add_argument("--max-seq-length", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as folder:
        data = Path(folder) / "rows.jsonl"
        write_rows(data, args.examples, args.max_seq_length)
        for repeat in range(args.repeats):
            for mode in MODES:
                runs[mode].append(train(mode, data, Path(folder) / f"{mode}_{repeat}", args.max_seq_length,
                                        args.steps))
    seconds = {mode: statistics.median(run["seconds_per_step"] for run in runs[mode]) for mode in MODES}
    print(f"pipeline 2 stages, 2 CPU processes, {args.steps} steps of 4 × 4 rows, max_seq_length "
          f"{args.max_seq_length}, median of {args.repeats}")
    print(f"{'step length':<16}{'s/step':>9}{'tokens computed/rows':>23}{'longest step':>14}{'final loss':>12}")
    for mode in MODES:
        run = runs[mode][0]
        print(f"{mode:<16}{seconds[mode]:>9.3f}{run['computed'] / run['rows']:>23.2f}{run['longest_step']:>14}"
              f"{run['losses'][-1]:>12.4f}")
    gap = max(abs(a - b) for a, b in zip(runs["longest"][0]["losses"], runs["max_seq_length"][0]["losses"]))
    print(f"speed-up of longest over max_seq_length: {seconds['max_seq_length'] / seconds['longest']:.2f}×; "
          f"tokens computed: {runs['max_seq_length'][0]['computed'] / runs['longest'][0]['computed']:.2f}× fewer; "
          f"largest loss gap over the {args.steps} steps: {gap:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
