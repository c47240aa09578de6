"""Adapter keys (finetune.models.lora.lora_config): DoRA, rsLoRA, `modules_to_save` and the target presets reach
peft as
asked, the estimator counts what peft trains, and a name that matches nothing stops while the recipe is read. The
2-process runs under DDP and ZeRO-3 are in tests/models/test_adapters_distributed.py."""

import math

import pytest
from support import PROJECT_ROOT
from transformers import AutoModelForCausalLM

from finetune import presets
from finetune.errors import RecipeError
from finetune.memory.estimate import Setup, lora_trainable_parameters
from finetune.memory.shapes import attention_projections, model_shape
from finetune.models.lora import apply_lora
from finetune.recipe.args import LoraArguments
from finetune.recipe.parse import parse_recipe

DEMO = PROJECT_ROOT / "recipes" / "demo.yaml"
ADAPTERS = {
    "lora": {},
    "dora": {"use_dora": True},
    "rslora": {"use_rslora": True},
    "attention": {"lora_target_modules": ["attention"]},
    "all-linear": {"lora_target_modules": ["all-linear"]},
    "named": {"lora_target_modules": ["q_proj", "v_proj"]},
    "head saved": {"modules_to_save": ["lm_head"]},
    "dora, embeddings and head saved": {"use_dora": True, "modules_to_save": ["embed_tokens", "lm_head"]},
}


def tiny_model():
    return presets.build_model(presets.build_tokenizer(), seed=0)


def trainable(model) -> int:
    return sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)


def predicted(model_source, lora: LoraArguments) -> int:
    setup = Setup(lora_rank=lora.lora_r, dora=lora.use_dora,
                  lora_target_modules=tuple(lora.lora_target_modules) if lora.lora_target_modules else None,
                  lora_modules_to_save=tuple(lora.modules_to_save) if lora.modules_to_save else None)
    return lora_trainable_parameters(model_shape(model_source), setup)


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_the_estimator_counts_what_peft_trains_on_a_tied_and_an_untied_model(name, hub_model_dir):
    lora = LoraArguments(use_lora=True, lora_r=8, **ADAPTERS[name])
    tied = apply_lora(tiny_model(), lora)
    assert trainable(tied) == predicted(presets.TINY_MODEL, lora)
    untied = apply_lora(AutoModelForCausalLM.from_pretrained(hub_model_dir), lora)
    assert trainable(untied) == predicted(str(hub_model_dir), lora)


def test_each_key_reaches_peft_as_asked():
    model = apply_lora(tiny_model(), LoraArguments(use_lora=True, lora_r=4, lora_alpha=8, use_dora=True,
                                                   use_rslora=True, modules_to_save=["lm_head"]))
    config = model.peft_config["default"]
    assert config.use_dora and config.use_rslora
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.scaling["default"] == pytest.approx(8 / math.sqrt(4))  # rsLoRA: alpha / sqrt(r), not alpha / r
    assert layer.lora_magnitude_vector["default"].weight.shape == (layer.out_features,)  # DoRA's magnitude
    saved = [name for name, parameter in model.named_parameters() if parameter.requires_grad and "lora" not in name]
    assert saved and all("modules_to_save" in name for name in saved)  # the head's trainable copy, nothing else


def test_the_attention_preset_adapts_the_attention_projections_only(hub_model_dir):
    model = AutoModelForCausalLM.from_pretrained(hub_model_dir)
    assert attention_projections(model) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    adapted = apply_lora(model, LoraArguments(use_lora=True, lora_target_modules=["attention"]))
    assert set(adapted.peft_config["default"].target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert not any("mlp" in name and "lora_" in name for name, _ in adapted.named_parameters())


@pytest.mark.parametrize("options, message", [
    ({"use_dora": True}, r"`use_dora` configures LoRA adapters but `use_lora` is false: set `use_lora: true`"),
    ({"use_lora": True, "lora_target_modules": ["attention", "q_proj"]},
     r"mixes the preset `attention` with other names: give the preset alone"),
])
def test_adapter_keys_that_cannot_work_are_refused_while_parsing(options, message):
    with pytest.raises(RecipeError, match=message):
        LoraArguments(**options)


@pytest.mark.parametrize("key, value, message", [
    ("modules_to_save", "lm_haed", r"`modules_to_save: lm_haed` matches no module of LlamaForCausalLM \(did you "
                                   r"mean `lm_head`\?\).*its modules are named: .*embed_tokens"),
    ("lora_target_modules", "qproj", r"`lora_target_modules: qproj` matches no module of LlamaForCausalLM \(did "
                                     r"you mean `q_proj`\?\)"),
])
def test_a_module_name_that_matches_nothing_stops_while_the_recipe_is_read(key, value, message):
    with pytest.raises(RecipeError, match=message):
        parse_recipe(DEMO, ["--use_lora", "true", f"--{key}", value])
