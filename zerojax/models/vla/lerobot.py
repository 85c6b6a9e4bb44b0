"""What the policy families' LeRobot layouts share (`family.LeRobotLayout`): reading a checkpoint's
tensor shapes and config.json into model keys, the heads' tensor names, and config.json for an
export. Each family's `lerobot` module holds its own table and calls these. No jax here.

A LeRobot policy's config.json (`PreTrainedConfig`) names the chunk, the padded widths, the prompt
length, the cameras (`input_features` of type VISUAL, and `empty_cameras`) and the action's shape;
the sizes of the networks are in the tensors' shapes only.
"""

from __future__ import annotations

import re
from typing import Callable

from zerojax.errors import ConfigError
from zerojax.models.family import Tensor

POLICY_KEYS = ("chunk_size", "max_state_dim", "max_action_dim", "tokenizer_max_length")  # every family's config.json


def preset(lr: float, weight_decay: float, clip_norm: float, norm: str, norm_eps: float) -> dict:
    """A family's `Family.recipe` as LeRobot 0.6.1's policy config states it, which
    `use_policy_training_preset` applies: AdamW (betas 0.9 and 0.95, eps 1e-8) at `lr` with
    `weight_decay` on every parameter and gradient clipping at `clip_norm`, cosine_decay_with_warmup (1,000 warmup
    steps, a decay over 30,000 to 2.5e-6), and the state and the action normalized by `norm`
    (normalization_mapping's STATE and ACTION, as zerojax names the mode); and the epsilon its
    language model's RMSNorms compute with (`norm_eps`: a checkpoint's model keys set it too)."""
    return {"optim.lr": lr, "optim.b1": 0.9, "optim.b2": 0.95, "optim.eps": 1e-8, "optim.weight_decay": weight_decay,
            "optim.decay_mask": "all", "optim.clip_norm": clip_norm, "optim.schedule": "cosine", "optim.warmup_steps": 1_000,
            "optim.decay_steps": 30_000, "optim.final_lr": 2.5e-6, "data.norm_state": norm, "data.norm_action": norm,
            "model.norm_eps": norm_eps}


def shape_reader(shapes: dict, where: str, family: str) -> Callable[[str], tuple]:
    """name -> the tensor's shape; ConfigError naming the tensor a LeRobot `family` has."""
    def shape(name: str) -> tuple:
        if name not in shapes:
            raise ConfigError(f"{where}: model.safetensors has no tensor {name!r}, which a LeRobot {family} has")
        return tuple(shapes[name])
    return shape


def depth(shapes: dict, prefix: str) -> int:
    """How many layers `prefix` + "{i}." numbers among the tensors."""
    return len({m.group(1) for name in shapes if (m := re.match(re.escape(prefix) + r"(\d+)\.", name))})


def action_keys(config: dict, where: str, family: str) -> dict:
    """model.action.* of a LeRobot policy's config.json: its chunk, widths, cameras and prompt length."""
    missing = [key for key in POLICY_KEYS if key not in config]
    if missing:
        raise ConfigError(f"{where} has no {', '.join(missing)}; a LeRobot {family} config.json holds them")
    features = config.get("input_features") or {}
    cameras = [k for k, f in features.items() if isinstance(f, dict) and f.get("type") == "VISUAL"]
    action = (config.get("output_features") or {}).get("action", {}).get("shape", [config["max_action_dim"]])
    return {"horizon": config["chunk_size"], "max_state_dim": config["max_state_dim"],
            "max_action_dim": config["max_action_dim"], "action_dim": int(action[0]),
            "cameras": max(1, len(cameras) + config.get("empty_cameras", 0)),
            "prompt_len": config["tokenizer_max_length"]}


def tower_keys(shapes: dict, shape: Callable[[str], tuple], tower: str) -> dict:
    """model.vision.* a SigLIP tower's tensors under `tower` imply (the head count is in none)."""
    e, _, patch, _ = shape(tower + "embeddings.patch_embedding.weight")
    n_patches = shape(tower + "embeddings.position_embedding.weight")[0]
    return {"image_size": int(round(n_patches ** 0.5)) * patch, "patch_size": patch, "d_model": e,
            "n_layers": depth(shapes, tower + "encoder.layers."),
            "d_ff": shape(tower + "encoder.layers.0.mlp.fc1.weight")[0]}


def head_tensors(heads: tuple[str, ...]) -> dict[str, Tensor]:
    """The heads (`model.{head}.weight`, `.bias`: torch.nn.Linear's) at the model's top level."""
    return {f"{head}/{leaf}": Tensor(f"model.{head}.{'weight' if leaf == 'kernel' else 'bias'}", leaf == "kernel")
            for head in heads for leaf in ("kernel", "bias")}


def to_config(kind: str, model: dict, base: dict) -> dict:
    """A LeRobot policy's config.json for a run's model section: `base` (the config.json the run
    started from, or {}) with the keys every policy's model fixes set from it; the family adds its own."""
    a = model["action"]
    out = {"type": kind, "n_obs_steps": 1, **base}
    out.update(chunk_size=a["horizon"], n_action_steps=min(base.get("n_action_steps", a["horizon"]), a["horizon"]),
               max_state_dim=a["max_state_dim"], max_action_dim=a["max_action_dim"],
               tokenizer_max_length=a["prompt_len"])
    return out
