"""Mixture-of-experts models: their load-balancing (router auxiliary) loss, on by default as TRL turns it on.

Transformers' MoE architectures (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...) add `router_aux_loss_coef` × the
load-balancing loss to the language-model loss when the forward is asked for the router logits
(`output_router_logits`; modeling_mixtral.py, `MixtralForCausalLM.forward`). Their checkpoints ship the switch off
(inference needs no router logits), so a fine-tune would let the router collapse onto a few experts. TRL's
SFTTrainer turns it on unless told otherwise (trl/trainer/sft_trainer.py, `SFTTrainer.__init__`: the checkpoint's
weight when `router_aux_loss_coef` is None, a weight of 0 turns it off, a weight for a model without experts is an
error); finetune does the same, and records the weight in effective_config.json.

The switch is asked for in training forwards only (a forward pre-hook), not written into the config: with it on,
`generate` fails (the router logits of one new token against the whole attention mask), and the saved model would
carry it into chat, eval and serve. The eval loss stays the language model's, comparable before and after.
"""

from __future__ import annotations

from finetune.errors import RecipeError

WEIGHT = "load_balancing_weight"  # the weight a model trains its load-balancing loss with, set on the model


def has_router_loss(config) -> bool:
    """Whether the architecture has a load-balancing loss to turn on (its config declares the switch)."""
    return hasattr(config, "output_router_logits")


def turn_on_load_balancing(model, coefficient: float | None) -> float | None:
    """Turns the load-balancing loss on in the training forwards of a model with experts, at `coefficient` (None:
    the checkpoint's own weight; 0: off), and returns the weight it trains with; None for a model without experts,
    where a weight asked for is refused."""
    config = model.config.get_text_config()  # a vision-language wrapper's experts are its text model's
    if not has_router_loss(config):
        if coefficient is not None:
            raise RecipeError(f"`router_aux_loss_coef: {coefficient}`: {type(model).__name__} has no experts, so no "
                              "load-balancing loss; drop the key.")
        return None
    coefficient = float(getattr(config, "router_aux_loss_coef", 0.0) if coefficient is None else coefficient)
    config.router_aux_loss_coef = coefficient  # saved with the model
    for module in model.modules():  # the causal-LM head reads its weight once, when built
        if hasattr(module, "router_aux_loss_coef"):
            module.router_aux_loss_coef = coefficient
    setattr(model, WEIGHT, coefficient)
    if coefficient > 0:
        model.register_forward_pre_hook(_router_logits_in_training, with_kwargs=True)
    return coefficient


def _router_logits_in_training(module, args, kwargs):
    if module.training:
        kwargs["output_router_logits"] = True
    return args, kwargs


def load_balancing_weight(model) -> float | None:
    """The load-balancing weight `model` (or the model it wraps: peft, DDP) trains with, 0 when off; None for a model
    without experts."""
    return next((getattr(module, WEIGHT) for module in model.modules() if hasattr(module, WEIGHT)), None)
