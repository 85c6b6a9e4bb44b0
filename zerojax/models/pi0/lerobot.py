"""π0's LeRobot checkpoint layout (`PI0Policy.save_pretrained`: config.json with "type": "pi0",
model.safetensors), as LeRobot 0.6 (with transformers 5) and 0.3 (with transformers 4.5x) write
it: PaliGemma with its expert (`paligemma_expert.lerobot`), the expert's Gemma norms and π0's
heads, and config.json and the processor steps for an export. `zerojax.interop.lerobot` reads and
writes it for any family that declares a `LeRobotLayout`.
"""

from __future__ import annotations

from zerojax.models.family import Tensor
from zerojax.models.paligemma_expert import lerobot as paligemma_expert
from zerojax.models.vla import lerobot

HEADS = ("state_proj", "action_in_proj", "action_out_proj", "action_time_mlp_in", "action_time_mlp_out")
LEROBOT_TENSORS = {
    **paligemma_expert.PALIGEMMA_TENSORS,
    "expert_norm/scale": Tensor(paligemma_expert.EXPERT_NORM + ".weight"),
    **paligemma_expert.expert_tensors(norms=True),
    **lerobot.head_tensors(HEADS),
}


def lerobot_model_keys(config: dict, shapes: dict, where: str, given: dict) -> dict:
    """The model.* keys of a LeRobot π0 checkpoint (`paligemma_expert.lerobot.model_keys`): the
    expert's width is its norms' scale's."""
    width = lambda shape: shape(paligemma_expert.EXPERT_LAYER.format(i=0) + "input_layernorm.weight")[0]  # noqa: E731
    return paligemma_expert.model_keys(config, shapes, where, given, "pi0", "π0", width)


def to_lerobot_config(model: dict, base: dict) -> dict:
    """A LeRobot PI0Config's config.json for a run's model section (`vla.lerobot.to_config`):
    LeRobot 0.3's where `base` is (it has `resize_imgs_with_padding`), else LeRobot 0.6's
    (`image_resolution`; its other fields LeRobot's defaults)."""
    S, out = model["vision"]["image_size"], lerobot.to_config("pi0", model, base)
    if "resize_imgs_with_padding" in base:
        out.update(proj_width=model["expert"]["d_model"], resize_imgs_with_padding=[S, S])
    else:
        out.update(image_resolution=[S, S], dtype="float32")
    return out


# LeRobot 0.6's π0 preprocessor (`make_pi0_pre_post_processors`), for an export whose run kept
# none: the prompt gets its newline, is tokenized, then the normalizer
PRE = ("rename_observations_processor", "to_batch_processor", "pi0_new_line_processor", "tokenizer_processor",
       "device_processor", "relative_actions_processor", "normalizer_processor")
# LeRobot 0.6.1's PI0Config: its optimizer and scheduler preset, MEAN_STD for the state and the action
RECIPE = lerobot.preset(lr=2.5e-5, weight_decay=0.01, clip_norm=1.0, norm="mean_std", norm_eps=1e-6)  # Gemma's eps
LEROBOT = paligemma_expert.layout("pi0", LEROBOT_TENSORS, lerobot_model_keys, to_lerobot_config, PRE)
