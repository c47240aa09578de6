"""Tokenizer and model loading: the `tiny` preset is built in code, anything else goes through `from_pretrained`."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune import presets
from finetune.errors import RecipeError
from finetune.launch.parallelism import Parallelism
from finetune.launch.strategies import Strategy, fsdp_fills_from_rank_zero

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def looks_local(name: str) -> bool:
    """Whether a name can only be a local path, never a hub id (`owner/name`): it starts with `.`, `/` or `~`, has
    more separators than a hub id's one, or its one separator follows a folder that exists here (`models/my-run`
    beside a `models/` folder). Such a name that names nothing must not reach the hub, where it waits on retries."""
    if name.startswith((".", "/", "~", os.sep)) or name.count("/") > 1 or (os.sep != "/" and os.sep in name):
        return True
    return "/" in name and Path(name).parent.is_dir()


def check_local_path(name: str, key: str) -> None:
    """A name that can only be a path (`looks_local`) and names no directory stops here: from_pretrained would take
    it for a hub repo id, malformed or missing, after the hub's retries."""
    if looks_local(name) and not Path(name).expanduser().is_dir():
        found = "a file, not a directory" if Path(name).expanduser().exists() else "no such directory"
        raise RecipeError(f"`{key}: {name}`: {found}; give the folder holding config.json (as save_pretrained "
                          "writes it), or a hub id such as `Qwen/Qwen2.5-0.5B`.")


# Chat templates a recipe may name instead of writing one out (`chat_template: chatml`).
NAMED_TEMPLATES = {
    "chatml": ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
               "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
               "{% endif %}"),
}
TOKENIZER_DEFAULT = "tokenizer_default"  # the tokenizer's own template (axolotl's name for it)


def chat_template_text(value: str) -> str | None:
    """The Jinja text `chat_template` asks for: written out, in a file, or named (`chatml`); None for the tokenizer's
    own (`tokenizer_default`)."""
    if value == TOKENIZER_DEFAULT:
        return None
    if value in NAMED_TEMPLATES:
        return NAMED_TEMPLATES[value]
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise RecipeError(f"`chat_template: {value}`: the file is not UTF-8 text (byte 0x"
                              f"{error.object[error.start]:02x} at offset {error.start}); save it as UTF-8 (e.g. "
                              "`iconv -f latin1 -t utf-8`).") from None
    raise RecipeError(f"`chat_template: {value:.80}` is neither a Jinja template (text with `{{{{ }}}}` or `{{% %}}`), "
                      f"a file holding one, nor one of {', '.join([*NAMED_TEMPLATES, TOKENIZER_DEFAULT])}.")


def load_tokenizer(model_args):
    """The tokenizer, with a pad token and a chat template: the recipe's `chat_template`, else its own, else the
    default for base models."""
    tokenizer = _tokenizer(model_args)
    template = chat_template_text(model_args.chat_template) if getattr(model_args, "chat_template", None) else None
    if template is not None:
        tokenizer.chat_template = template  # saved with the tokenizer, so chat and serving render as training did
    return tokenizer


def _tokenizer(model_args):
    name = model_args.tokenizer_name_or_path or model_args.model_name_or_path
    from finetune.models.vision import is_vision_model

    if is_vision_model(model_args.model_name_or_path):
        from finetune.models.vision.processors import vision_processor

        return vision_processor(model_args)  # its tokenizer, carrying it (finetune.models.vision.processor_of)
    vision_keys = {"min_pixels": model_args.min_pixels, "max_pixels": model_args.max_pixels,
                   "freeze_projector": model_args.freeze_projector,
                   "freeze_vision_tower: false": not model_args.freeze_vision_tower}
    given = [key for key, value in vision_keys.items() if value]
    if given:
        raise RecipeError(f"`{given[0]}` is for a vision-language model; {model_args.model_name_or_path} reads "
                          "text only (its folder has no `vision_config` and no processor).")
    if name == presets.TINY_MODEL:
        return presets.build_tokenizer()
    check_local_path(model_args.model_name_or_path, "model_name_or_path")
    if model_args.tokenizer_name_or_path:
        check_local_path(model_args.tokenizer_name_or_path, "tokenizer_name_or_path")
    with loading_refusals(model_args):
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=model_args.trust_remote_code)
    if tokenizer.pad_token is None:
        # Padding positions carry label -100 and attention 0, so reusing EOS for padding is safe.
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:
        tokenizer.chat_template = presets.CHAT_TEMPLATE  # documented default for base models
    return tokenizer


