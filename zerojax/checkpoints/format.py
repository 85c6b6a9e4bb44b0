"""What a checkpoint format declares (the package's docstring), and the registry of them.

    FORMAT = CheckpointFormat(
        name="lerobot",                    # `zerojax export --format NAME`; what `detect` answers
        what="a LeRobot policy directory",  # for messages: what its files are
        detect=detect,                     # Path -> bool, from the files alone (no jax)
        model_keys="zerojax.config.hf_config:lerobot_model_keys",  # (directory, given) -> model.* keys
        run_keys="zerojax.config.policy_keys:lerobot_keys",        # (directory, model keys) -> run keys it sets
        read="zerojax.interop.lerobot:read_checkpoint",            # (init_from, plan, family, stacked)
        keep="zerojax.interop.lerobot:init_files",                 # (init_from) -> files the run keeps
        write="zerojax.interop.lerobot_export:write",              # (ExportJob) -> (bytes, tensors)
        adapters=MERGED,                   # what its export does with a LoRA run's adapters
        serve="zerojax.serve.loaders:lerobot_policy",              # (target, step, ..., vision_heads)
    )

The parts are "module:function" references, as Python's entry points are, resolved (`call`) by
the part of zerojax that uses them: the config resolves model_keys and run_keys, `interop` read
and keep, `train.export` write, `serve` serve. So a record imports nothing above this package,
and a format's heavy modules (orbax, jax) load only when its files are read. An empty part: the
format does not do that (a PEFT directory holds no model to start from; a Hugging Face model is
not a policy to serve).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from zerojax.errors import ConfigError

# What an export in a format does with a LoRA run's adapters (`zerojax export --merge`).
KEPT = "kept"  # written as they are, beside the weights (zerojax's own file); --merge is not for it
MERGED = "merged"  # the format holds a model, not adapters: a LoRA run needs --merge
ONLY = "only"  # the format holds the adapters alone (PEFT): a run with adapters and nothing else trained
ADAPTERS = (KEPT, MERGED, ONLY)


@dataclass(frozen=True)
class CheckpointFormat:
    """Everything a checkpoint format brings (module docstring)."""

    name: str
    what: str
    detect: Callable[[Path], bool]
    model_keys: str = ""
    run_keys: str = ""
    read: str = ""
    keep: str = ""
    write: str = ""
    adapters: str = MERGED
    serve: str = ""

    def __post_init__(self):
        if self.adapters not in ADAPTERS:
            raise ValueError(f"CheckpointFormat.adapters={self.adapters!r}; one of {ADAPTERS}")


@dataclass(frozen=True)
class ExportJob:
    """What `zerojax export` asks a format's writer to write: the saved run's config (a dict) at
    `step`, its leaves' true shapes (adapters merged in where --merge says so), each leaf's blocks
    from `blocks_of(path)` (one saved shard of one leaf at a time), and, computed when a writer
    asks, the stacks of its model (`stacked()`), its LoRA's (rank, alpha) per kernel (`lora()`) and
    what a safetensors export carries beside its weights (`carried()`: the run's config, data
    record and tokenizer, `train.export.run_metadata`); `dataset`: of a mixture run, the one
    dataset a format of one normalization writes (None: not named). The writer writes to `out`,
    where nothing is, and makes it appear only once complete."""

    out: Path
    run_dir: Path
    config: dict
    step: int
    shapes: dict
    dtype: str
    max_shard_bytes: int
    blocks_of: Callable
    stacked: Callable[[], tuple]
    lora: Callable[[], dict]
    carried: Callable[[], dict] = dict
    dataset: str | None = None


# name -> "module:attribute" of its record; `detect` tries them in this order, so a directory the
# predicates would share goes to the first (none do today). Adding a format: its line here.
FORMATS = {"safetensors": "zerojax.checkpoints.safetensors:FORMAT", "hf": "zerojax.checkpoints.hf:FORMAT",
           "peft": "zerojax.checkpoints.peft:FORMAT", "lerobot": "zerojax.checkpoints.lerobot:FORMAT",
           "openpi": "zerojax.checkpoints.openpi:FORMAT"}


def resolve(ref: str) -> Any:
    """The object a "module:attribute" reference names (its module imported on first use)."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def call(ref: str, *args, **kwargs):
    """Call the function a record's part names."""
    return resolve(ref)(*args, **kwargs)


def formats() -> list[CheckpointFormat]:
    """Every registered format's record, in the registry's order."""
    return [resolve(ref) for ref in FORMATS.values()]


def named(name: str) -> CheckpointFormat:
    """The record of format `name` (ConfigError naming the formats if there is none)."""
    if name not in FORMATS:
        raise ConfigError(f"--format {name!r} is not valid; choose one of {', '.join(writable())}")
    return resolve(FORMATS[name])


def writable() -> tuple[str, ...]:
    """The formats `zerojax export --format` writes."""
    return tuple(f.name for f in formats() if f.write)


def detect(path, key: str = "model.init_from") -> CheckpointFormat:
    """The format of the checkpoint at `path` (what `key` names), from its files alone; ConfigError
    naming what zerojax reads if there is nothing there, or nothing it recognises."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{key}={str(path)!r}: no such file or directory")
    record = recognise(path)
    if record is not None:
        return record
    listed = "; ".join(f.what for f in formats())
    raise ConfigError(f"{key}={str(path)!r} is a directory without config.json; give one of: {listed}")


def start(path, key: str = "model.init_from") -> CheckpointFormat:
    """The format of the checkpoint `key` starts a model from (`detect`), which must hold a model
    to read (its `read`; ConfigError naming what it is where it holds none: a PEFT directory)."""
    record = detect(path, key)
    if not record.read:
        raise ConfigError(f"{key}={str(path)!r} is {record.what}, which holds no model to start from; give a "
                          "model's checkpoint")
    return record


def recognise(path: Path) -> CheckpointFormat | None:
    """The first registered format whose files `path` holds, or None."""
    return next((record for record in formats() if record.detect(Path(path))), None)


def json_object(path: Path, what: str) -> dict:
    """The JSON object in `path` (ConfigError, naming the file, if it is not one)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path} holds a JSON {type(doc).__name__}, not {what} (a JSON object)")
    return doc


def is_lerobot(config: dict) -> bool:
    """A LeRobot policy's config.json (`PreTrainedConfig`: "type"), not a Hugging Face model's."""
    return "type" in config and "architectures" not in config


def config_json(directory: Path) -> dict | None:
    """A directory's config.json as a JSON object, or None where there is none."""
    path = Path(directory) / "config.json"
    if not (Path(directory).is_dir() and path.is_file()):
        return None
    return json_object(path, "a Hugging Face or LeRobot config")
