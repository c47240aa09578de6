"""`python -m finetune` with faults injected, for the crash and data-order tests; run it in place of the module:
    accelerate launch --config_file C tests/fault_injection.py train recipes/demo.yaml ...

FAULT_KILL_RANK=R, FAULT_KILL_STEP=N, FAULT_KILL_IN=step|save: rank R kills itself with SIGKILL when it starts
step N, or when it starts saving the optimizer of the checkpoint at step N (the model files already written);
FAULT_KILL_SIGNAL=SIGSTOP (or another signal's name) sends that signal instead, e.g. a rank that stops answering.
FAULT_BATCH_LOG=DIR: each rank appends, per micro-batch, the step and a digest of each row to DIR/rank-R.jsonl.
"""

import hashlib
import json
import os
import signal
import sys
from pathlib import Path

from transformers import Trainer

from finetune.cli import main

KILL_RANK = int(os.environ.get("FAULT_KILL_RANK", "-1"))
KILL_STEP = int(os.environ.get("FAULT_KILL_STEP", "-1"))
KILL_IN = os.environ.get("FAULT_KILL_IN", "step")
KILL_SIGNAL = getattr(signal, os.environ.get("FAULT_KILL_SIGNAL", "SIGKILL"))
BATCH_LOG = os.environ.get("FAULT_BATCH_LOG")


def row_digest(input_ids, attention_mask) -> str:
    tokens = input_ids[attention_mask.bool()].tolist()
    return hashlib.sha1(json.dumps(tokens).encode()).hexdigest()[:16]


def kill_if(trainer, where: str) -> None:
    step = trainer.state.global_step + (where == "step")
    if where == KILL_IN and trainer.args.process_index == KILL_RANK and step == KILL_STEP:
        os.kill(os.getpid(), KILL_SIGNAL)


original_training_step = Trainer.training_step
original_save_optimizer = Trainer._save_optimizer_and_scheduler


def training_step(self, model, inputs, *args, **kwargs):
    kill_if(self, "step")
    if BATCH_LOG:
        rows = [row_digest(ids, mask) for ids, mask in zip(inputs["input_ids"], inputs["attention_mask"])]
        with Path(BATCH_LOG, f"rank-{self.args.process_index}.jsonl").open("a") as log:
            log.write(json.dumps({"step": self.state.global_step + 1, "epoch": self.state.epoch, "rows": rows}) + "\n")
    return original_training_step(self, model, inputs, *args, **kwargs)


def save_optimizer_and_scheduler(self, output_dir):
    kill_if(self, "save")
    return original_save_optimizer(self, output_dir)


Trainer.training_step = training_step
Trainer._save_optimizer_and_scheduler = save_optimizer_and_scheduler

if __name__ == "__main__":
    sys.exit(main())
