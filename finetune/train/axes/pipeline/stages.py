"""A pipeline's stages: the decoder's layers cut into consecutive stages (`cut_stage`), each split over the tensor-
parallel ranks of its stage as the model's TP plan says (`split_layers`), and filled from the checkpoint by name, one
tensor at a time, each rank reading only its own (`fill_from_checkpoint`); with LoRA, the adapters drawn as one
process draws them (`initialise_adapters`). The loop that trains them is `loop`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME as FINAL_INDEX
from transformers.utils import SAFE_WEIGHTS_NAME

from finetune import presets
from finetune.errors import RecipeError
from finetune.train.axes.pipeline.layout import pipeline_stage_layers
from finetune.train.axes.tensor import KEY as TENSOR_KEY

FINAL_SHARD = "model-{stage:05d}-of-{stages:05d}.safetensors"  # the final model: one shard a stage, as Transformers
# names the shards of a sharded save; its index and single-file names are Transformers' own


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """Consecutive decoder layers for each stage (the estimator's split: `pipeline_stage_layers`), refused where a
    stage would hold none."""
    if stages > num_layers:
        raise RecipeError(f"`pipeline_parallel_size: {stages}` is more stages than the model has layers "
                          f"({num_layers}): each stage holds at least one.")
    return pipeline_stage_layers(num_layers, stages)


# Model types whose decoder runs exactly embed_tokens → layers(hidden, position_embeddings) → norm → lm_head, which the
# stages re-run piece by piece. Others of the same layout change something between the pieces (Gemma scales the
# embeddings, Granite multiplies them, Gemma 3 alternates local and global rotary tables), which a stage would
# silently skip: refused by name until their stage is written.
PIPELINE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def decoder_parts(model) -> tuple[nn.Module, nn.Module]:
    """`(decoder, head)`: the Transformers layout every decoder-only model of the Llama family has (embed_tokens,
    layers, norm, rotary_emb under `model.model`; `lm_head`), under peft's wrapper too (LoRA: the adapters live in the
    decoder's own linears)."""
    if hasattr(model, "get_base_model"):  # a PeftModel: its `model` attribute is peft's tuner, not the decoder
        model = model.get_base_model()
    model_type = getattr(model.config, "model_type", None)
    if model_type not in PIPELINE_MODEL_TYPES:
        raise RecipeError(f"pipeline parallelism cuts {', '.join(PIPELINE_MODEL_TYPES)} decoders into stages; this "
                          f"model is `{model_type}`, whose forward does more between its layers than a stage would "
                          "run: train it without pipeline parallelism.")
    layer_types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise RecipeError(f"pipeline parallelism runs every layer with full causal attention; this model mixes "
                          f"{', '.join(sorted(layer_types))} layers (`layer_types` in its config).")
    decoder = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if decoder is None or not all(hasattr(decoder, name) for name in needed) or not hasattr(model, "lm_head"):
        raise RecipeError(f"pipeline parallelism cuts a decoder laid out as Llama's (model.embed_tokens, "
                          f"model.layers, model.norm, model.rotary_emb, lm_head); {type(model).__name__} is not.")
    return decoder, model.lm_head


def check_attention(model, max_length: int) -> None:
    """The stages run causal sdpa/flash attention over whole rows: a sliding window shorter than the rows (Mistral's
    4096 under longer sequences) or eager attention's explicit mask are not what the model would compute."""
    config = model.config
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window and window < max_length:
        raise RecipeError(f"pipeline parallelism runs plain causal attention, but {type(model).__name__} attends "
                          f"through a sliding window of {window} tokens, shorter than `max_seq_length: "
                          f"{max_length}`: lower max_seq_length to {window}, or train without pipeline parallelism.")
    attention = getattr(config, "_attn_implementation", "sdpa")
    if attention == "eager":
        raise RecipeError("pipeline parallelism runs causal attention without a mask, which eager attention does not "
                          "do: set `attn_implementation: sdpa`.")


class PipelineStageModule(nn.Module):
    """One stage of a decoder: the embedding on the first, its layers, the norm and head on the last. Its input is
    the token ids (first) or the previous stage's hidden states, its output the next stage's input or the logits.
    Attention is causal over the whole row (no mask: batches are right-padded, and a pad comes after every token
    that counts). With `hand_off` (bf16) the hidden states leave the stage in that dtype and the next stage takes them
    back into its residual's (the embedding's) dtype: half the bytes sent, and their gradients sent back in it too
    (autograd casts them)."""

    def __init__(self, model, stage: int, stages: int, layers: range, hand_off: torch.dtype | None = None):
        super().__init__()
        decoder, head = decoder_parts(model)
        self.first, self.last = stage == 0, stage == stages - 1
        self.embed_tokens = decoder.embed_tokens if self.first else None
        self.layers = nn.ModuleList(decoder.layers[index] for index in layers)
        self.rotary_emb = decoder.rotary_emb
        self.norm = decoder.norm if self.last else None
        self.lm_head = head if self.last else None
        self.hand_off, self.residual_dtype = hand_off, decoder.embed_tokens.weight.dtype

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.first:
            hidden = self.embed_tokens(hidden)
        elif self.hand_off is not None:
            hidden = hidden.to(self.residual_dtype)
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(hidden, positions)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=None, position_ids=positions,
                           position_embeddings=position_embeddings)
            if isinstance(hidden, tuple):
                hidden = hidden[0]
        if self.last:
            return self.lm_head(self.norm(hidden))
        return hidden if self.hand_off is None else hidden.to(self.hand_off)