def load_model(model_args, tokenizer, seed: int = 0, qlora: bool = False, strategy: Strategy | None = None,
               shapes_only: bool = False, parallelism: Parallelism | None = None):
    """The model to train (or a reference to train against). `shapes_only`: its parameters on the meta device, for a
    rank whose weights another rank will send it (`sharded_from_rank_zero`); ignored under QLoRA, whose 4-bit weights
    are quantized while loading. `parallelism` that `loads_sharded`: Transformers loads each rank's slices
    (`DistributedConfig`, finetune.launch.parallelism)."""
    from finetune.models.vision import is_vision_model

    if is_vision_model(model_args.model_name_or_path):
        from finetune.models.vision.loading import load_vision_model

        return load_vision_model(model_args, tokenizer, seed, qlora, parallelism, shapes_only)
    if parallelism is not None and parallelism.loads_sharded:
        return _load_sharded(model_args, tokenizer, seed, parallelism)
    if model_args.model_name_or_path == presets.TINY_MODEL and not qlora:
        dtype = None if model_args.torch_dtype == "auto" else DTYPES[model_args.torch_dtype]
        with _on_meta_device(shapes_only):
            model = presets.build_model(tokenizer, seed=seed, dtype=dtype)
        model.tie_weights()  # built on the meta device, the tie was a second meta Parameter
        if model_args.attn_implementation is not None:  # as from_pretrained takes it: a kernel that cannot run stops
            with loading_refusals(model_args):
                model.set_attn_implementation(model_args.attn_implementation)
        model.config.name_or_path = model.name_or_path = presets.TINY_MODEL  # peft records it as the adapter's base
        return model
    check_local_path(model_args.model_name_or_path, "model_name_or_path")
    if qlora:
        return _load_4bit(model_args, tokenizer, seed, strategy or Strategy("single"))
    if shapes_only:
        return _empty_model(model_args)
    with loading_refusals(model_args):
        model = AutoModelForCausalLM.from_pretrained(
            model_args.model_name_or_path,
            dtype=DTYPES[model_args.torch_dtype],
            attn_implementation=model_args.attn_implementation,
            trust_remote_code=model_args.trust_remote_code,
        )
    model.checkpoint_dtype = stored_dtype(model_args.model_name_or_path) or model.dtype
    return model


def _load_sharded(model_args, tokenizer, seed: int, parallelism: Parallelism):
    """Each rank's slices, from `from_pretrained(..., distributed_config=...)`: the model's own TP plan, FSDP2 over the
    other ranks. The `tiny` preset goes the same way as any checkpoint: built from its seed (the same on every rank)
    and saved to a folder of this rank's, then loaded from there."""
    import tempfile

    name = model_args.model_name_or_path
    with tempfile.TemporaryDirectory(prefix="finetune-tiny-") as scratch:
        if name == presets.TINY_MODEL:  # written as save_pretrained writes it, which under a process group
            from safetensors.torch import save_model  # writes on global rank 0 only

            tiny = presets.build_model(tokenizer, seed=seed)  # attn_implementation: from_pretrained's, below
            tiny.config.save_pretrained(scratch)
            save_model(tiny, str(Path(scratch) / "model.safetensors"), metadata={"format": "pt"})
            name = scratch
        else:
            check_local_path(name, "model_name_or_path")
        with loading_refusals(model_args):
            model = AutoModelForCausalLM.from_pretrained(
                name,
                dtype=DTYPES[model_args.torch_dtype],
                attn_implementation=model_args.attn_implementation,
                trust_remote_code=model_args.trust_remote_code,
                distributed_config=parallelism.distributed_config(),
            )
    own_storage_for_each_slice(model)
    if model_args.model_name_or_path == presets.TINY_MODEL:
        model.config.name_or_path = model.name_or_path = presets.TINY_MODEL  # as the preset built in place records
    else:
        model.checkpoint_dtype = stored_dtype(name) or model.dtype
    return model


