"""A Hugging Face model directory as `model.init_from`: its config.json, read through the layout of
the family that declares its architecture (`zerojax.models.registry`), gives the model's keys.
Generic: the families say which keys they read; nothing here names one."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

from zerojax.config.sections import ModelConfig
from zerojax.config.values import coerce
from zerojax.errors import ConfigError
from zerojax.models import registry


def read_json_object(path: Path, what: str) -> dict:
    """The JSON object in `path` (ConfigError, naming the file, if it is not one)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path} holds a JSON {type(doc).__name__}, not {what} (a JSON object)")
    return doc


def _refuse_variants(hf: dict, where: Path, family: str) -> dict:
    """config.json with rope_theta at the top (transformers 5 keeps it in rope_parameters), after
    refusing what no zerojax family has: rope scaling, a sliding window, attention or MLP biases."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type", "default")) != "default":
        kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else rope
        raise ConfigError(f"{where}: rope scaling {kind!r} is not supported by zerojax's {family}")
    for unsupported in ("sliding_window", "attention_bias", "mlp_bias"):
        if hf.get(unsupported) not in (None, False):
            raise ConfigError(f"{where}: {unsupported}={hf[unsupported]!r} is not supported by zerojax's {family}")
    hf = dict(hf)
    if "rope_theta" in rope:
        hf.setdefault("rope_theta", rope["rope_theta"])
    return hf


def _coerced(prefix: str, values: dict, cls: type) -> dict:
    """`values` parsed to `cls`'s field types; a dict for a sub-section (model.vision) stays a
    dict, its keys parsed to the sub-section's types."""
    hints, out = typing.get_type_hints(cls), {}
    for key, value in values.items():
        nested = dataclasses.is_dataclass(hints[key]) and isinstance(value, dict)
        out[key] = _coerced(f"{prefix}.{key}", value, hints[key]) if nested else coerce(f"{prefix}.{key}", value, hints[key])
    return out


def hf_model_keys(directory: str) -> dict:
    """The model.* values a Hugging Face directory's config.json implies (ConfigError if it
    cannot be read or describes a model zerojax does not have)."""
    where = Path(directory) / "config.json"
    if not where.is_file():
        raise ConfigError(f"model.init_from={directory!r} is a directory without config.json; give a Hugging Face "
                          "model directory (config.json and model.safetensors) or a zerojax export file")
    hf, architectures = read_json_object(where, "a Hugging Face config"), registry.hf_architectures()
    archs = hf.get("architectures")
    if not (isinstance(archs, list) and archs and isinstance(archs[0], str)):
        raise ConfigError(f"{where}: architectures={archs!r} is not a list of model classes, "
                          f"e.g. [{next(iter(architectures))!r}]")
    if archs[0] not in architectures:
        raise ConfigError(f"{where}: architecture {archs[0]!r} is not supported; zerojax reads "
                          f"{', '.join(architectures)}")
    family = architectures[archs[0]]
    layout = registry.hf_layout(family)
    hf = _refuse_variants(hf, where, family)
    out = {"family": family, **layout.from_hf_config(hf, where)}
    try:  # the values must make a model: the same checks as the keys given in YAML
        out = _coerced("model", out, ModelConfig)
        model = ModelConfig(**out)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    for key, (value_of, rule) in layout.derived.items():  # keys zerojax computes must agree
        if hf.get(key) not in (None, value_of(model)):
            raise ConfigError(f"{where}: {key}={hf[key]} is not {rule}")
    return out
