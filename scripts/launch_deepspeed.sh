#!/usr/bin/env bash
# Many nodes through DeepSpeed's own launcher: run it ONCE, on the first node of the hostfile; it starts every node
# over ssh (pdsh), so every node needs this checkout at the same path and passwordless ssh between nodes.
#
#   scripts/launch_deepspeed.sh --hostfile HOSTFILE [--deepspeed-config deepspeed_configs/zero2.json]
#                               [--main-port 29500] RECIPE.yaml [--key value ...]
#
# HOSTFILE has one line per node, `hostname slots=GPUS`; the first host is the main node. DeepSpeed checks every
# host over ssh first, even a single `localhost`.
# FINETUNE_DRY_RUN=1 prints the command instead of running it.
set -euo pipefail
cd "$(dirname "$0")/.."

hostfile=
deepspeed_config=deepspeed_configs/zero2.json
main_port=29500
usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
while [ $# -gt 0 ]; do
    case "$1" in
        --hostfile) hostfile=$2; shift 2 ;;
        --deepspeed-config) deepspeed_config=$2; shift 2 ;;
        --main-port) main_port=$2; shift 2 ;;
        -h|--help) usage 0 ;;
        --*) echo "launch_deepspeed: unknown option $1 (recipe keys go after the recipe)" >&2; usage ;;
        *) break ;;
    esac
done
[ -n "$hostfile" ] && [ -f "$hostfile" ] || { echo "launch_deepspeed: --hostfile FILE is required" >&2; usage; }
[ $# -ge 1 ] || { echo "launch_deepspeed: give a recipe, e.g. recipes/demo.yaml" >&2; usage; }
recipe=$1; shift
main_addr=$(grep -v '^\s*#' "$hostfile" | awk 'NF { print $1; exit }')
# --no_local_rank: the launcher would otherwise put --local_rank before `train`; LOCAL_RANK is in the environment.
launch=(deepspeed --hostfile "$hostfile" --master_addr "$main_addr" --master_port "$main_port" --no_local_rank
        --module finetune train "$recipe" --deepspeed "$deepspeed_config" "$@")
if [ "${FINETUNE_DRY_RUN:-0}" = 1 ]; then
    echo "${launch[*]}"
    exit 0
fi
exec "${launch[@]}"
