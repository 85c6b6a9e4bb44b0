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
from zerojax.models.paligemma_expert.openpi import LAYERS, LLM, linear, paligemma_keys, paligemma_rules, stream_rules

HEADS = ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out")


def openpi_rules(model: dict) -> list:
    """π0.5's whole tree: PaliGemma's, the expert's layers with their adaptive norms, the heads."""
    expert = stream_rules("expert", "_1", model, norms=False)
    for norm, flax in (("input_layernorm", "pre_attention_norm_1"), ("post_attention_layernorm", "pre_ffw_norm_1")):
        expert += linear(f"layers/expert/{norm}/dense", f"{LAYERS}{flax}/Dense_0")
    return [*paligemma_rules(model), *expert, *linear("expert_norm/dense", LLM + "final_norm_1/Dense_0"),
            *[r for h in HEADS for r in linear(h)]]


def openpi_model_keys(shapes: dict, where: str, given: dict) -> dict:
    """π0.5's model.* keys from an openpi tree's shapes: PaliGemma's (`paligemma_expert.openpi.paligemma_keys`).
    The state's width is in no shape (it is in the prompt): the user's, or the default."""
    return {"family": "pi05", **paligemma_keys(shapes, where)}


OPENPI = OpenpiLayout(heads=("time_mlp_in",), model_keys=openpi_model_keys, rules=openpi_rules)
