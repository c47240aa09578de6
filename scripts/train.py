#!/usr/bin/env python
"""Thin entry point for launchers that want a script path:
    accelerate launch --config_file accelerate_configs/cpu_deepspeed_zero2.yaml scripts/train.py recipes/demo.yaml
"""

import sys

from finetune.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
