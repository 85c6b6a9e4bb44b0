"""SmolVLA's LeRobot checkpoint layout (`SmolVLAPolicy.save_pretrained`: config.json with "type":
"smolvla", model.safetensors with LeRobot's names `model.vlm_with_expert.…`), as LeRobot 0.6.1
with transformers 5 writes it: the tensor table, the model keys config.json, the tensors' shapes
and the SmolVLM directory it names imply, and config.json for an export.

A unit holds two of LeRobot's layers (`smolvla.layers`: self_attn_every_n_layers = 2, LeRobot's
default and every published SmolVLA's): its `vlm_0`/`expert_0` are LeRobot's layer 2i, its
`vlm_1`/`expert_1` layer 2i + 1 (`Tensor.every`, `Tensor.offset`). Another interleaving, an
expert shallower than the VLM (num_expert_layers) or attention_mode other than cross_attn is
refused by name.

The head counts are in no tensor's shape: they are read from the SmolVLM directory config.json
names (`vlm_model_name`, as a path) where it is there, else the user's model keys, else
SmolVLM2-500M's (15 heads, 5 key/value heads of 64; the tower's 12 heads).
"""

from __future__ import annotations

import json

from zerojax.errors import ConfigError
from zerojax.models import decoder, siglip
from zerojax.models.family import LeRobotLayout, Tensor, local_file
from zerojax.models.vla import lerobot

ROOT = "model.vlm_with_expert."
VLM = ROOT + "vlm.model."
TEXT_LAYER = VLM + "text_model.layers.{i}."
EXPERT_LAYER = ROOT + "lm_expert.layers.{i}."
TOWER = VLM + "vision_model."
LM_HEAD = ROOT + "vlm.lm_head.weight"  # SmolVLM's head: LeRobot saves it, SmolVLA never reads it
EVERY = 2  # self_attn_every_n_layers this table maps
HEADS = ("state_proj", "action_in_proj", "action_out_proj", "action_time_mlp_in", "action_time_mlp_out")
SMOLVLM2 = {"num_attention_heads": 15, "num_key_value_heads": 5, "head_dim": 64, "rms_norm_eps": 1e-5,
            "vision_heads": 12, "layer_norm_eps": 1e-6}  # SmolVLM2-500M's, where no SmolVLM config is at hand


LEROBOT_TENSORS = {
    **siglip.hf_tensors("vision", "vision_embeddings", "vision_post_layernorm", TOWER),
    "connector/kernel": Tensor(VLM + "connector.modality_projection.proj.weight", True),
    "embed_tokens/embedding": Tensor(VLM + "text_model.embed_tokens.weight"),
    "norm/scale": Tensor(VLM + "text_model.norm.weight"),
    "expert_norm/scale": Tensor(ROOT + "lm_expert.norm.weight"),
    **{k: v for j in range(EVERY) for stream, layer in ((f"vlm_{j}", TEXT_LAYER), (f"expert_{j}", EXPERT_LAYER))
       for k, v in decoder.hf_tensors(f"layers/{stream}", layer, nested=False, every=EVERY, offset=j).items()},
    **lerobot.head_tensors(HEADS),
}


def smolvlm_config(config: dict, where: str) -> dict:
    """The config.json of the SmolVLM directory `vlm_model_name` names as a path (`local_file`), or
    {} where there is none (a Hub name)."""
    path = local_file(config.get("vlm_model_name") or "", where, "config.json")
    return json.loads(path.read_text()) if path else {}


def smolvlm_tokenizer(config: dict, where: str) -> str | None:
    """That directory's tokenizer.json, which LeRobot's processor tokenizes the task with."""
    path = local_file(config.get("vlm_model_name") or "", where, "tokenizer.json")
    return str(path) if path else None


def _refuse_unmapped(config: dict, where: str, layers: int, expert_layers: int) -> None:
    every = config.get("self_attn_every_n_layers", EVERY)
    if config.get("attention_mode", "cross_attn") != "cross_attn" or every != EVERY:
        raise ConfigError(f"{where}: attention_mode={config.get('attention_mode')!r}, self_attn_every_n_layers="
                          f"{every}; zerojax reads SmolVLA's cross_attn with self_attn_every_n_layers={EVERY}")
    if layers != expert_layers or layers % EVERY:
        raise ConfigError(f"{where}: the VLM has {layers} layers and the expert {expert_layers}; zerojax's units "
                          f"need the same depth, a multiple of {EVERY} (num_expert_layers=-1)")


