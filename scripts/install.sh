#!/usr/bin/env bash
# Installs the project into $VENV (default .venv), in the only order that avoids surprises:
#   1. torch: an existing torch is kept (a CUDA build stays a CUDA build); otherwise a CUDA build where a
#      GPU is visible, else the CPU build `torch==$TORCH_CPU_VERSION` (from $TORCH_CPU_INDEX when set);
#   2. DeepSpeed from source without prebuilt ops (they are JIT-built when first used), against that torch; on a
#      machine without a GPU its CPU Adam (what ZeRO-Offload steps with, about 90 CPU-seconds of C++) is built
#      meanwhile into $VENV/torch_extensions, where the tests point TORCH_EXTENSIONS_DIR;
#   3. the project itself, editable, with its dev extras and the after-training ones (eval, serve, gguf, tracking).
set -euo pipefail
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_CPU_VERSION=${TORCH_CPU_VERSION:-2.13.0}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-}

# --system-site-packages: a torch the machine already has (e.g. a CUDA build) is reused, not replaced.
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv --system-site-packages "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet)
gpu_visible() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "install: keeping torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
elif gpu_visible; then
    echo "install: GPU found, installing a CUDA build of torch"
    "${pip[@]}" torch
else
    echo "install: no GPU found, installing the CPU build torch==$TORCH_CPU_VERSION"
    "${pip[@]}" "torch==$TORCH_CPU_VERSION" ${TORCH_CPU_INDEX:+--index-url "$TORCH_CPU_INDEX"}
fi

if ! "$VENV/bin/python" -c "import deepspeed" 2>/dev/null; then
    echo "install: DeepSpeed (ops built on first use)"
    DS_BUILD_OPS=0 "${pip[@]}" --no-build-isolation deepspeed
fi

prebuild=
if ! gpu_visible; then
    echo "install: building DeepSpeed's CPU Adam meanwhile (no GPU here: ZeRO-Offload steps on the CPU)"
    # Absolute paths: the environment's own ninja first (another ninja version would see the build as stale and redo
    # it), and the folder as the tests name it (tests/conftest.py: sys.prefix; torch rebuilds an op whose build folder
    # is named differently).
    venv_path=$(cd "$VENV" && pwd)
    PATH="$venv_path/bin:$PATH" TORCH_EXTENSIONS_DIR="$venv_path/torch_extensions" "$VENV/bin/python" -c \
        "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(verbose=False)" \
        >"$VENV/cpu_adam_build.log" 2>&1 &
    prebuild=$!
fi

echo "install: finetune and its dependencies"
"${pip[@]}" -e ".[dev,plots,eval,serve,gguf,tracking]"
if [ -n "$prebuild" ]; then
    if wait "$prebuild"; then
        echo "install: CPU Adam built"
    else
        echo "install: CPU Adam did not build (see $VENV/cpu_adam_build.log); DeepSpeed builds it on first use"
    fi
fi
