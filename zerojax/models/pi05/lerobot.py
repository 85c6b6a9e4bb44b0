"""π0.5's LeRobot checkpoint layout (`PI05Policy.save_pretrained`: config.json with "type":
"pi05", model.safetensors), as LeRobot 0.6.1 with transformers 5 writes it: PaliGemma with its
expert (`paligemma_expert.lerobot`), the expert's adaptive norms (`…layernorm.dense.{weight,bias}`,
no `weight` of their own) and π0.5's heads `action_in_proj`, `action_out_proj`, `time_mlp_in`,
`time_mlp_out`. An export's processor steps, where the run kept none, are LeRobot 0.6.1's
`make_pi05_pre_post_processors`: the normalizer before the step that puts the state in the
prompt, then the tokenizer.
"""

from __future__ import annotations

from zerojax.models.family import Tensor
from zerojax.models.paligemma_expert import lerobot as paligemma_expert
from zerojax.models.paligemma_expert.lerobot import EXPERT_LAYER, EXPERT_NORM
from zerojax.models.vla import lerobot

HEADS = ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out")


def adaptive(path: str, name: str) -> dict:
    """An adaptive norm's dense layer W -> 3W (torch's [out, in] weight)."""
    return {f"{path}/dense/kernel": Tensor(name + ".dense.weight", True),
            f"{path}/dense/bias": Tensor(name + ".dense.bias")}


LEROBOT_TENSORS = {
    **paligemma_expert.PALIGEMMA_TENSORS,
    **adaptive("expert_norm", EXPERT_NORM),
    **paligemma_expert.expert_tensors(norms=False),
    **{k: v for norm in ("input_layernorm", "post_attention_layernorm")
       for k, v in adaptive(f"layers/expert/{norm}", EXPERT_LAYER + norm).items()},
    **lerobot.head_tensors(HEADS),
}


def lerobot_model_keys(config: dict, shapes: dict, where: str, given: dict) -> dict:
    """The model.* keys of a LeRobot π0.5 checkpoint (`paligemma_expert.lerobot.model_keys`): the
    expert's width is its adaptive norm's dense layer's input [3W, W]."""
    width = lambda shape: shape(EXPERT_LAYER.format(i=0) + "input_layernorm.dense.weight")[1]  # noqa: E731
    return paligemma_expert.model_keys(config, shapes, where, given, "pi05", "π0.5", width)


def to_lerobot_config(model: dict, base: dict) -> dict:
    """A LeRobot 0.6 PI05Config's config.json for a run's model section (`vla.lerobot.to_config`)."""
    S = model["vision"]["image_size"]
    return {**lerobot.to_config("pi05", model, base), "image_resolution": [S, S]}


# LeRobot 0.6.1's π0.5 preprocessor (`make_pi05_pre_post_processors`): the normalizer before
# `pi05_prepare_state_tokenizer_processor_step` (it bins the normalized state into the prompt),
# then the tokenizer; no newline step
PRE = ("rename_observations_processor", "to_batch_processor", "relative_actions_processor", "normalizer_processor",
       "pi05_prepare_state_tokenizer_processor_step", "tokenizer_processor", "device_processor")
# LeRobot 0.6.1's PI05Config: π0's preset, QUANTILES for the state and the action
RECIPE = lerobot.preset(lr=2.5e-5, weight_decay=0.01, clip_norm=1.0, norm="quantiles", norm_eps=1e-6)  # Gemma's eps
LEROBOT = paligemma_expert.layout("pi05", LEROBOT_TENSORS, lerobot_model_keys, to_lerobot_config, PRE)
