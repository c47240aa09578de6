"""`python -m finetune` recording what each rank trains on, for the tests of streamed data: every micro-batch the
collator builds, as the examples in it (each a digest of its tokens, split where `position_ids` restart), one line
per batch in `$FINETUNE_RECORD_BATCHES/rank<RANK>.jsonl`:
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml -m finetune.testing.record_batches train ...

The collator is the toolkit's own (finetune.data.collate.data_collator), wrapped; everything else is the user's path.
"""

import hashlib
import json
import os
import runpy
from pathlib import Path

import finetune.data.collate as collate

RECORD_DIR = "FINETUNE_RECORD_BATCHES"
_data_collator = collate.data_collator


def examples_of(batch) -> list[str]:
    """A digest of each example (or piece of one) in a collated batch, in order; a row's filler (no label) is left
    out."""
    digests = []
    for ids, labels, positions in zip(batch["input_ids"].tolist(), batch["labels"].tolist(),
                                      batch["position_ids"].tolist()):
        starts = [i for i, position in enumerate(positions) if position == 0] + [len(ids)]
        for start, end in zip(starts, starts[1:]):
            if any(label != -100 for label in labels[start:end]):
                digests.append(hashlib.sha256(json.dumps(ids[start:end]).encode()).hexdigest()[:16])
    return digests


def recording_collator(*args, **kwargs):
    collator = _data_collator(*args, **kwargs)
    path = Path(os.environ[RECORD_DIR], f"rank{os.environ.get('RANK', '0')}.jsonl")

    def collate_and_record(features):
        batch = collator(features)
        with open(path, "a") as file:
            file.write(json.dumps(examples_of(batch)) + "\n")
        return batch

    return collate_and_record


if __name__ == "__main__":  # the collator wrapped in this process only, then exactly `python -m finetune ...`
    collate.data_collator = recording_collator
    runpy.run_module("finetune", run_name="__main__", alter_sys=True)
