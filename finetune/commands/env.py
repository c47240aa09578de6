"""`finetune env`: the versions, devices and settings a bug report needs, as one block to paste (what `accelerate
env` and `trl env` print, with DeepSpeed's ops and the toolkit's own). No secret is printed: an environment variable
or config key whose name says token, secret, password, credential or key shows only that it is set, and anything
shaped like a Hugging Face token is hidden wherever it appears."""

from __future__ import annotations

import os
import re

# What the toolkit runs on, by distribution name (the import name can differ: flash-attn is flash_attn).
PACKAGES = ("finetune-kit", "torch", "transformers", "accelerate", "deepspeed", "peft", "trl", "datasets",
            "tokenizers", "safetensors", "bitsandbytes", "flash-attn")
# Variables that change how a run launches, talks or loads; by exact name or prefix.
VARIABLES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "OMP_NUM_THREADS", "HF_HOME", "HF_HUB_OFFLINE",
             "HF_DATASETS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "TORCH_EXTENSIONS_DIR", "DS_BUILD_OPS",
             "PYTORCH_CUDA_ALLOC_CONF", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")
VARIABLE_PREFIXES = ("NCCL_", "ACCELERATE_", "FSDP_", "SLURM_JOB", "WANDB_")
SECRET_NAME = re.compile(r"token|secret|password|passwd|credential|key", re.IGNORECASE)
TOKEN_SHAPE = re.compile(r"\bhf_[A-Za-z0-9]{20,}\b")
HIDDEN = "set (hidden)"


def env_command_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "env", help="print versions, GPUs and settings to paste into a bug report",
        description="Print the versions of Python, torch (and its CUDA or ROCm build), Transformers, Accelerate, "
        "DeepSpeed (with the ops it has built), peft, TRL, bitsandbytes and flash-attn; the GPUs with their memory "
        "and compute capability; NCCL; the default Accelerate config; and the variables that change a run. "
        "Secrets are never printed.",
    )
    parser.add_argument("--json", action="store_true", help="print the same as one JSON object")
    parser.set_defaults(func=env_command)


def env_command(args) -> int:
    import json

    report = environment_report()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print("Paste this block into your bug report:\n")
    for key, value in report.items():
        if "\n" in str(value):
            print(f"- {key}:")
            print("\n".join(f"    {line}" for line in str(value).splitlines()))
        else:
            print(f"- {key}: {value}")
    return 0


def environment_report() -> dict[str, str]:
    import platform

    report = {"Platform": platform.platform(), "Python": platform.python_version()}
    report.update({name: package_version(name) for name in PACKAGES})
    report.update(torch_report())
    report["DeepSpeed ops"] = deepspeed_ops()
    report["Accelerate default config"] = accelerate_default_config()
    report["Environment"] = "; ".join(f"{name}={value}" for name, value in variables(os.environ).items()) or "–"
    return {key: hide_tokens(str(value)) for key, value in report.items()}


def package_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def torch_report() -> dict[str, str]:
    import torch

    from finetune.launch.devices import visible_gpus

    if torch.version.hip:
        build = f"ROCm {torch.version.hip}"
    elif torch.version.cuda:
        build = f"CUDA {torch.version.cuda}"
    else:
        build = "CPU only"
    gpus = visible_gpus()
    listed = "; ".join(f"{index}: {gpu.name}, {gpu.memory_gib:.1f} GiB, compute capability "
                       f"{gpu.compute_capability[0]}.{gpu.compute_capability[1]}" for index, gpu in enumerate(gpus))
    nccl = "–"
    if gpus and torch.distributed.is_nccl_available():
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return {"torch build": build, "GPUs": f"{len(gpus)} ({listed})" if gpus else "none visible", "NCCL": nccl}


def deepspeed_ops() -> str:
    """The ops DeepSpeed was installed with (`DS_BUILD_*`) and those it has compiled on first use into torch's
    extension folder (CPU Adam for offload, ...), naming a build that was stopped half-way: torch leaves its `lock`
    file there, and every later run that needs the op waits on it forever."""
    import contextlib
    import importlib.util
    import io

    if importlib.util.find_spec("deepspeed") is None:
        return "DeepSpeed not installed"
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed's import logs its accelerator to stdout
        from deepspeed.git_version_info import installed_ops
    prebuilt = sorted(name for name, built in installed_ops.items() if built)
    compiled, stuck, root = compiled_extensions()
    line = (f"installed with: {', '.join(prebuilt) or 'none'}; compiled on first use: {', '.join(compiled) or 'none'}"
            f" (in {root})")
    if stuck:
        line += (f"; build stopped half-way, its lock left behind (runs needing it wait forever): "
                 f"{', '.join(str(folder) for folder in stuck)}: delete the folder, it rebuilds on next use")
    return line


def compiled_extensions():
    """(ops compiled, folders of builds stopped half-way, the extension folder) under torch's extension folder
    (`TORCH_EXTENSIONS_DIR`, else its default root with one folder per Python and accelerator build)."""
    from pathlib import Path

    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    folders = [path for path in (*root.glob("*"), *root.glob("*/*")) if path.is_dir()] if root.is_dir() else []
    compiled = sorted({folder.name for folder in folders if any(folder.glob("*.so"))})
    stuck = sorted(folder for folder in folders if (folder / "lock").exists() and not any(folder.glob("*.so")))
    return compiled, stuck, root


def accelerate_default_config() -> str:
    """The config `accelerate launch` reads when none is named, secrets hidden; "none" without one."""
    import json
    from pathlib import Path

    import yaml
    from accelerate.commands.config import default_config_file

    path = Path(default_config_file)
    if not path.is_file():
        return f"none ({path})"
    try:
        text = path.read_text()
        config = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as error:
        return f"{path} (unreadable: {str(error).splitlines()[0]})"
    return f"{path}\n{yaml.safe_dump(hide_secret_keys(config), sort_keys=False).rstrip()}"


def hide_secret_keys(value):
    if isinstance(value, dict):
        return {key: HIDDEN if SECRET_NAME.search(str(key)) and item not in (None, "", False)
                else hide_secret_keys(item) for key, item in value.items()}
    if isinstance(value, list):
        return [hide_secret_keys(item) for item in value]
    return value


def variables(environ) -> dict[str, str]:
    chosen = {name: value for name, value in sorted(environ.items())
              if name in VARIABLES or name.startswith(VARIABLE_PREFIXES)}
    return {name: HIDDEN if SECRET_NAME.search(name) else value for name, value in chosen.items()}


def hide_tokens(text: str) -> str:
    return TOKEN_SHAPE.sub("[hidden token]", text)
