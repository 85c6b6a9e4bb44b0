"""Loading a Config: the defaults, then a YAML file (its stem names the run), then KEY=VALUE
overrides by dotted name; unknown keys get the closest valid one as a suggestion."""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any
import yaml
from zerojax.config import policy_keys
from zerojax.checkpoints import format as checkpoints
from zerojax.config.hf_config import hf_model_keys
from zerojax.config.rules import RENAMED
from zerojax.config.sections import Config
from zerojax.config.values import _field_type, _is_mapping, coerce
from zerojax.errors import ConfigError


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config) if f.name != "name"}


def file_in_the_way(path: Path) -> Path | None:
    """The existing file (not a directory) at `path` or above it, which stops a directory from
    being created there; None if the directory exists or can be made."""
    for where in (path, *path.absolute().parents):
        if where.exists():
            return None if where.is_dir() else where
    return None


def _section_class(name: str) -> type:
    return {f.name: f.default_factory for f in dataclasses.fields(Config) if f.name != "name"}[name]


def _keys(prefix: str, cls: type) -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        nested = _nested_class(cls, f.name)
        keys += _keys(f"{prefix}.{f.name}", nested) if nested else [f"{prefix}.{f.name}"]
    return keys


def _nested_class(cls: type, name: str) -> type | None:
    """The dataclass of a sub-section (optim.lora), or None for a plain key."""
    typ = _field_type(cls, name)
    return typ if dataclasses.is_dataclass(typ) else None


def valid_keys() -> list[str]:
    keys = ["name"]
    for section in SECTIONS:
        keys += _keys(section, _section_class(section))
    return keys


