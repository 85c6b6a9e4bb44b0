"""π0's LeRobot checkpoint layout (`PI0Policy.save_pretrained`: config.json with "type": "pi0",
model.safetensors with LeRobot's names `model.paligemma_with_expert.…`), as LeRobot 0.6 (with
transformers 5) and 0.3 (with transformers 4.5x) write it: the tensor table, the model keys
config.json and the tensors' shapes imply, and config.json for an export. `zerojax.interop.lerobot`
reads and writes it for any family that declares a `LeRobotLayout`; this module is π0's.

The prompt's embedding table: LeRobot 0.6 saves the VLM's `embed_tokens` and its `lm_head`
untied, and reads only `embed_tokens` (a LeRobot 0.6 fine-tune moves it and leaves `lm_head`);
LeRobot 0.3 saved the two tied, as `lm_head` alone. zerojax reads `embed_tokens` where the file
has it, else `lm_head` (`EMBED_ALIASES`), and writes both from its one table.
"""

from __future__ import annotations

import re

from zerojax.errors import ConfigError
from zerojax.models import siglip
from zerojax.models.family import LeRobotLayout, Tensor

# LeRobot's checkpoint (PI0Policy.save_pretrained): the tensor table. The expert's lm_head
# (random, never used: π0 predicts velocities, not tokens) is written back as LeRobot expects it.

ROOT = "model.paligemma_with_expert."
VLM = ROOT + "paligemma.model."
VLM_LAYER = VLM + "language_model.layers.{i}."
EXPERT_LAYER = ROOT + "gemma_expert.model.layers.{i}."
EMBED, LM_HEAD = VLM + "language_model.embed_tokens.weight", ROOT + "paligemma.lm_head.weight"
EXPERT_LM_HEAD = ROOT + "gemma_expert.lm_head.weight"  # random in LeRobot, never used: π0 predicts velocities
EMBED_ALIASES = {EMBED: LM_HEAD}  # 0.6's embed_tokens -> where 0.3 keeps it (tied)


def _stream_tensors(stream: str, layer: str) -> dict:
    out = {f"layers/{stream}/{norm}/scale": Tensor(layer + f"{norm}.weight")
           for norm in ("input_layernorm", "post_attention_layernorm")}
    out.update({f"layers/{stream}/{p}/kernel": Tensor(layer + f"self_attn.{p}.weight", True)
                for p in ("q_proj", "k_proj", "v_proj", "o_proj")})
    out.update({f"layers/{stream}/mlp/{p}/kernel": Tensor(layer + f"mlp.{p}.weight", True)
                for p in ("gate_proj", "up_proj", "down_proj")})
    return out


PALIGEMMA_TENSORS = {  # the tower, projector, embedding and final norm: π0's and π0.5's alike
    **siglip.hf_tensors("vision", "vision_embeddings", "vision_post_layernorm", VLM + "vision_tower.vision_model."),
    "multi_modal_projector/kernel": Tensor(VLM + "multi_modal_projector.linear.weight", True),
    "multi_modal_projector/bias": Tensor(VLM + "multi_modal_projector.linear.bias"),
    "embed_tokens/embedding": Tensor(EMBED),
    "norm/scale": Tensor(VLM + "language_model.norm.weight"),
}
LEROBOT_TENSORS = {
    **PALIGEMMA_TENSORS,
    "expert_norm/scale": Tensor(ROOT + "gemma_expert.model.norm.weight"),
    **_stream_tensors("vlm", VLM_LAYER),
    **_stream_tensors("expert", EXPERT_LAYER),
    **{f"{p}/{leaf}": Tensor(f"model.{p}.{'weight' if leaf == 'kernel' else 'bias'}", leaf == "kernel")
       for p in ("state_proj", "action_in_proj", "action_out_proj", "action_time_mlp_in", "action_time_mlp_out")
       for leaf in ("kernel", "bias")},
}


SO400M_HEADS = 16  # SigLIP So400m/14, π0's tower: its head count is in no tensor's shape


