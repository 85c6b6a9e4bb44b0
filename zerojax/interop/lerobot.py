"""LeRobot's π0 checkpoints (a `PI0Policy.save_pretrained` directory: config.json with
"type": "pi0", model.safetensors) read into zerojax's `model.family=pi0`.

LeRobot's config.json does not name the VLM's or the expert's sizes (LeRobot fixes them at
gemma_2b and gemma_300m): they are read from the tensors' shapes. LeRobot's experts have one
key/value head, so the head dim is k_proj's rows and the query heads q_proj's rows over it. The
SigLIP tower's head count is in no tensor's shape: So400m's 16 unless given (`vision_heads`).

    cfg, model = zerojax.lerobot.load(DIR)        # one device, fp32
    model.flow_loss(batch, noise, time)           # LeRobot's PI0FlowMatching.forward
    model.sample_actions(batch, noise)            # LeRobot's sample_actions
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from zerojax.errors import ConfigError

SUPPORTED = ("pi0",)
SO400M_HEADS = 16  # SigLIP So400m/14, π0's tower


def read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise ConfigError(f"{directory}: no config.json (a LeRobot policy directory, as PI0Policy.save_pretrained "
                          "writes it)")
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path} is not JSON ({err})") from None
    if config.get("type") not in SUPPORTED:
        raise ConfigError(f"{path}: a LeRobot {config.get('type')!r} policy; zerojax reads {', '.join(SUPPORTED)}")
    return config


def model_keys(directory: Path, tensors: dict, vision_heads: int = SO400M_HEADS) -> dict:
    """The model.* keys of a LeRobot π0 checkpoint, from its config.json and its tensors' shapes."""
    from zerojax.models import pi0

    config = read_config(directory)
    shape = lambda name: tuple(tensors[name].shape)
    depth = lambda pattern: len({m.group(1) for k in tensors if (m := re.match(pattern, k))})
    vlm, expert = pi0.VLM_LAYER.format(i=0), pi0.EXPERT_LAYER.format(i=0)
    vocab, width = shape(pi0.ROOT + "paligemma.lm_head.weight")
    head_dim = shape(vlm + "self_attn.k_proj.weight")[0]
    layers = depth(re.escape(pi0.VLM + "language_model.layers.") + r"(\d+)\.")
    expert_layers = depth(re.escape(pi0.ROOT + "gemma_expert.model.layers.") + r"(\d+)\.")
    heads = shape(vlm + "self_attn.q_proj.weight")[0] // head_dim
    expert_heads = shape(expert + "self_attn.q_proj.weight")[0] // shape(expert + "self_attn.k_proj.weight")[0]
    expert_head_dim = shape(expert + "self_attn.k_proj.weight")[0]
    if (layers, heads, head_dim) != (expert_layers, expert_heads, expert_head_dim):
        raise ConfigError(f"{directory}: the experts differ in depth, heads or head_dim (VLM {layers} layers, {heads} "
                          f"heads of {head_dim}; expert {expert_layers}, {expert_heads} of {expert_head_dim}); "
                          "π0's joint layers need them equal")
    tower = pi0.VLM + "vision_tower.vision_model."
    e, _, patch, _ = shape(tower + "embeddings.patch_embedding.weight")
    n_patches = shape(tower + "embeddings.position_embedding.weight")[0]
    cameras = [k for k, f in config.get("input_features", {}).items() if f.get("type") == "VISUAL"]
    action = config.get("output_features", {}).get("action", {}).get("shape", [config["max_action_dim"]])
    return {
        "family": "pi0", "vocab_size": vocab, "d_model": width, "n_layers": layers, "n_heads": heads,
        "n_kv_heads": 1, "head_dim": head_dim, "d_ff": shape(vlm + "mlp.gate_proj.weight")[0], "norm_eps": 1e-6,
        "expert": {"d_model": shape(expert + "input_layernorm.weight")[0],
                   "d_ff": shape(expert + "mlp.gate_proj.weight")[0]},
        "vision": {"image_size": int(round(n_patches ** 0.5)) * patch, "patch_size": patch, "d_model": e,
                   "n_layers": depth(re.escape(tower + "encoder.layers.") + r"(\d+)\."), "n_heads": vision_heads,
                   "d_ff": shape(tower + "encoder.layers.0.mlp.fc1.weight")[0]},
        "action": {"horizon": config["chunk_size"], "max_state_dim": config["max_state_dim"],
                   "max_action_dim": config["max_action_dim"], "action_dim": int(action[0]),
                   "cameras": max(1, len(cameras) + config.get("empty_cameras", 0)),
                   "prompt_len": config["tokenizer_max_length"]},
    }


def params_of(model, tensors: dict) -> dict:
    """The model's parameters (a pure dict) filled from LeRobot's tensors (`pi0.LEROBOT_TENSORS`)."""
    from flax import nnx

    from zerojax.models import pi0

    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    n_layers = model.shape.n_layers
    n_vision = model.vision_shape.n_layers
    for path, tensor in pi0.LEROBOT_TENSORS.items():
        read = lambda name: np.transpose(tensors[name]) if tensor.transposed else np.asarray(tensors[name])
        if "{i}" in tensor.name:
            depth = n_vision if path.startswith("vision/") else n_layers
            value = np.stack([read(tensor.name.format(i=i)) for i in range(depth)])
        else:
            value = read(tensor.name)
        *head, last = path.split("/")
        leaf = params
        for key in head:
            leaf = leaf[key]
        if tuple(leaf[last].shape) != value.shape:
            raise ConfigError(f"{tensor.name}: shape {list(value.shape)}, the model's {path} is {list(leaf[last].shape)}")
        leaf[last] = value.astype(np.float32)
    return params


def load(directory, vision_heads: int = SO400M_HEADS):
    """(cfg, model): a LeRobot π0 directory's ModelConfig and its model on one device, in fp32."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from safetensors.numpy import load_file

    from zerojax.config.sections import ModelConfig
    from zerojax.models import registry
    from zerojax.precision import Policy

    directory = Path(directory)
    read_config(directory)
    tensors = load_file(directory / "model.safetensors")
    cfg = ModelConfig(**model_keys(directory, tensors, vision_heads))
    model = nnx.eval_shape(lambda: registry.build(cfg, Policy(), seed=0))
    params = params_of(model, tensors)
    nnx.update(model, jax.tree.map(jnp.asarray, params))
    return cfg, model