def _unknown_key(key: str) -> ValueError:
    close = difflib.get_close_matches(key, valid_keys(), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else "; see configs/tiny.yaml for every key"
    return ConfigError(f"unknown config key '{key}'{hint}")


def _set(tree: dict, key: str, value: Any) -> None:
    """Put a raw value under its dotted key, validating the key's name."""
    parts = key.split(".")
    if parts == ["name"]:
        tree["name"] = coerce("name", value, str)
        return
    if len(parts) < 2 or parts[0] not in SECTIONS:
        raise _unknown_key(key)
    if key in RENAMED:
        raise ConfigError(f"{key} was replaced by {RENAMED[key]}; use {RENAMED[key].split()[0]}=...")
    cls, node = _section_class(parts[0]), tree.setdefault(parts[0], {})
    for name in parts[1:-1]:  # sub-sections: optim.lora.rank
        if name not in {f.name for f in dataclasses.fields(cls)} or not _nested_class(cls, name):
            raise _unknown_key(key)
        cls, node = _nested_class(cls, name), node.setdefault(name, {})
    name = parts[-1]
    if name in {f.name for f in dataclasses.fields(cls)} and _nested_class(cls, name):
        example = next(k for k in valid_keys() if k.startswith(key + "."))
        raise ConfigError(f"{key} is a section, not a key; set its keys, e.g. {example}=...")
    if name not in {f.name for f in dataclasses.fields(cls)}:
        raise _unknown_key(key)
    node[name] = coerce(key, value, _field_type(cls, name))


def _make(cls: type, values: dict):
    return cls(**{k: _make(_nested_class(cls, k), v) if _nested_class(cls, k) else v for k, v in values.items()})


def _build(tree: dict) -> Config:
    sections = {name: _make(_section_class(name), values) for name, values in tree.items() if name != "name"}
    return Config(**sections, **({"name": tree["name"]} if "name" in tree else {}))


def _flatten_yaml(doc: Any, path: Path) -> dict[str, Any]:
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a mapping of config sections, got {type(doc).__name__}")
    flat = {}
    for section, body in doc.items():
        if section == "name":
            flat["name"] = body
        elif isinstance(body, dict):
            flat.update(_flatten(str(section), body))
        elif body is None and section in SECTIONS:  # a section whose keys are all commented out
            continue
        elif section in SECTIONS:
            raise ConfigError(f"{path}: section '{section}' must be a mapping of keys")
        else:
            raise _unknown_key(str(section))
    return flat


def _flatten(prefix: str, body: dict) -> dict[str, Any]:
    """{lora: {rank: 8}} under optim -> {optim.lora.rank: 8}; a key that is not a sub-section
    keeps its mapping as its value (and is then refused by its parser)."""
    flat = {}
    for k, v in body.items():
        key = f"{prefix}.{k}"
        if isinstance(v, dict) and any(x.startswith(key + ".") for x in valid_keys()):
            flat.update(_flatten(key, v))
        else:
            flat[key] = v
    return flat


def parse_override(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not KEY=VALUE (e.g. zero.stage=1)")
    return key.strip(), value


def load(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults, then the YAML file (its stem names the run), then KEY=VALUE overrides."""
    return load_with_origins(path, overrides)[0]


def load_with_origins(path: str | Path | None = None, overrides: list[str] = ()) -> tuple[Config, dict]:
    """`load`'s Config, and where each policy setting came from (`policy_keys`: key -> checkpoint,
    config or default; empty for a run that is not a policy's)."""
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            problem = "is a directory, not a YAML file" if path.is_dir() else "does not exist"
            raise ConfigError(f"config file {str(path)!r} {problem}")
        try:
            doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            raise ConfigError(f"{path} is not valid YAML: {str(err).splitlines()[0]}") from None
        except UnicodeDecodeError as err:
            problem = f"is not UTF-8 text ({err.reason} at byte {err.start})"
            raise ConfigError(f"config file {str(path)!r} {problem}") from None
        tree["name"] = path.stem
        for key, value in _flatten_yaml(doc, path).items():
            _set(tree, key, value)
    for text in overrides:
        _set(tree, *parse_override(text))
    origins: dict = {}
    given = {k: dict(v) if isinstance(v, dict) else v for k, v in tree.get("model", {}).items()}
    _from_hugging_face(tree)
    from_dir = given.get("init_from") if given.get("init_from") and Path(given["init_from"]).is_dir() else ""
    policy_keys.policy_shapes(tree, origins, given, from_dir)
    record = checkpoints.detect(from_dir) if from_dir else None
    if record and record.run_keys:  # what the checkpoint sets beyond the model (a LeRobot policy's recipe)
        keys = checkpoints.call(record.run_keys, from_dir, tree.get("model", {}))
        policy_keys.carry(tree, origins, keys, f"model.init_from={from_dir}")
    policy_keys.recipe(tree, origins, given)
    policy_keys.reported(tree, origins)
    return _build(tree), origins


def _from_hugging_face(tree: dict) -> None:
    """With model.init_from a directory, take the model's keys from its config.json; a key also
    set in the YAML or on the command line must agree with it (model.seq_len may be shorter)."""
    model = tree.get("model", {})
    if not model.get("init_from") or not Path(model["init_from"]).is_dir():
        return
    for key, value in hf_model_keys(model["init_from"], model).items():
        if isinstance(value, dict):  # a sub-section (model.vision): each of its keys must agree
            section = model.setdefault(key, {})
            for sub, sub_value in value.items():
                _agree(f"{key}.{sub}", section.get(sub), sub_value, model["init_from"])
                section[sub] = sub_value
            continue
        given = model.get(key)
        if key == "seq_len" and given is not None and given <= value:
            continue  # a shorter context uses the first rows of the position table
        _agree(key, given, value, model["init_from"])
        model[key] = value
    tree["model"] = model


def _agree(key: str, given: Any, value: Any, directory: str) -> None:
    if given is not None and given != value:
        source = "config.json" if (Path(directory) / "config.json").is_file() else "params"  # params: openpi's tree
        raise ConfigError(f"model.{key}={given!r} contradicts {directory}/{source}, which says "
                          f"{value!r}; drop the override (or use another checkpoint)")


def to_dict(cfg: Config) -> dict:
    """The config as plain YAML/JSON values: lists for tuples, mappings for the pairs of a
    mapping key (optim.lora.rank_pattern)."""
    def walk(obj) -> dict:
        out = {}
        for f in dataclasses.fields(obj):
            v, typ = getattr(obj, f.name), _field_type(type(obj), f.name)
            out[f.name] = walk(v) if dataclasses.is_dataclass(v) else dict(v) if _is_mapping(typ) else \
                list(v) if isinstance(v, tuple) else v
        return out

    out = {"name": cfg.name}
    for section in SECTIONS:
        out[section] = walk(getattr(cfg, section))
    return out


def dump(cfg: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
