"""The run keys a policy's model and checkpoint set (STYLE 13, "the checkpoint sets the run"),
applied by `load` to the tree of the keys the user set, before the Config is built:

    shapes     a policy family's data.action_horizon, data.image_size and data.prompt_len are
               its model's (model.action.horizon, model.vision.image_size,
               model.action.prompt_len); the user's own value must agree with the model's
    LeRobot    model.init_from of a LeRobot policy directory sets what its files know: the
               normalization (config.json's normalization_mapping), the tokenizer its
               processors name (where it is a local directory) and its optimizer preset
               (optimizer_*, scheduler_*), as LeRobot's `use_policy_training_preset` does

A key the user set (YAML or KEY=VALUE) wins, except a shape, which contradicting the model is an
error. `origins` says where each of these settings came from, for the start line (`describe`).
Generic: the registry says which families are policies; the checkpoint's files say the rest.
"""

from __future__ import annotations

from typing import Any

from zerojax.config import rules
from zerojax.config.sections import VisionConfig
from zerojax.errors import ConfigError
from zerojax.models import registry

CHECKPOINT, CONFIG, DEFAULT = "checkpoint", "config", "default"  # where a setting came from
# data.* shape key -> (the model's section, its key): the model owns the shape, the data follows
SHAPES = {"action_horizon": ("action", "horizon"), "image_size": ("vision", "image_size"),
          "prompt_len": ("action", "prompt_len")}


def _model_value(model: dict, section: str, key: str) -> Any:
    """model.<section>.<key> as the tree has it, else the section's default."""
    value = (model.get(section) or {}).get(key)
    if value is not None:
        return value
    return getattr(VisionConfig() if section == "vision" else registry.sections()[section](), key)


def policy_shapes(tree: dict, origins: dict, init_from: str = "") -> None:
    """A policy family's data shape keys from its model keys (`init_from`: the checkpoint directory
    they came from, if any); ConfigError, naming both values, where the user set one that
    contradicts the model."""
    model, data = tree.get("model", {}), tree.setdefault("data", {})
    if not registry.is_policy(model.get("family", registry.DEFAULT)):
        return
    for data_key, (section, key) in SHAPES.items():
        value, given = _model_value(model, section, key), data.get(data_key)
        origin = CHECKPOINT if init_from else CONFIG if key in (model.get(section) or {}) else DEFAULT
        if given is not None and given != value:
            whose = {CHECKPOINT: f"read from model.init_from={init_from}", CONFIG: "set in the config",
                     DEFAULT: "its default"}[origin]
            raise ConfigError(f"data.{data_key}={given} contradicts model.{section}.{key}={value} ({whose}); a "
                              f"policy's shapes are its model's: drop data.{data_key}, which follows "
                              f"model.{section}.{key} (or set model.{section}.{key})")
        data[data_key] = value
        origins[f"data.{data_key}"] = origin


def describe(origins: dict, cfg) -> str:
    """One line: each policy setting's value, grouped by where it came from."""
    groups: dict[str, list[str]] = {}
    for key, origin in origins.items():
        section, name = key.split(".")
        groups.setdefault(origin, []).append(f"{name}={_short(getattr(getattr(cfg, section), name))}")
    order = (CHECKPOINT, CONFIG, DEFAULT)
    return "policy settings: " + "; ".join(f"from the {o}: {' '.join(groups[o])}" if o != DEFAULT else
                                           f"defaults: {' '.join(groups[o])}" for o in order if o in groups)


def _short(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value) if value != "" else "''"
