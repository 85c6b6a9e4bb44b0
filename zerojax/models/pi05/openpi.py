"""π0.5's openpi checkpoint layout: the `params/` tree of openpi's `Pi0` with pi05=True, read from
openpi's source (`models/pi0.py`, `gemma.py`) and checked by openpi's own forward pass on an
export (scripts/checks/check_openpi_forward.py; README, "openpi checkpoints").

PaliGemma with its expert (`paligemma_expert.openpi`); the expert's norms are adaptive, `gemma.RMSNorm` with a condition,
whose `nn.Dense(3W)` is the norm's only parameter (`pre_attention_norm_1/Dense_0/{kernel [L, W,
3W], bias}`, `pre_ffw_norm_1/Dense_0`, `final_norm_1/Dense_0`; its output split as scale, shift,
gate, as zerojax's `AdaRMSNorm` splits it); the heads are `action_in_proj`, `action_out_proj`,
`time_mlp_in`, `time_mlp_out`, and there is no `state_proj` (the state is in the prompt).
"""

from __future__ import annotations

from zerojax.models.family import OpenpiLayout
from zerojax.models.paligemma_expert.openpi import (LAYERS, LLM, RECIPE, linear, paligemma_keys, paligemma_rules,
                                                   stream_rules)

HEADS = ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out")


def openpi_rules(model: dict) -> list:
    """π0.5's whole tree: PaliGemma's, the expert's layers with their adaptive norms, the heads."""
    expert = stream_rules("expert", "_1", model, norms=False)
    for norm, flax in (("input_layernorm", "pre_attention_norm_1"), ("post_attention_layernorm", "pre_ffw_norm_1")):
        expert += linear(f"layers/expert/{norm}/dense", f"{LAYERS}{flax}/Dense_0")
    return [*paligemma_rules(model), *expert, *linear("expert_norm/dense", LLM + "final_norm_1/Dense_0"),
            *[r for h in HEADS for r in linear(h)]]


PROMPT_LEN = 200  # openpi's Pi0Config(pi05=True).max_token_len: the prompt holds the state's bins


def openpi_model_keys(shapes: dict, where: str, given: dict) -> dict:
    """π0.5's model.* keys from an openpi tree's shapes: PaliGemma's (`paligemma_expert.openpi.paligemma_keys`).
    The state's width is in no shape (it is in the prompt): the user's, or the default. The prompt's
    length is in no shape either: the user's, else openpi's for π0.5 (200 tokens)."""
    keys = paligemma_keys(shapes, where)
    keys["action"]["prompt_len"] = (given.get("action") or {}).get("prompt_len", PROMPT_LEN)
    return {"family": "pi05", **keys}


# openpi's π0.5 normalizes the state and the actions by their quantiles (its data config's
# use_quantile_norm, true for every model type but π0)
OPENPI = OpenpiLayout(heads=("time_mlp_in",), model_keys=openpi_model_keys, rules=openpi_rules,
                      run_keys={**RECIPE, "data.norm_state": "quantiles", "data.norm_action": "quantiles"})
