"""A mixture-of-experts model trains with its load-balancing loss on, as TRL does (finetune.models.experts)."""

import json

import pytest
import torch
from hub_fixtures import build_tokenizer

from finetune.cli import main
from finetune.errors import RecipeError
from finetune.models.experts import load_balancing_weight, turn_on_load_balancing


def tiny_mixtral(**changes):
    from transformers import MixtralConfig, MixtralForCausalLM

    sizes = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
             "max_position_embeddings": 64}
    config = MixtralConfig(**{**sizes, **changes})
    torch.manual_seed(0)
    return MixtralForCausalLM(config)


def test_the_load_balancing_loss_is_added_in_training_at_the_checkpoints_weight_and_generation_still_runs():
    model = tiny_mixtral(router_aux_loss_coef=0.5)
    ids = torch.randint(0, 64, (2, 16))
    plain = model(input_ids=ids, labels=ids).loss
    assert turn_on_load_balancing(model, None) == 0.5 and load_balancing_weight(model) == 0.5
    balanced = model(input_ids=ids, labels=ids)
    assert torch.isclose(balanced.loss, plain + 0.5 * balanced.aux_loss)
    assert model.config.output_router_logits is False  # not saved: chat and serve generate without it
    model.eval()
    assert torch.isclose(model(input_ids=ids, labels=ids).loss, plain)  # the eval loss is the language model's
    model.generate(ids[:, :4], attention_mask=torch.ones(2, 4, dtype=torch.long), max_new_tokens=2)


def test_a_weight_of_zero_turns_the_loss_off():
    model = tiny_mixtral()
    ids = torch.randint(0, 64, (1, 8))
    assert turn_on_load_balancing(model, 0.0) == 0.0 and load_balancing_weight(model) == 0.0
    assert model(input_ids=ids, labels=ids).aux_loss is None


def test_a_weight_for_a_model_without_experts_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    assert turn_on_load_balancing(model, None) is None and load_balancing_weight(model) is None
    with pytest.raises(RecipeError, match=r"`router_aux_loss_coef: 0.01`: GPT2LMHeadModel has no experts"):
        turn_on_load_balancing(model, 0.01)


def mixtral_recipe(tmp_path):
    """A recipe training a tiny Mixtral checkpoint (load-balancing weight 0.02, switched off as shipped) on 16 rows."""
    tokenizer = build_tokenizer()
    model = tiny_mixtral(vocab_size=len(tokenizer), router_aux_loss_coef=0.02, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    model.save_pretrained(tmp_path / "moe")
    tokenizer.save_pretrained(tmp_path / "moe")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": f"row {index} of the experts"}) + "\n" for index in range(16)))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: {tmp_path / 'moe'}\ntrain_file: {rows}\nmax_steps: 2\n"
                      "max_seq_length: 64\nper_device_train_batch_size: 2\n")
    return recipe


def test_the_plan_of_a_mixtral_recipe_shows_its_load_balancing_weight(tmp_path, capsys):
    recipe = mixtral_recipe(tmp_path)
    assert main(["plan", "--recipe", str(recipe), "--gpus", "1", "--gpu-memory", "80"]) == 0
    assert "Experts: the load-balancing loss is added at router_aux_loss_coef 0.02" in capsys.readouterr().out


def test_a_mixtral_run_trains_with_the_checkpoints_weight_and_records_it(tmp_path):
    recipe = mixtral_recipe(tmp_path)
    assert main(["train", str(recipe), "--output_dir", str(tmp_path / "run")]) == 0
    recorded = json.loads((tmp_path / "run" / "effective_config.json").read_text())["values"]["router_aux_loss_coef"]
    assert recorded["value"] == 0.02 and recorded["source"].startswith("the checkpoint's config")
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["router_aux_loss_coef"] == 0.02 and saved["output_router_logits"] is False


def test_a_weight_given_in_a_recipe_is_read_not_refused(tmp_path):
    from finetune.recipe.parse import read_recipe

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("router_aux_loss_coef: 0.001\n")
    assert read_recipe(recipe, []).model.router_aux_loss_coef == 0.001
    with pytest.raises(RecipeError, match="`router_aux_loss_coef: -1.0`: a weight of 0 or more"):
        read_recipe(recipe, ["--router_aux_loss_coef", "-1"])