def lerobot_model_keys(config: dict, shapes: dict, where: str, given: dict) -> dict:
    """The model.* keys of a LeRobot π0 checkpoint, from its config.json and its tensors' shapes
    (LeRobot's config.json does not name the sizes: it fixes them at gemma_2b and gemma_300m).
    The experts have one key/value head, so the head dim is k_proj's rows and the query heads
    q_proj's rows over it. The tower's head count: the user's model.vision.n_heads, else So400m's."""
    def shape(name):
        if name not in shapes:
            raise ConfigError(f"{where}: model.safetensors has no tensor {name!r}, which a LeRobot π0 has")
        return tuple(shapes[name])

    depth = lambda pattern: len({m.group(1) for k in shapes if (m := re.match(pattern, k))})
    vlm, expert = VLM_LAYER.format(i=0), EXPERT_LAYER.format(i=0)
    vocab, width = shape(EMBED if EMBED in shapes else LM_HEAD)
    head_dim, kv_rows = shape(vlm + "self_attn.k_proj.weight")[0], shape(expert + "self_attn.k_proj.weight")[0]
    layers = depth(re.escape(VLM + "language_model.layers.") + r"(\d+)\.")
    expert_layers = depth(re.escape(ROOT + "gemma_expert.model.layers.") + r"(\d+)\.")
    heads = shape(vlm + "self_attn.q_proj.weight")[0] // head_dim
    expert_heads = shape(expert + "self_attn.q_proj.weight")[0] // kv_rows
    if (layers, heads, head_dim) != (expert_layers, expert_heads, kv_rows):
        raise ConfigError(f"{where}: the experts differ in depth, heads or head_dim (VLM {layers} layers, {heads} "
                          f"heads of {head_dim}; expert {expert_layers} layers, {expert_heads} heads of {kv_rows}); "
                          "π0's joint layers need them equal")
    tower = VLM + "vision_tower.vision_model."
    e, _, patch, _ = shape(tower + "embeddings.patch_embedding.weight")
    n_patches = shape(tower + "embeddings.position_embedding.weight")[0]
    features = config.get("input_features") or {}
    cameras = [k for k, f in features.items() if isinstance(f, dict) and f.get("type") == "VISUAL"]
    missing = [k for k in ("chunk_size", "max_state_dim", "max_action_dim", "tokenizer_max_length") if k not in config]
    if missing:
        raise ConfigError(f"{where} has no {', '.join(missing)}; a LeRobot π0 config.json holds them")
    action = (config.get("output_features") or {}).get("action", {}).get("shape", [config["max_action_dim"]])
    return {
        "family": "pi0", "vocab_size": vocab, "d_model": width, "n_layers": layers, "n_heads": heads,
        "n_kv_heads": 1, "head_dim": head_dim, "d_ff": shape(vlm + "mlp.gate_proj.weight")[0], "norm_eps": 1e-6,
        "expert": {"d_model": shape(expert + "input_layernorm.weight")[0],
                   "d_ff": shape(expert + "mlp.gate_proj.weight")[0]},
        "vision": {"image_size": int(round(n_patches ** 0.5)) * patch, "patch_size": patch, "d_model": e,
                   "n_layers": depth(re.escape(tower + "encoder.layers.") + r"(\d+)\."),
                   "n_heads": int((given.get("vision") or {}).get("n_heads") or SO400M_HEADS),
                   "d_ff": shape(tower + "encoder.layers.0.mlp.fc1.weight")[0]},
        "action": {"horizon": config["chunk_size"], "max_state_dim": config["max_state_dim"],
                   "max_action_dim": config["max_action_dim"], "action_dim": int(action[0]),
                   "cameras": max(1, len(cameras) + config.get("empty_cameras", 0)),
                   "prompt_len": config["tokenizer_max_length"]},
    }


def to_lerobot_config(model: dict, base: dict) -> dict:
    """A LeRobot PI0Config's config.json for a run's model section: `base` (the config.json the run
    started from, or {}) with the keys the model fixes set from it. LeRobot 0.3's where `base` is
    (it has `resize_imgs_with_padding`), else LeRobot 0.6's (`image_resolution`; its other fields
    LeRobot's defaults)."""
    a, S = model["action"], model["vision"]["image_size"]
    out = {"type": "pi0", "n_obs_steps": 1, **base}
    out.update(chunk_size=a["horizon"], n_action_steps=min(base.get("n_action_steps", a["horizon"]), a["horizon"]),
               max_state_dim=a["max_state_dim"], max_action_dim=a["max_action_dim"],
               tokenizer_max_length=a["prompt_len"])
    if "resize_imgs_with_padding" in base:
        out.update(proj_width=model["expert"]["d_model"], resize_imgs_with_padding=[S, S])
    else:
        out.update(image_resolution=[S, S], dtype="float32")
    return out


def lerobot_processors(config: dict) -> tuple[list, list]:
    """LeRobot 0.6's π0 processor steps (`make_pi0_pre_post_processors`), as its
    policy_preprocessor.json and policy_postprocessor.json list them, for an export whose run
    kept none: the normalizers' features, modes and files are filled in by the writer."""
    device = {"registry_name": "device_processor", "config": {"device": "cpu", "float_dtype": None}}
    tokenizer = {"max_length": config["tokenizer_max_length"], "task_key": "task", "padding_side": "right",
                 "padding": "max_length", "truncation": True, "tokenizer_name": "google/paligemma-3b-pt-224"}
    relative = {"enabled": False, "exclude_joints": ["gripper"], "action_names": None}
    pre = [{"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
           {"registry_name": "to_batch_processor", "config": {}},
           {"registry_name": "pi0_new_line_processor", "config": {}},
           {"registry_name": "tokenizer_processor", "config": tokenizer}, device,
           {"registry_name": "relative_actions_processor", "config": relative},
           {"registry_name": "normalizer_processor", "config": {"eps": 1e-08}}]
    post = [{"registry_name": "unnormalizer_processor", "config": {"eps": 1e-08}},
            {"registry_name": "absolute_actions_processor", "config": {"enabled": False}}, device]
    return pre, post


LEROBOT = LeRobotLayout(type="pi0", model_keys=lerobot_model_keys, tensors=LEROBOT_TENSORS,
                        to_config=to_lerobot_config, aliases=EMBED_ALIASES, processors=lerobot_processors,
                        unused=lambda model: {EXPERT_LM_HEAD: (model["vocab_size"], model["expert"]["d_model"])})
