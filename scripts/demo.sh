#!/usr/bin/env bash
# The main job: the tiny embedded model learns the synthetic tasks under DeepSpeed ZeRO-2 on 2 processes
# (2 GPUs when present, otherwise 2 CPU processes), printing eval loss, exact match and sample answers
# before and after training. Extra arguments are recipe overrides, e.g. `scripts/demo.sh --max_steps 100`.
set -euo pipefail
VENV=${VENV:-.venv}
export PATH="$VENV/bin:$PATH"
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 1 ]; then
    config=accelerate_configs/deepspeed_zero2.yaml
    processes=$(( gpus < 2 ? gpus : 2 ))
else
    config=accelerate_configs/cpu_deepspeed_zero2.yaml
    processes=2
fi
echo "demo: accelerate launch --config_file $config --num_processes $processes -m finetune train recipes/demo.yaml $*"
exec accelerate launch --config_file "$config" --num_processes "$processes" -m finetune train recipes/demo.yaml "$@"