def lerobot_model_keys(config: dict, shapes: dict, where: str, given: dict) -> dict:
    """The model.* keys of a LeRobot SmolVLA checkpoint (module docstring)."""
    shape = lerobot.shape_reader(shapes, where, "SmolVLA")
    layers = lerobot.depth(shapes, VLM + "text_model.layers.")
    _refuse_unmapped(config, where, layers, lerobot.depth(shapes, ROOT + "lm_expert.layers."))
    vlm = smolvlm_config(config, where)
    text, vision = vlm.get("text_config", {}), vlm.get("vision_config", {})
    pick = lambda key, cfg, default_key=None: cfg.get(key, given.get(default_key or key, SMOLVLM2[default_key or key]))  # noqa: E731
    vocab, width = shape(VLM + "text_model.embed_tokens.weight")
    layer, expert = TEXT_LAYER.format(i=0), EXPERT_LAYER.format(i=0)
    tower = lerobot.tower_keys(shapes, shape, TOWER)
    heads = int(pick("num_attention_heads", text))
    return {
        "family": "smolvla", "vocab_size": vocab, "d_model": width, "n_layers": layers, "n_heads": heads,
        "n_kv_heads": int(pick("num_key_value_heads", text)),
        "head_dim": int(text.get("head_dim") or (width // heads if text else SMOLVLM2["head_dim"])),
        "d_ff": shape(layer + "mlp.gate_proj.weight")[0], "norm_eps": float(pick("rms_norm_eps", text)),
        "rope_theta": 10000.0,
        "expert": {"d_model": shape(expert + "input_layernorm.weight")[0],
                   "d_ff": shape(expert + "mlp.gate_proj.weight")[0]},
        "vision": {**tower,
                   "n_heads": int(vision.get("num_attention_heads") or (given.get("vision") or {}).get("n_heads")
                                  or SMOLVLM2["vision_heads"]),
                   "norm_eps": float(vision.get("layer_norm_eps", SMOLVLM2["layer_norm_eps"]))},
        "action": lerobot.action_keys(config, where, "SmolVLA"),
        "smolvla": {"self_attn_every_n_layers": EVERY, "num_steps": int(config.get("num_steps", 10)),
                    "pixel_shuffle": int(round((shape(VLM + "connector.modality_projection.proj.weight")[1]
                                                / tower["d_model"]) ** 0.5))},
    }


def to_lerobot_config(model: dict, base: dict) -> dict:
    """A LeRobot 0.6 SmolVLAConfig's config.json for a run's model section (`vla.lerobot.to_config`)."""
    S, v = model["vision"]["image_size"], model.get("smolvla", {})
    out = lerobot.to_config("smolvla", model, base)
    out.update(resize_imgs_with_padding=[S, S], num_vlm_layers=model["n_layers"],
               self_attn_every_n_layers=v.get("self_attn_every_n_layers", EVERY), attention_mode="cross_attn",
               num_expert_layers=-1, num_steps=v.get("num_steps", 10),
               expert_width_multiplier=model["expert"]["d_model"] / model["d_model"])
    return out


# LeRobot 0.6.1's SmolVLAConfig: lr 1e-4, weight decay 1e-10, clipping at 10; MEAN_STD
RECIPE = lerobot.preset(lr=1e-4, weight_decay=1e-10, clip_norm=10.0, norm="mean_std",
                        norm_eps=SMOLVLM2["rms_norm_eps"])
LEROBOT = LeRobotLayout(type="smolvla", model_keys=lerobot_model_keys, tensors=LEROBOT_TENSORS,
                        to_config=to_lerobot_config,
                        unused=lambda model: {LM_HEAD: (model["vocab_size"], model["d_model"])},
                        legacy=lambda config: False,  # LeRobot 0.3 had no SmolVLA
                        tokenizer=smolvlm_tokenizer)
