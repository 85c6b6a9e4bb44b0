"""π0's openpi checkpoint layout: the `params/` tree of openpi's `Pi0` (pi05=False), PaliGemma
with its expert (`paligemma_expert.openpi`), the expert's Gemma norms (`pre_attention_norm_1`,
`pre_ffw_norm_1`, `final_norm_1` scales) and π0's heads.
"""

from __future__ import annotations

from zerojax.errors import ConfigError
from zerojax.models.family import OpenpiLayout, Rule
from zerojax.models.paligemma_expert.openpi import (LLM, RECIPE, linear, paligemma_keys, paligemma_rules, same,
                                                   stream_rules)

HEADS = ("state_proj", "action_in_proj", "action_out_proj", "action_time_mlp_in", "action_time_mlp_out")


def openpi_rules(model: dict) -> list[Rule]:
    """π0's whole tree: PaliGemma's, the expert's layers and final norm, the heads."""
    return [*paligemma_rules(model), *stream_rules("expert", "_1", model),
            same("expert_norm/scale", LLM + "final_norm_1/scale"), *[r for h in HEADS for r in linear(h)]]


def openpi_model_keys(shapes: dict, where: str, given: dict) -> dict:
    """π0's model.* keys from an openpi tree's shapes: PaliGemma's, and the state's width from
    state_proj. The horizon, prompt length, cameras and real action width are in no shape: the
    user's (or the defaults)."""
    keys = paligemma_keys(shapes, where)
    if "state_proj/kernel" not in shapes:
        raise ConfigError(f"{where}: no leaf 'state_proj/kernel', which an openpi π0 tree has")
    keys["action"]["max_state_dim"] = shapes["state_proj/kernel"][0]
    return {"family": "pi0", **keys}


# openpi's π0 normalizes the state and the actions by their mean and standard deviation (its data
# config's use_quantile_norm is false for π0 alone)
OPENPI = OpenpiLayout(heads=("state_proj", "action_time_mlp_in"), model_keys=openpi_model_keys, rules=openpi_rules,
                      run_keys={**RECIPE, "data.norm_state": "mean_std", "data.norm_action": "mean_std"})