def own_storage_for_each_slice(model) -> int:
    """Gives every tensor-parallel slice a storage of its own; returns the bytes freed. Transformers cuts a
    row-split weight (`colwise`: q, k, v, gate, up, the head) out of the whole loaded tensor as a view, which a
    GPU rank copies to its device and so drops; on CPU ranks the view is the rank's tensor and keeps the whole
    matrix alive (measured on the tiny preset, TP 2: 1.81 MB held per rank where the slices are 1.05 MB)."""
    from torch.distributed.tensor import DTensor

    freed = 0
    with torch.no_grad():
        for parameter in model.parameters():
            if not isinstance(parameter, DTensor):
                continue
            local = parameter._local_tensor  # the DTensor's own (to_local() gives an alias of it)
            extra = local.untyped_storage().nbytes() - local.numel() * local.element_size()
            if extra > 0:
                local.set_(local.clone())
                freed += extra
    return freed


def sharded_from_rank_zero(environ=None) -> bool:
    """Whether this process needs only the model's shapes: FSDP2 with `fsdp_cpu_ram_efficient_loading` on a rank
    other than global rank 0. Accelerate then moves every rank's model to the meta device, upcasts the trainable
    weights to fp32, shards, and broadcasts rank 0's full state dict into the shards
    (accelerate/utils/fsdp_utils.py: `fsdp2_prepare_model`, `fsdp2_load_full_state_dict`): a real copy on the
    other ranks would be read from disk and upcast for nothing (8 × 141 GB, then twice that in fp32, on a node
    fine-tuning a 70B)."""
    environ = os.environ if environ is None else environ
    return fsdp_fills_from_rank_zero(environ) and int(environ.get("RANK", "0")) != 0


@contextmanager
def waiting_for_rank_zero_to_load(timeout_seconds: float):
    """Around loading the model: under FSDP2's rank-0 loading the other ranks build it empty in seconds while global
    rank 0 reads the checkpoint (and on a first run downloads it: 141 GB for a 70B in bf16). Their next collective,
    the data's, would wait for it within `ddp_timeout`, which bounds training's collectives (its 1800 s default
    asks > 78 MB/s of that read). So every rank meets after the load in a gloo group of its own, created before it
    while they are together, whose barrier waits `timeout_seconds` (`model_load_timeout`) instead. A rank 0 that
    fails while loading ends its process; the launcher then stops the others."""
    import datetime

    import torch.distributed as dist

    if not (fsdp_fills_from_rank_zero() and dist.is_available() and dist.is_initialized()
            and dist.get_world_size() > 1):
        yield
        return
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_seconds))
    yield
    dist.barrier(group=group)  # global rank 0 arrives once it has read the checkpoint
    dist.destroy_process_group(group)


def _on_meta_device(wanted: bool):
    """Parameters created inside are on the meta device when `wanted` (buffers stay real, as Accelerate needs)."""
    from contextlib import nullcontext

    from accelerate import init_empty_weights

    return init_empty_weights() if wanted else nullcontext()


def materialize_empty_parameters(model) -> int:
    """Gives each parameter still on the meta device (`_empty_model`, and adapters peft put beside it) an
    uninitialised CPU tensor of its shape and dtype, ties kept; returns how many. Before its model is sharded,
    FSDP2's optimizer exists and Accelerate maps its parameters to the shards by address
    (`fsdp2_switch_optimizer_parameters`): meta tensors all have address 0. Never written, these tensors take no
    resident memory until Accelerate moves the model to the meta device and fills the shards from rank 0."""
    materialized: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, parameter in list(module._parameters.items()):
            if parameter is None or not parameter.is_meta:
                continue
            if id(parameter) not in materialized:
                materialized[id(parameter)] = torch.nn.Parameter(torch.empty_like(parameter, device="cpu"),
                                                                 requires_grad=parameter.requires_grad)
            module._parameters[name] = materialized[id(parameter)]
    return len(materialized)


