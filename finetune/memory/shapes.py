"""A model's shape for memory planning: parameter counts read from an empty (meta-device) instance of the model.

`model_shape(name)` takes the `tiny` preset, a well-known name from `KNOWN_SHAPES`, a local `config.json` or
model directory, or a hub id (only its `config.json` is fetched). Nothing is allocated: the model is built
under `accelerate.init_empty_weights`, so counts are exact for any architecture Transformers knows.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from finetune import presets
from finetune.errors import RecipeError, did_you_mean

# Public config.json values of well-known models, so planning works offline.
KNOWN_SHAPES = {
    "meta-llama/Llama-2-7b-hf": dict(
        model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=False),
    "meta-llama/Meta-Llama-3-8B": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "meta-llama/Llama-3.2-1B": dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "meta-llama/Meta-Llama-3-70B": dict(
        model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False),
    "Qwen/Qwen2.5-0.5B": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "Qwen/Qwen2.5-7B": dict(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    "mistralai/Mistral-7B-v0.1": dict(
        model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
}
# Short names people type: "llama-3-8b", "qwen2.5-7b", "mistral-7b".
ALIASES = {
    "llama-2-7b": "meta-llama/Llama-2-7b-hf",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
    "llama-3-8b": "meta-llama/Meta-Llama-3-8B",
    "llama-3-70b": "meta-llama/Meta-Llama-3-70B",
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "mistral-7b": "mistralai/Mistral-7B-v0.1",
}


@dataclass(frozen=True)
class LinearShape:
    name: str
    in_features: int
    out_features: int
    in_layers: bool  # inside the repeated decoder blocks (what QLoRA quantizes and LoRA adapts)


# Where Transformers' vision-language models keep their parts, by module name: the vision tower (Qwen2-VL's `visual`,
# LLaVA's and Gemma 3's `vision_tower`, Idefics3's and SmolVLM's `vision_model`), the projector (LLaVA's and Gemma 3's
# `multi_modal_projector`, Qwen2-VL's `merger` inside its tower, Idefics3's `connector`), the language model
TOWER_NAMES = ("visual", "vision_tower", "vision_model", "vision_encoder")
PROJECTOR_NAMES = ("multi_modal_projector", "merger", "deepstack_merger_list", "connector", "mm_projector")
LANGUAGE_MODEL_NAMES = ("language_model",)


@dataclass(frozen=True)
class VisionShape:
    """A vision-language model's vision side (`vision_parameter_names` names its parts): the tower's and the
    projector's parameters, and the tower's widths, for its activations."""
    tower_parameters: int
    projector_parameters: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    patches_per_token: int  # patches merged into one image token (Qwen2-VL: spatial_merge_size²)
    patch_elements: int  # pixel values of one patch (channels × frames × patch side²)


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_parameters: int          # unique parameters (tied embeddings counted once)
    largest_layer_parameters: int  # the biggest single module's own parameters (DeepSpeed's `largest_layer_params`)
    layer_parameters: int        # one decoder block's parameters
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    linears: tuple[LinearShape, ...]
    tied_embeddings: bool = False  # the output head is the input embedding (one matrix)
    attention_projections: tuple[str, ...] = ()  # names of the linears inside attention modules (by class)
    vision: VisionShape | None = None  # a vision-language model's vision tower and projector

    @property
    def kv_width(self) -> int:
        """Features of one token's key (or value) in one layer: the key projection's outputs (its heads × head
        size), else what the attention heads give."""
        key = next((linear for linear in self.linears if linear.in_layers and linear.name.endswith("k_proj")), None)
        if key is not None:
            return key.out_features
        return self.hidden_size // self.num_attention_heads * self.num_key_value_heads

    @property
    def block_linear_parameters(self) -> int:
        return sum(linear.in_features * linear.out_features for linear in self.linears if linear.in_layers)

    def lora_parameters(self, rank: int, target_modules: list[str] | None = None) -> int:
        """Adapter parameters r·(d_in + d_out) per adapted matrix; `None` targets every linear in the blocks
        (peft's "all-linear", which leaves the output head alone)."""
        targets = [linear for linear in self.linears if linear.in_layers and (
            target_modules is None or linear.name.rsplit(".", 1)[-1] in target_modules)]
        if not targets:
            names = sorted({linear.name.rsplit(".", 1)[-1] for linear in self.linears if linear.in_layers})
            raise RecipeError(f"LoRA targets {target_modules} match no linear layer of {self.name}; "
                              f"its linear layers are: {', '.join(names)}.")
        return sum(rank * (linear.in_features + linear.out_features) for linear in targets)


def resolve_config(name: str):
    """A Transformers config for `name`, without weights and without the hub when it is not needed."""
    from transformers import AutoConfig

    if name == presets.TINY_MODEL:
        return presets.build_model_config(presets.build_tokenizer())
    if name == presets.TINY_VL_MODEL:
        return presets.build_vl_config(presets.build_vl_tokenizer())
    known = KNOWN_SHAPES.get(ALIASES.get(name.lower(), name))
    if known is not None:
        fields = dict(known)
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    path = Path(name)
    if path.is_file() and path.name.endswith(".json"):
        path = path.parent
    if path.exists():
        if not (path / "config.json").is_file():
            raise RecipeError(f"{name} has no config.json: give a model directory written by save_pretrained, "
                              f"its config.json, or one of: {', '.join(known_names())}.")
        try:
            return AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as error:
            raise RecipeError(f"cannot read the config of {name} ({str(error).splitlines()[0]}): the estimator "
                              "knows the architectures this Transformers knows.") from None
    try:
        return AutoConfig.from_pretrained(name)  # a hub id: fetches config.json only
    except (OSError, ValueError) as error:
        raise RecipeError(
            f"cannot read a config for model {name!r} ({str(error).splitlines()[0]}). Give a local model "
            f"directory or config.json, or a known shape{did_you_mean(name, known_names())}: "
            f"{', '.join(known_names())}."
        ) from None


def known_names() -> list[str]:
    return [presets.TINY_MODEL, *ALIASES]


@lru_cache(maxsize=16)
def model_shape(name: str) -> ModelShape:
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = resolve_config(name)
    try:
        with init_empty_weights():
            if hasattr(config, "vision_config"):  # a vision-language model
                from transformers import AutoModelForImageTextToText

                model = AutoModelForImageTextToText.from_config(config)
            else:
                model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as error:  # a config with no causal-LM class in this Transformers
        raise RecipeError(f"cannot build a causal LM from the config of {name} ({str(error).splitlines()[0]}).") \
            from None
    model.tie_weights()  # not done for empty weights; without it a tied head is counted twice
    return shape_of(model, name)


def shape_of(model, name: str | None = None) -> ModelShape:
    """The shape of a live or empty model; under ZeRO-3 a parameter's full size is its `ds_numel`."""
    import torch

    def numel(parameters) -> int:
        return sum(getattr(p, "ds_numel", p.numel()) for p in parameters)

    layers = _decoder_layers(model)
    layer_ids = {id(module) for layer in layers for module in layer.modules()}
    linears = tuple(
        LinearShape(module_name, module.in_features, module.out_features, id(module) in layer_ids)
        for module_name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and "lora_" not in module_name
    )
    text = model.config.get_text_config()
    heads = text.num_attention_heads
    return ModelShape(
        name=name or getattr(model.config, "name_or_path", "") or type(model).__name__,
        num_parameters=numel(model.parameters()),  # parameters() yields a tied weight once
        largest_layer_parameters=max(numel(module.parameters(recurse=False)) for module in model.modules()),
        layer_parameters=numel(layers[0].parameters()),
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
        num_layers=len(layers),
        num_attention_heads=heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
        linears=linears,
        tied_embeddings=_tied_embeddings(model),
        attention_projections=tuple(attention_projections(model)),
        vision=vision_shape(model),
    )


def part_of(name: str, names: tuple[str, ...]) -> bool:
    """Whether a parameter or module name lies inside a module named one of `names`."""
    return any(piece in names for piece in name.split("."))


def vision_parameter_names(model) -> dict[str, list[str]]:
    """The parameter names of the vision tower (without the projector inside it, as Qwen2-VL's `merger`), of the
    projector, and of the language model with its head: `{"tower", "projector", "language"}`."""
    parts = {"tower": [], "projector": [], "language": []}
    for name, _ in model.named_parameters():
        if part_of(name, PROJECTOR_NAMES):
            parts["projector"].append(name)
        elif part_of(name, TOWER_NAMES):
            parts["tower"].append(name)
        else:
            parts["language"].append(name)
    if not parts["tower"]:
        raise RecipeError(f"no vision tower found in {type(model).__name__} (no module named "
                          f"{', '.join(TOWER_NAMES)}): it cannot be trained as a vision-language model here.")
    return parts


def vision_shape(model) -> VisionShape | None:
    """The vision side of a vision-language model (None for a text model)."""
    vision = getattr(model.config, "vision_config", None)
    if vision is None:
        return None
    parts = vision_parameter_names(model)
    sizes = dict((name, getattr(parameter, "ds_numel", parameter.numel())) for name, parameter
                 in model.named_parameters())
    hidden = getattr(vision, "embed_dim", None) or vision.hidden_size
    ratio = getattr(vision, "mlp_ratio", None)
    return VisionShape(
        tower_parameters=sum(sizes[name] for name in parts["tower"]),
        projector_parameters=sum(sizes[name] for name in parts["projector"]),
        hidden_size=hidden,
        intermediate_size=int(hidden * ratio) if ratio else getattr(vision, "intermediate_size", 4 * hidden),
        num_layers=getattr(vision, "depth", None) or getattr(vision, "num_hidden_layers", 1),
        num_attention_heads=getattr(vision, "num_heads", None) or getattr(vision, "num_attention_heads", 1),
        patches_per_token=(getattr(vision, "spatial_merge_size", None) or 1) ** 2,
        patch_elements=(getattr(vision, "in_channels", None) or getattr(vision, "num_channels", None) or 3)
        * (getattr(vision, "temporal_patch_size", None) or 1) * (getattr(vision, "patch_size", None) or 14) ** 2,
    )


def attention_projections(model) -> list[str]:
    """The names of the linear layers directly inside the model's attention modules (by class: `LlamaAttention`,
    `Qwen2Attention`, `GPTNeoXAttention`, ...): `q_proj`, `k_proj`, `v_proj`, `o_proj` in Llama-style models,
    `query_key_value` and `dense` in GPT-NeoX. Found by type, so any family Transformers models this way works; the
    `attention` preset of `lora_target_modules` adapts these (finetune.models.loading) and the estimator counts them."""
    import torch

    names = set()
    for module in model.modules():
        if type(module).__name__.endswith("Attention"):
            names.update(name for name, child in module.named_children() if isinstance(child, torch.nn.Linear))
    return sorted(names)


def _tied_embeddings(model) -> bool:
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embedding is not None and head.weight is embedding.weight


def _decoder_layers(model):
    """The repeated blocks: the largest `ModuleList` in the model (`model.layers`, `transformer.h`, ...); in a
    vision-language model, in its language model (its vision tower may have more blocks)."""
    import torch

    inside = model
    if hasattr(model.config, "vision_config"):
        inside = next((module for name, module in model.named_modules()
                       if name.rsplit(".", 1)[-1] in LANGUAGE_MODEL_NAMES), model)
    lists = [module for module in inside.modules() if isinstance(module, torch.nn.ModuleList)]
    if not lists:
        raise RecipeError(f"cannot find the repeated decoder blocks of {type(model).__name__}.")
    return max(lists, key=len)
