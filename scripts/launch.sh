#!/usr/bin/env bash
# One machine, all its GPUs (the 2-GPU box):
#
#   scripts/launch.sh [--config accelerate_configs/ddp.yaml] [--processes N] RECIPE.yaml [--key value ...]
#
# --processes defaults to the number of visible GPUs. Pick the config with `finetune plan`; a CPU config
# (accelerate_configs/cpu_*.yaml) runs without a GPU, with --processes 2.
# FINETUNE_DRY_RUN=1 prints the command instead of running it.
set -euo pipefail
cd "$(dirname "$0")/.."

config=accelerate_configs/ddp.yaml
processes=
usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
while [ $# -gt 0 ]; do
    case "$1" in
        --config) config=$2; shift 2 ;;
        --processes) processes=$2; shift 2 ;;
        -h|--help) usage 0 ;;
        --*) echo "launch: unknown option $1 (recipe keys go after the recipe)" >&2; usage ;;
        *) break ;;
    esac
done
[ $# -ge 1 ] || { echo "launch: give a recipe, e.g. recipes/demo.yaml" >&2; usage; }
recipe=$1; shift
if [ -z "$processes" ]; then
    processes=$(python -c "import torch; print(torch.cuda.device_count())")
    [ "$processes" -ge 1 ] || { echo "launch: no GPU visible; use a cpu_*.yaml config with --processes 2" >&2; exit 2; }
fi
launch=(accelerate launch --config_file "$config" --num_processes "$processes" -m finetune train "$recipe" "$@")
if [ "${FINETUNE_DRY_RUN:-0}" = 1 ]; then
    echo "${launch[*]}"
    exit 0
fi
exec "${launch[@]}"