def _empty_model(model_args):
    """The model as from_pretrained would build it, parameters on the meta device (buffers such as the rotary
    frequencies real: Accelerate keeps the non-persistent ones through sharding), with the checkpoint's generation
    config."""
    from transformers import AutoConfig, GenerationConfig

    name = model_args.model_name_or_path
    with loading_refusals(model_args):
        config = AutoConfig.from_pretrained(name, trust_remote_code=model_args.trust_remote_code)
        dtype = DTYPES[model_args.torch_dtype]
        if dtype == "auto":  # what from_pretrained gives rank 0: the checkpoint's own dtype
            dtype = stored_dtype(name) or weights_dtype(name) or torch.float32
        with _on_meta_device(True):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                     attn_implementation=model_args.attn_implementation,
                                                     trust_remote_code=model_args.trust_remote_code)
    keep_in_fp32(model, dtype)  # from_config leaves them in `dtype`; from_pretrained does not
    # Accelerate's init_empty_weights gives every Parameter registered inside a new meta Parameter, so a head tied to
    # the embedding comes out untied; Accelerate maps optimizer parameters to shards by address and would miss it.
    model.tie_weights()
    try:
        model.generation_config = GenerationConfig.from_pretrained(name)
    except OSError:  # none saved: from_pretrained keeps the one derived from the config too
        pass
    model.checkpoint_dtype = stored_dtype(name) or model.dtype
    return model


def safetensors_entries(files: list[Path]):
    """`(file, tensor name, safetensors dtype, shape)` of every tensor in `files`, read from their headers alone."""
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                tensor = handle.get_slice(key)
                yield path, key, tensor.get_dtype(), tensor.get_shape()


def local_safetensors(name: str) -> list[Path]:
    """A local folder's safetensors files, in order; none for anything else (a hub id)."""
    folder = Path(name).expanduser()
    return sorted(folder.glob("*.safetensors")) if folder.is_dir() else []


def weights_dtype(name: str) -> torch.dtype | None:
    """The dtype of a local checkpoint's first floating-point weight, read from its safetensors header: what
    `from_pretrained(dtype="auto")` loads when config.json records none; None where it cannot be read here."""
    floating = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    return next((floating[dtype] for _, _, dtype, _ in safetensors_entries(local_safetensors(name))
                 if dtype in floating), None)


def keep_in_fp32(model, dtype) -> int:
    """Casts to fp32 the parameters Transformers keeps in fp32 when it loads the model in `dtype` (the model's
    `_keep_in_fp32_modules` under fp16, `_keep_in_fp32_modules_strict` under fp16 and bf16: `_get_dtype_plan`),
    matched as it matches them; returns how many. A model built from its config skips that step, and under rank-0
    loading its dtypes must be rank 0's tensor by tensor."""
    from transformers.core_model_loading import build_glob_alternation

    plan = model._get_dtype_plan(dtype) if isinstance(dtype, torch.dtype) else {}
    if not plan:
        return 0
    alternation, groups, _ = build_glob_alternation(list(plan))
    kept = 0
    for name, parameter in model.named_parameters():
        match = alternation.search(name)
        if match is not None and parameter.dtype != plan[groups[match.lastgroup]]:
            parameter.data = parameter.data.to(plan[groups[match.lastgroup]])
            kept += 1
    return kept


