"""The model keys of the checkpoint `model.init_from` names, by its format's record
(`zerojax.checkpoints`, which says what the files are): a Hugging Face model directory's
config.json, read through the layout of the family that declares its architecture
(`zerojax.models.registry`); a LeRobot policy directory's (config.json with "type"), through the
layout of the family that declares its type, from config.json and model.safetensors' header; an
openpi tree's, from its shapes. Generic: the families say which keys they read; nothing here
names one."""

from __future__ import annotations

import dataclasses
import json
import struct
import typing
from pathlib import Path

from zerojax.checkpoints import format as checkpoints
from zerojax.checkpoints.format import json_object as read_json_object
from zerojax.config import openpi_dir as openpi_files
from zerojax.config.sections import ModelConfig
from zerojax.config.values import coerce
from zerojax.errors import ConfigError
from zerojax.models import registry


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


# beside a zerojax export's config.json: what LeRobot's config.json has no field for (the model
# keys no tensor's shape holds, the dataset's fps and feature names; `interop.lerobot_export.save`)
ZEROJAX_FILE = "zerojax.json"


def safetensors_header(path: Path) -> tuple[dict, int]:
    """(the header of a safetensors file, tensor name -> {dtype, shape, data_offsets} and
    "__metadata__", where its data starts); OSError, ValueError or struct.error if it is not one."""
    size = path.stat().st_size
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))  # (struct.error if the file is shorter than 8 bytes)
        if n > size - 8:  # any other file's first 8 bytes make a huge length: do not try to read it
            raise ValueError(f"its first 8 bytes give a header of {n:,} bytes, the file has {size:,}")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError(f"its header is a JSON {type(header).__name__}, not an object")
    return header, 8 + n


def tensor_shapes(path: Path) -> dict:
    """name -> shape from a safetensors file's header (ConfigError if it is not one)."""
    try:
        header, _ = safetensors_header(path)
        return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, struct.error, KeyError, TypeError, AttributeError) as err:
        raise ConfigError(f"{path} is not a readable safetensors file ({type(err).__name__}: {err})") from None


def lerobot_model_keys(directory: str, given: dict) -> dict:
    """The model.* values of a LeRobot policy directory, through its type's layout; `given`: the
    model keys the user set (a size that no tensor's shape holds is taken from them)."""
    where = Path(directory) / "config.json"
    config = read_json_object(where, "a LeRobot policy config")
    layouts = registry.lerobot_layouts()
    kind = config.get("type")
    if kind not in layouts:
        raise ConfigError(f"{where}: a LeRobot {kind!r} policy; zerojax reads LeRobot's {', '.join(layouts)} "
                          "policies")
    weights = Path(directory) / "model.safetensors"
    if not weights.is_file():
        raise ConfigError(f"model.init_from={directory!r}: a LeRobot {kind} policy without model.safetensors")
    _, layout = layouts[kind]
    recorded = recorded_model_keys(directory)
    given = beneath(given, recorded)  # a key the user set wins
    out = layout.model_keys(config, tensor_shapes(weights), str(where), given)
    unrecorded_vision_heads(out, given, where)
    out = beneath(out, recorded)  # what config.json has no field for (training-time RTC's delay, ...)
    try:
        out = _coerced("model", out, ModelConfig)
        ModelConfig(**out)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    return out


def recorded_model_keys(directory) -> dict:
    """The model keys a zerojax export recorded in ZEROJAX_FILE beside its config.json (the tower's
    head count, training-time RTC's delay: what config.json has no field for); {} if none."""
    path = Path(directory) / ZEROJAX_FILE
    if not path.is_file():
        return {}
    recorded = read_json_object(path, "a zerojax export's record").get("model") or {}
    if not isinstance(recorded, dict):
        raise ConfigError(f"{path}: 'model' is a JSON {type(recorded).__name__}, not an object of model keys")
    try:
        recorded = _coerced("model", recorded, ModelConfig)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    except KeyError as err:
        raise ConfigError(f"{path}: {err.args[0]!r} is not a model key (model.* or a section's key)") from None
    return recorded


def beneath(keys: dict, under: dict) -> dict:
    """`keys` with `under`'s where it has none; a sub-section (model.vision) merged key by key."""
    out = {**under, **keys}
    for key, value in under.items():
        if isinstance(value, dict) and isinstance(keys.get(key), dict):
            out[key] = {**value, **keys[key]}
    return out


def unrecorded_vision_heads(keys: dict, given: dict, where) -> None:
    """ConfigError where the vision tower's head count the family took in the user's stead does not
    divide the tower's width. A LeRobot π0/π0.5 (or a SmolVLA without its VLM's config) records no
    head count: its config.json has no field for it, and HF SigLIP's q_proj [E, E] hides it in its
    shape. The hint divides the width, and says the count must be the one the tower was trained with."""
    vision = keys.get("vision") or {}
    width, heads = vision.get("d_model"), vision.get("n_heads")
    if (given.get("vision") or {}).get("n_heads") or not width or not heads or width % heads == 0:
        return
    divisors = [d for d in range(1, width + 1) if width % d == 0]
    guess = max(d for d in divisors if d <= heads)
    raise ConfigError(f"{where}: the vision tower's head count cannot be read from the checkpoint's files (LeRobot's "
                      f"config.json does not record it, and no tensor's shape shows it), and {heads}, the family's "
                      f"usual tower's, does not divide its width model.vision.d_model={width}; set the count it was "
                      f"trained with, one of {', '.join(map(str, divisors))}: try model.vision.n_heads={guess} "
                      f"(divides {width}) if nothing says otherwise")


def openpi_model_keys(directory: str, given: dict) -> dict:
    """The model.* values of an openpi checkpoint directory, from its tree's shapes through the
    layout of the family whose heads it has (`config.openpi_dir`; ConfigError if model.family
    names another, or the directory lacks params/ or assets/)."""
    where = f"model.init_from={directory}"
    shapes = openpi_files.tree_shapes(directory)  # orbax, and jax: only for an openpi directory
    openpi_files.read_assets(directory)
    family = openpi_files.family_of(shapes, where, given.get("family"))
    out = registry.openpi_layouts()[family].model_keys(shapes, where, given)
    try:
        out = _coerced("model", out, ModelConfig)
        ModelConfig(**out)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    return out


def hf_model_keys(directory: str, given: dict | None = None) -> dict:
    """The model.* values the checkpoint directory `model.init_from` names implies, through its
    format's reader (`zerojax.checkpoints`: a Hugging Face model's config.json, a LeRobot policy's,
    an openpi tree's shapes); ConfigError if it cannot be read, describes a model zerojax does not
    have, or holds no model (a PEFT adapter directory). `given`: the model keys the user set, which
    a LeRobot or openpi checkpoint may need (`lerobot_model_keys`)."""
    record = checkpoints.start(directory)
    return checkpoints.call(record.model_keys, directory, given or {}) if record.model_keys else {}


def hf_dir_model_keys(directory: str, given: dict) -> dict:
    """The model.* values a Hugging Face directory's config.json implies, through the layout of the
    family that declares its architecture."""
    where = Path(directory) / "config.json"
    architectures = registry.hf_architectures()
    hf = read_json_object(where, "a Hugging Face config")
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
