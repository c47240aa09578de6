#!/usr/bin/env bash
# One node of a multi-node run: start it on every node (by hand, or with `srun` from scripts/slurm/finetune.sbatch).
#
#   scripts/launch_multinode.sh --nnodes 2 --node-rank 0 --main-addr 10.0.0.1 [options] RECIPE.yaml [--key value ...]
#
# Each value comes from its option, else from SLURM (SLURM_NNODES, SLURM_NODEID, the first host of
# SLURM_JOB_NODELIST, SLURM_GPUS_ON_NODE, a port derived from SLURM_JOB_ID), else from the default below.
# The nodes first meet (`finetune rendezvous`): a node that never starts is named after --rendezvous-timeout seconds
# instead of the launcher waiting in silence. Then `accelerate launch` starts one process per GPU on this node, with
# the network settings of accelerate_configs/multinode.env and Trainer's collective timeout (--ddp-timeout).
# Sizes a config writes for one cluster shape come from this launch: FSDP hybrid shard's replicate × shard are
# --nnodes × --gpus-per-node (ZeRO++'s "auto" hpZ is filled from the GPUs per node by `finetune train`).
# FINETUNE_DRY_RUN=1 prints the two commands instead of running them; FINETUNE_MODULE names the module each process
# runs (default finetune; the tests' CPU twin of FSDP runs finetune.testing.fsdp_on_cpu).
set -euo pipefail
cd "$(dirname "$0")/.."

config=accelerate_configs/multinode_deepspeed_zero2.yaml
nnodes=${SLURM_NNODES:-}
node_rank=${SLURM_NODEID:-}
main_addr=${MAIN_PROCESS_IP:-}
main_port=${MAIN_PROCESS_PORT:-}
gpus_per_node=${SLURM_GPUS_ON_NODE:-}
interface=
rendezvous_timeout=300
ddp_timeout=1800

usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
while [ $# -gt 0 ]; do
    case "$1" in
        --config) config=$2; shift 2 ;;
        --nnodes) nnodes=$2; shift 2 ;;
        --node-rank) node_rank=$2; shift 2 ;;
        --main-addr) main_addr=$2; shift 2 ;;
        --main-port) main_port=$2; shift 2 ;;
        --gpus-per-node) gpus_per_node=$2; shift 2 ;;
        --interface) interface=$2; shift 2 ;;
        --rendezvous-timeout) rendezvous_timeout=$2; shift 2 ;;
        --ddp-timeout) ddp_timeout=$2; shift 2 ;;
        -h|--help) usage 0 ;;
        --*) echo "launch_multinode: unknown option $1 (recipe keys go after the recipe)" >&2; usage ;;
        *) break ;;
    esac
done
[ $# -ge 1 ] || { echo "launch_multinode: give a recipe, e.g. recipes/demo.yaml" >&2; usage; }
recipe=$1; shift

if [ -z "$main_addr" ] && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    main_addr=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk "NR == 1")  # awk reads all: no SIGPIPE
fi
if [ -z "$main_port" ] && [ -n "${SLURM_JOB_ID:-}" ]; then
    main_port=$(( SLURM_JOB_ID % 10000 + 20000 ))  # one port per job: jobs sharing a node do not collide
fi
main_port=${main_port:-29500}
if [ -z "$gpus_per_node" ]; then
    gpus_per_node=$(python -c "import torch; print(torch.cuda.device_count())")
fi
for name in nnodes node_rank main_addr gpus_per_node; do
    if [ -z "${!name}" ]; then
        echo "launch_multinode: --${name//_/-} is not set (and no SLURM variable gives it)" >&2
        exit 2
    fi
done
[ "$gpus_per_node" -ge 1 ] || { echo "launch_multinode: no GPU on this node; pass --gpus-per-node" >&2; exit 2; }

set -a
# shellcheck disable=SC1091
. accelerate_configs/multinode.env
if [ -n "$interface" ]; then
    NCCL_SOCKET_IFNAME=$interface
    GLOO_SOCKET_IFNAME=$interface
fi
set +a

rendezvous=(finetune rendezvous --nnodes "$nnodes" --node-rank "$node_rank" --main-addr "$main_addr"
            --main-port "$main_port" --timeout "$rendezvous_timeout")
sizes=()
if grep -q "parallelism_config_dp_replicate_size" "$config"; then
    sizes=(--parallelism_config_dp_replicate_size "$nnodes" --parallelism_config_dp_shard_size "$gpus_per_node")
fi
launch=(accelerate launch --config_file "$config" --num_machines "$nnodes" --machine_rank "$node_rank"
        --main_process_ip "$main_addr" --main_process_port "$main_port"
        --num_processes $(( nnodes * gpus_per_node )) ${sizes[@]+"${sizes[@]}"} --rdzv_conf "timeout=$rendezvous_timeout"
        -m "${FINETUNE_MODULE:-finetune}" train "$recipe" --ddp_timeout "$ddp_timeout" "$@")
if [ "${FINETUNE_DRY_RUN:-0}" = 1 ]; then
    echo "env NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-}" \
         "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-}"
    echo "${rendezvous[*]}"
    echo "${launch[*]}"
    exit 0
fi
TORCH_CPP_LOG_LEVEL=FATAL "${rendezvous[@]}"  # our message names a missing node; c10d's connection retries are noise
exec "${launch[@]}"