def check_same_parameters_on_every_rank(model) -> None:
    """Under FSDP2's rank-0 loading Accelerate broadcasts rank 0's weights into shards every other rank allocated
    from its own empty model, tensor by tensor in that rank's dtype and shape: a mismatch hangs or corrupts the
    broadcast on NCCL. Every rank's `(name, dtype, shape)` list is compared first, and a difference stops every rank
    naming the first tensor that differs."""
    import hashlib

    import torch.distributed as dist
    from accelerate.utils import gather_object

    if not (fsdp_fills_from_rank_zero() and dist.is_available() and dist.is_initialized()
            and dist.get_world_size() > 1):
        return
    digest = [(name, str(parameter.dtype).removeprefix("torch."), tuple(parameter.shape))
              for name, parameter in model.named_parameters()]
    hashes = gather_object([hashlib.sha256(repr(digest).encode()).hexdigest()])
    if len(set(hashes)) == 1:
        return
    digests = gather_object([digest])
    other = next(rank for rank, value in enumerate(hashes) if value != hashes[0])
    first = next((mine, theirs) for mine, theirs in zip(digests[0], digests[other]) if mine != theirs) \
        if len(digests[0]) == len(digests[other]) else (f"{len(digests[0])} parameters", f"{len(digests[other])}")
    raise RecipeError(f"under FSDP2's rank-0 loading rank {other} built the model unlike rank 0 (rank 0: {first[0]}; "
                      f"rank {other}: {first[1]}), so rank 0's weights cannot be broadcast into its shards: give "
                      "`torch_dtype` by name (e.g. bfloat16) in the recipe, or set `fsdp_cpu_ram_efficient_loading: "
                      "false` in the Accelerate config.")


def stored_dtype(name: str) -> torch.dtype | None:
    """The dtype a checkpoint's weights are stored in, as its config.json records it (`dtype`, or `torch_dtype`
    before Transformers 5); None where it records none."""
    from transformers import AutoConfig

    try:
        recorded = AutoConfig.from_pretrained(name).dtype
    except (OSError, ValueError):
        return None
    if isinstance(recorded, str):
        recorded = DTYPES.get(recorded)
    return recorded if isinstance(recorded, torch.dtype) else None


def dtype_name(dtype: torch.dtype) -> str:
    """`bfloat16` for torch.bfloat16: the name config.json and the recipe use."""
    return str(dtype).removeprefix("torch.")


def saved_dtype(model, save_dtype: str) -> torch.dtype | None:
    """The dtype a final save writes a full fine-tune's weights in (`save_dtype`): `auto` is the checkpoint's own
    (recorded at load; fp32 for a model built in code), None where nothing is to change."""
    if save_dtype != "auto":
        return DTYPES[save_dtype]
    return getattr(model, "checkpoint_dtype", None)


@contextmanager
def loading_refusals(model_args):
    """Transformers' own refusals while loading, said in one line naming the recipe key and the fix: custom code
    without `trust_remote_code` (the refusal itself is right), an attention kernel that cannot load (an unknown name,
    flash-attn not installed, no CUDA), a model that cannot be found or fetched (an OSError)."""
    try:
        yield
    except (ImportError, ValueError) as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        if "trust_remote_code" in str(error):
            raise RecipeError(f"`{model_args.model_name_or_path}` ships its own model code, which runs only with "
                              "`trust_remote_code: true`: read that code first, then set it (or use a model "
                              "Transformers supports natively).") from None
        if model_args.attn_implementation is not None and "attn" in str(error).lower().replace("attention", "attn"):
            raise RecipeError(f"`attn_implementation: {model_args.attn_implementation}` cannot be used here: "
                              f"{first_line} Use `sdpa` (any device), or install the kernel's package on a CUDA GPU "
                              "(flash_attention_2: `pip install flash-attn`).") from None
        if "instantiate the backend tokenizer" in str(error):
            name = model_args.tokenizer_name_or_path or model_args.model_name_or_path
            raise RecipeError(f"`{name}` has no tokenizer this machine can load ({first_line.rstrip(': ')}): give "
                              "a folder with tokenizer.json (as save_pretrained writes it) in "
                              "`tokenizer_name_or_path`, or install what its slow tokenizer needs (sentencepiece, "
                              "tiktoken).") from None
        raise
    except OSError as error:  # Transformers' "not a local folder and not a valid model identifier", offline, ...
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise RecipeError(f"`model_name_or_path: {model_args.model_name_or_path}` cannot be loaded: {first_line} "
                          "Give a local folder written by save_pretrained, or a hub id this machine can reach "
                          "(or has in its hub cache).") from None


