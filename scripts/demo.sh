#!/usr/bin/env bash
# The main job: the tiny embedded model learns the synthetic tasks under DeepSpeed ZeRO-2 on 2 processes
# (2 GPUs when present, one on a one-GPU machine, otherwise 2 CPU processes), printing eval loss, exact match and
# sample answers before and after training. One command: `finetune train` plans the run and launches itself through
# Accelerate's launcher (it prints the `accelerate launch` command it runs). Extra arguments are recipe overrides,
# e.g. `scripts/demo.sh --max_steps 100`.
set -euo pipefail
VENV=${VENV:-.venv}
export PATH="$VENV/bin:$PATH"
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
processes=$(( gpus == 1 ? 1 : 2 ))
echo "demo: finetune train recipes/demo.yaml --gpus $processes $*"
exec finetune train recipes/demo.yaml --gpus "$processes" "$@"
