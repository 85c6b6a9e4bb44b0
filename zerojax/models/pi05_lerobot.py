"""π0.5's LeRobot checkpoint layout (`PI05Policy.save_pretrained`: config.json with "type":
"pi05", model.safetensors), as LeRobot 0.6.1 with transformers 5 writes it: the tensor table, the
model keys config.json and the tensors' shapes imply, and config.json for an export.

Beside π0's (`pi0_lerobot`): the expert's norms are adaptive (`…layernorm.dense.{weight,bias}`,
no `weight` of their own), the heads are `action_in_proj`, `action_out_proj`, `time_mlp_in`,
`time_mlp_out`, and the prompt's embedding is `language_model.embed_tokens` (LeRobot 0.6 saves
`lm_head` untied beside it and reads only `embed_tokens`; an export writes zerojax's one table
under both, and the expert's unused `lm_head` as π0's). An export's processor steps, where the
run kept none, are LeRobot 0.6.1's `make_pi05_pre_post_processors`: the normalizer before the
step that puts the state in the prompt, then the tokenizer.
"""

from __future__ import annotations

from zerojax.models import pi0_lerobot
from zerojax.models.family import LeRobotLayout, Tensor
from zerojax.models.pi0_lerobot import EXPERT_LAYER, ROOT, VLM, VLM_LAYER

EMBED = pi0_lerobot.EMBED
HEADS = ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out")


def _dense(path: str, name: str) -> dict:
    """An adaptive norm's dense layer W -> 3W (torch's [out, in] weight)."""
    return {f"{path}/dense/kernel": Tensor(name + ".dense.weight", True),
            f"{path}/dense/bias": Tensor(name + ".dense.bias")}


def _expert_tensors() -> dict:
    out = {k: v for k, v in pi0_lerobot._stream_tensors("expert", EXPERT_LAYER).items() if not k.endswith("/scale")}
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out.update(_dense(f"layers/expert/{norm}", EXPERT_LAYER + norm))
    return out


LEROBOT_TENSORS = {
    **pi0_lerobot.PALIGEMMA_TENSORS,
    **_dense("expert_norm", ROOT + "gemma_expert.model.norm"),
    **pi0_lerobot._stream_tensors("vlm", VLM_LAYER),
    **_expert_tensors(),
    **{f"{p}/{leaf}": Tensor(f"model.{p}.{'weight' if leaf == 'kernel' else 'bias'}", leaf == "kernel")
       for p in HEADS for leaf in ("kernel", "bias")},
}


def lerobot_model_keys(config: dict, shapes: dict, where: str, given: dict) -> dict:
    """The model.* keys of a LeRobot π0.5 checkpoint: π0's rules (`pi0_lerobot.lerobot_model_keys`)
    on its tensors' shapes, the expert's width read from its adaptive norm's dense layer [3W, W]
    and the vocabulary from `embed_tokens`."""
    shapes = dict(shapes)
    dense = EXPERT_LAYER.format(i=0) + "input_layernorm.dense.weight"
    if dense in shapes:
        shapes[EXPERT_LAYER.format(i=0) + "input_layernorm.weight"] = (shapes[dense][1],)
    if EMBED in shapes:
        shapes[ROOT + "paligemma.lm_head.weight"] = shapes[EMBED]
    return {**pi0_lerobot.lerobot_model_keys(config, shapes, where, given), "family": "pi05"}


def to_lerobot_config(model: dict, base: dict) -> dict:
    """A LeRobot 0.6 PI05Config's config.json for a run's model section: `base` (the config.json
    the run started from, or {}) with the keys the model fixes set from it."""
    a, S = model["action"], model["vision"]["image_size"]
    out = {"type": "pi05", "n_obs_steps": 1, **base}
    out.update(chunk_size=a["horizon"], n_action_steps=min(base.get("n_action_steps", a["horizon"]), a["horizon"]),
               max_state_dim=a["max_state_dim"], max_action_dim=a["max_action_dim"],
               tokenizer_max_length=a["prompt_len"], image_resolution=[S, S])
    return out


def lerobot_processors(config: dict) -> tuple[list, list]:
    """LeRobot 0.6.1's π0.5 processor steps (`make_pi05_pre_post_processors`), as its
    policy_preprocessor.json and policy_postprocessor.json list them: π0's, with the normalizer
    before `pi05_prepare_state_tokenizer_processor_step` (it bins the normalized state into the
    prompt) and no newline step. The normalizers' features, modes and files are the writer's."""
    pre, post = pi0_lerobot.lerobot_processors(config)
    steps = {step["registry_name"]: step for step in pre}
    pre = [steps[name] for name in ("rename_observations_processor", "to_batch_processor",
                                    "relative_actions_processor", "normalizer_processor")]
    pre += [{"registry_name": "pi05_prepare_state_tokenizer_processor_step", "config": {}},
            steps["tokenizer_processor"], steps["device_processor"]]
    return pre, post


LEROBOT = LeRobotLayout(type="pi05", model_keys=lerobot_model_keys, tensors=LEROBOT_TENSORS,
                        to_config=to_lerobot_config, aliases=pi0_lerobot.EMBED_ALIASES, processors=lerobot_processors,
                        unused=lambda model: {pi0_lerobot.EXPERT_LM_HEAD: (model["vocab_size"],
                                                                           model["expert"]["d_model"])})