def trainable_dtype(strategy: Strategy, precision: str, pure_bf16: bool = False) -> torch.dtype | None:
    """The dtype trainable parameters are held in; None where the strategy keeps its own fp32 master copy.

    Under bf16/fp16 mixed precision Trainer autocasts the forward pass but steps the optimizer on the model's own
    tensors: a bf16 checkpoint loaded with `torch_dtype: auto` would train as pure bf16, where an update smaller than
    half a bf16 step (lr 2e-5 on weights of ~0.02) rounds away (measured: 23% of the weights moved in 5 steps, 100%
    from the same model in fp32). So trainable parameters are held in fp32 whatever the checkpoint's dtype, as
    Accelerate's FSDP path does (`fsdp2_prepare_model` upcasts them); frozen base weights keep the loaded dtype.
    DeepSpeed under half precision casts the module itself and keeps fp32 masters (`bf16_optimizer.py`,
    `stage_1_and_2.py`): nothing to do. `pure_bf16` asks by name for bf16 weights, gradients and Adam states."""
    if pure_bf16:
        return torch.bfloat16
    if strategy.kind == "deepspeed" and precision in ("bf16", "fp16"):
        return None
    return torch.float32


def hold_trainable_parameters(model, dtype: torch.dtype | None) -> int:
    """Casts the trainable parameters to `dtype` in place (tied weights stay tied: the Parameter is kept); returns
    how many parameters changed dtype."""
    from torch.distributed.tensor import DTensor

    if dtype is None:
        return 0
    changed = 0
    for parameter in model.parameters():
        if parameter.requires_grad and parameter.dtype != dtype:
            if hasattr(parameter, "ds_tensor"):  # partitioned by ZeRO-3 while loading: its shards are DeepSpeed's
                raise RecipeError(f"the model was loaded in {parameter.dtype} and partitioned by ZeRO-3, but trains "
                                  "without DeepSpeed's half precision, which would keep fp32 master weights: set "
                                  "`bf16: true` (or `fp16: true`), or `torch_dtype: float32`.")
            if isinstance(parameter, DTensor):  # its `.data` setter leaves the local slice as it was
                torch.utils.swap_tensors(parameter, torch.nn.Parameter(parameter.detach().to(dtype)))
            else:
                parameter.data = parameter.data.to(dtype)
            changed += parameter.numel()
    return changed


def _load_4bit(model_args, tokenizer, seed: int, strategy: Strategy):
    from finetune.models.lora import qlora_load  # lora imports this module

    """The QLoRA base as `qlora_load` says, on this process's GPU or ready for the strategy to shard."""
    import os
    import tempfile

    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    load = qlora_load(strategy, model_args.torch_dtype, int(os.environ.get("LOCAL_RANK", "0")))
    source = model_args.model_name_or_path
    with tempfile.TemporaryDirectory() as directory:
        if source == presets.TINY_MODEL:  # quantization happens in from_pretrained: save the preset first
            presets.build_model(tokenizer, seed=seed).save_pretrained(directory)
            source = directory
        with loading_refusals(model_args):
            model = AutoModelForCausalLM.from_pretrained(
                source,
                quantization_config=BitsAndBytesConfig(**load.quantization),
                dtype=load.dtype,
                device_map=load.device_map,
                attn_implementation=model_args.attn_implementation,
                trust_remote_code=model_args.trust_remote_code,
            )
    if load.prepare_for_kbit:
        return prepare_model_for_kbit_training(model)
    model.enable_input_require_grads()  # what the preparation also does, for gradient checkpointing on a frozen base
    return model