@dataclass
class Stage:
    """This rank's stage: its module, the names its parameters have in the whole model, and which one (if any) is a
    tied embedding shared with the other end of the pipeline."""

    index: int
    count: int
    layers: range
    module: PipelineStageModule
    names: dict[int, str]        # id(parameter) -> its name in the whole model
    tied: nn.Parameter | None    # the tied input/output embedding, held by the first and the last stage
    shape: object = None         # the whole model's ModelShape (finetune.memory.shapes), taken before the cut
    mesh: object = None          # the (dp, pp, tp) DeviceMesh of the launch (`pipeline_mesh`)
    tensor_parallel: int = 1     # ranks the stage's layers are split over (`split_layers`)
    summed_over_tp: list = field(default_factory=list)  # whole weights each TP rank trains on its own heads

    @cached_property
    def named(self) -> list[tuple[str, nn.Parameter]]:
        """The stage's parameters once each (a tied one is one), by their names in the whole model."""
        unique = {id(parameter): parameter for parameter in self.module.parameters()}
        return [(self.names[key], parameter) for key, parameter in unique.items()]

    @cached_property
    def trained(self) -> list[tuple[str, nn.Parameter]]:
        """What the optimizer steps, the checkpoints hold and a resume reads: every parameter in full fine-tuning,
        the adapters under LoRA (the frozen base is read again from the model's checkpoint)."""
        return [(name, parameter) for name, parameter in self.named if parameter.requires_grad]

    @cached_property
    def counted_in_norm(self) -> list[nn.Parameter]:
        """What this stage adds to the gradient norm over all stages: the tied weight is counted on the first only."""
        return [parameter for _, parameter in self.named if not (self.index > 0 and parameter is self.tied)]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `tensor`: its slice of a DTensor (the same storage), a plain tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` unsplit: a DTensor gathered from its TP group (every rank of the group must call it), a plain tensor
    itself."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def placed_like(parameter: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """`full` (a whole tensor of `parameter`'s shape) as `parameter` is held: this rank's slice where the TP plan
    split it, cut locally (every rank of the group holds `full`), else `full` itself."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(parameter, DTensor):
        return full
    return distribute_tensor(full, parameter.device_mesh, parameter.placements, src_data_rank=None)


def pipeline_mesh(device_type: str, stages: int, tensor_parallel: int):
    """The launch's (`dp`, `pp`, `tp`) DeviceMesh, TP innermost (within a node on a GPU cluster): global rank
    r·p·t + s·t + k is tensor rank k of stage s in replica r, and stage to stage traffic runs between ranks of the
    same tensor rank."""
    from torch.distributed.device_mesh import init_device_mesh

    replicas = dist.get_world_size() // (stages * tensor_parallel)
    return init_device_mesh(device_type, (replicas, stages, tensor_parallel), mesh_dim_names=("dp", "pp", "tp"))


# The TP plan's styles the stages apply (Transformers' names in `base_model_tp_plan`): torch's column- and row-parallel
# linears, and whole weights that each rank trains on its own heads (Qwen3's q/k norms), their gradients summed.
SPLIT_STYLES = ("colwise", "rowwise")
SUMMED_STYLE = "replicated_with_grad_allreduce"


def split_layers(stage: Stage, mesh, config) -> None:
    """This stage's decoder layers tensor-parallel over the 1-D `mesh`, as the model's TP plan names each linear
    (`config.base_model_tp_plan`), with torch's `ColwiseParallel` and `RowwiseParallel`: each rank computes its
    heads and its share of the MLP's width, one all-reduce after the attention and one after the MLP (Megatron-LM's
    split, as torchtitan composes it with pipelining). The embedding, norms and head stay whole on every rank, so a
    stage's input and output are whole hidden states. On the meta device too: the slices are read later."""
    from fnmatch import fnmatch

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan, summed = {}, []
    for pattern, style in (getattr(config, "base_model_tp_plan", None) or {}).items():
        if not pattern.startswith("layers."):
            continue  # the ends: whole on every rank
        if style not in (*SPLIT_STYLES, SUMMED_STYLE):
            raise RecipeError(f"`{TENSOR_KEY}` beside a pipeline splits layers as colwise or rowwise; this "
                              f"model's TP plan splits `{pattern}` as `{style}`, which the stages do not run: train "
                              f"it without {TENSOR_KEY}.")
        if style == SUMMED_STYLE:
            summed.append(pattern)
        else:
            plan[pattern] = ColwiseParallel() if style == "colwise" else RowwiseParallel()
    names = {path: stage.names[id(parameter)] for path, parameter in stage.module.named_parameters()}
    parallelize_module(stage.module, mesh, plan, src_data_rank=None)  # every rank holds the same whole weights
    held = dict(stage.module.named_parameters())
    stage.names = {id(parameter): names[path] for path, parameter in held.items()}
    stage.summed_over_tp = [parameter for path, parameter in held.items()
                            if any(fnmatch(path, f"{pattern}.*") for pattern in summed)]
    stage.tensor_parallel = mesh.size()
    for cached in ("named", "trained", "counted_in_norm"):  # the split parameters are new objects
        stage.__dict__.pop(cached, None)

def build_stage(model, stage: int, stages: int, hand_off: str = "fp32") -> Stage:
    """This rank's stage, cut from the whole model; the layers of the other stages are dropped (freed). `hand_off`:
    the dtype the hidden states pass between stages in (fp32: as the stage computes them)."""
    decoder, head = decoder_parts(model)
    bounds = stage_layers(len(decoder.layers), stages)
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    module = PipelineStageModule(model, stage, stages, bounds[stage],
                                 hand_off=torch.bfloat16 if hand_off == "bf16" else None)
    tied = None
    if getattr(model.config, "tie_word_embeddings", False) and head.weight is decoder.embed_tokens.weight \
            and stages > 1 and (stage == 0 or stage == stages - 1):
        tied = decoder.embed_tokens.weight
    kept = {id(parameter) for parameter in module.parameters()}
    with torch.no_grad():  # the other stages' weights: freed (the model object keeps its config and names)
        for parameter in model.parameters():
            if id(parameter) not in kept and not parameter.is_meta:  # on the meta device they hold nothing
                parameter.data = torch.empty(0, dtype=parameter.dtype)
    return Stage(stage, stages, bounds[stage], module, names, tied)


def loads_stage_only(model_args) -> bool:
    """Whether each rank builds the model on the meta device and reads only its stage's tensors
    (`fill_from_checkpoint`): any checkpoint; the `tiny` preset, built in code from its seed, is built whole."""
    return model_args.model_name_or_path != presets.TINY_MODEL


def cut_stage(recipe, model, rank: int | None = None) -> Stage:
    """The stage global rank `rank` holds (this process's by default), `rank` mod the stages, of `model` (as
    `finetune.models.loading.load_model` gave it, on the meta device where `loads_stage_only`), its weights read from
    the checkpoint and held as the method holds them (fp32 masters)."""
    from finetune.memory.shapes import model_shape, shape_of

    check_attention(model, recipe.data.max_seq_length)
    # the whole model's, before the other stages' weights are freed; under LoRA the base's, from its config (peft's
    # adapters and `base_layer` names are no part of the model the estimator counts)
    shape = model_shape(recipe.model.model_name_or_path) if hasattr(model, "peft_config") else shape_of(model)
    rank = dist.get_rank() if rank is None else rank
    size, tensor = recipe.strategy.axis.stages, recipe.strategy.axis.tensor
    stage = build_stage(model, rank // tensor % size, size, recipe.strategy.axis.hand_off)  # (dp, pp, tp), TP inner
    stage.shape = shape
    if dist.is_initialized():
        stage.mesh = pipeline_mesh(recipe.training.device.type, size, tensor)
    if tensor > 1:  # before reading: each rank keeps only its slices
        split_layers(stage, stage.mesh["tp"], model.config)
    if any(parameter.is_meta for _, parameter in stage.trained) and hasattr(model, "peft_config"):
        initialise_adapters(model, stage, recipe.training.seed)
    if any(parameter.is_meta for _, parameter in stage.named):
        fill_from_checkpoint(stage, recipe.model.model_name_or_path)
    return stage


def initialise_adapters(model, stage: Stage, seed: int) -> None:
    """The stage's LoRA adapters with the values a one-process run gives them. peft builds and initialises every
    adapter on the CPU from the global generator, then moves it to its base layer's device: on the meta device the
    draws are made (the same ones, in the same order) and the values dropped. So they are drawn again here, from the
    generator as the run's seed left it before the adapters were added (loading draws nothing), by peft's own
    `reset_lora_parameters` on adapters built as `update_layer` builds them (A: Kaiming-uniform, B: zeros) and cast
    as it casts them (the base layer's dtype, then the dtype they are held in), layer by layer in the whole model's
    order; the stage keeps its own. That the replay consumed what peft consumed is checked:
    the generator must end where peft left it."""
    from peft.tuners.lora import LoraLayer

    wanted = {id(parameter): parameter for _, parameter in stage.trained if parameter.is_meta}
    left_by_peft = torch.get_rng_state()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for module in model.modules():
            if not isinstance(module, LoraLayer):
                continue
            for adapter, config in model.peft_config.items():
                if adapter not in module.lora_A:
                    continue
                held = module.lora_A[adapter], module.lora_B[adapter]
                module.lora_A[adapter] = nn.Linear(held[0].in_features, held[0].out_features, bias=False)
                module.lora_B[adapter] = nn.Linear(held[1].in_features, held[1].out_features,
                                                   bias=held[1].bias is not None)
                module.reset_lora_parameters(adapter, config.init_lora_weights)
                # then cast to the base layer's dtype, as peft does before upcasting adapters to fp32 (its
                # `autocast_adapter_dtype`): a bf16 base's adapters start bf16-rounded
                module._move_adapter_to_device_of_base_layer(adapter, device=torch.device("cpu"))
                drawn = module.lora_A[adapter], module.lora_B[adapter]
                module.lora_A[adapter], module.lora_B[adapter] = held
                with torch.no_grad():
                    for old, new in zip((*held[0].parameters(), *held[1].parameters()),
                                        (*drawn[0].parameters(), *drawn[1].parameters()), strict=True):
                        if id(old) in wanted:
                            torch.utils.swap_tensors(old, nn.Parameter(new.detach().to(old.dtype)))
        replayed = torch.get_rng_state()
    if not torch.equal(replayed, left_by_peft):
        raise RuntimeError("the pipeline stage's LoRA adapters could not be drawn as a one-process run draws them: "
                           "the random generator was used between the seed and peft's adapters")
    if any(parameter.is_meta for parameter in wanted.values()):
        raise RuntimeError("the pipeline stage holds trainable parameters on the meta device that are no LoRA "
                           "adapters")


def checkpoint_name(name: str) -> str:
    """A parameter's name in the model's checkpoint: under LoRA peft's wrapper prefix and the adapted linears'
    `base_layer` dropped (`base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight` is
    `model.layers.0.self_attn.q_proj.weight`)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def checkpoint_files(source: str) -> tuple[Path, dict[str, str]]:
    """`(folder, {tensor name: safetensors file})` of a checkpoint: a local folder, or a hub id read through the
    hub's cache (downloaded there first if it is not yet: `from_pretrained` would have downloaded it too)."""
    folder = Path(source).expanduser()
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(source, allow_patterns=["*.safetensors", "*.json"]))
    index = folder / FINAL_INDEX
    if index.is_file():
        return folder, json.loads(index.read_text())["weight_map"]
    single = folder / SAFE_WEIGHTS_NAME
    if single.is_file():
        from finetune.models.loading import safetensors_entries

        return folder, {key: single.name for _, key, _, _ in safetensors_entries([single])}
    raise RecipeError(f"pipeline parallelism reads each stage's weights from safetensors, and `{source}` has none "
                      "(model.safetensors or model.safetensors.index.json): convert its weights to safetensors "
                      "where you trust the files, or train without pipeline parallelism.")


def fill_from_checkpoint(stage: Stage, source: str) -> int:
    """Gives each of the stage's parameters still on the meta device its tensor from the checkpoint, read by name
    (safetensors reads only what is asked) and cast to the parameter's dtype one tensor at a time; returns the
    elements read. The other stages' tensors are never read."""
    from safetensors import safe_open

    wanted = {checkpoint_name(name): parameter for name, parameter in stage.named if parameter.is_meta}
    folder, files = checkpoint_files(source)
    missing = sorted(name for name in wanted if name not in files)
    if missing:
        raise RecipeError(f"the checkpoint `{source}` lacks {len(missing)} of stage {stage.index}'s tensors "
                          f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): its names are not the "
                          "model's own, which the pipeline's stages read; train it without pipeline parallelism.")
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files[name], []).append(name)
    read = 0
    with torch.no_grad():
        for file, names in sorted(by_file.items()):
            for name in names:
                # opened for each tensor: safetensors maps the file, and the pages a read touched stay resident
                # until it is closed (measured: the stage again, as stored, on top of its fp32 masters)
                with safe_open(str(folder / file), framework="pt") as handle:
                    tensor = handle.get_tensor(name)
                parameter = wanted[name]
                if tuple(tensor.shape) != tuple(parameter.shape):
                    raise RecipeError(f"`{name}` is {tuple(tensor.shape)} in `{source}` but "
                                      f"{tuple(parameter.shape)} in the model its config.json describes.")
                held = nn.Parameter(placed_like(parameter, tensor.to(parameter.dtype)),  # a TP rank's slice
                                    requires_grad=parameter.requires_grad)
                del tensor
                torch.utils.swap_tensors(parameter, held)  # every module holding it (a tied head) sees it
                read += parameter.numel()
    return read
