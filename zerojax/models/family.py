"""What a built-in family declares besides its modules: its Hugging Face layout (docs/design.md,
"Adding a family"). No jax here: config reads a family's architectures and checks, and the
generic converter in `zerojax.interop.hf` its tables, through `zerojax.models.registry`.

A family module (`models/gpt.py`, `models/llama.py`) holds

    build(*, cfg, policy, rngs)   the factory (the same signature as a user's module:factory)
    check_config(cfg)             its rules on a ModelConfig (ConfigError), beyond the generic ones
    HF = HfLayout(...)            its Hugging Face architectures, config.json keys and tensor table
    LEROBOT = LeRobotLayout(...)  optional: its LeRobot policy type, model keys and tensor table
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from zerojax.errors import ConfigError


@dataclass(frozen=True)
class Tensor:
    """Where a zerojax leaf lives in an HF checkpoint: the name (`{i}`: the layer of a stacked
    leaf), whether HF stores it transposed ([out, in] for a zerojax [in, out] kernel), and
    whether the checkpoint's tensor may have more rows than the model uses (a position table
    longer than model.seq_len: the model reads its first rows)."""

    name: str
    transposed: bool = False
    may_be_longer: bool = False


@dataclass(frozen=True)
class HfLayout:
    """A family's Hugging Face checkpoints: what `zerojax.interop.hf` reads and writes for it."""

    architectures: tuple[str, ...]  # config.json's `architectures` read as this family; the first is written
    from_hf_config: Callable[[dict, str], dict]  # (config.json, its path) -> model.* keys; ConfigError if unsupported
    to_hf_config: Callable[[dict], dict]  # a run's model section -> config.json (less architectures and dtype)
    tensors: dict[str, Tensor]  # zerojax parameter path -> its HF tensor
    # config.json keys zerojax derives from the model keys: key -> (value of a ModelConfig, what it must be)
    derived: dict[str, tuple[Callable[[Any], Any], str]] = field(default_factory=dict)
    fan_in_fan_out: bool = False  # PEFT's LoraConfig flag: the adapted layers keep their weight [in, out]
    optional_prefix: str = ""  # a prefix of the tensor names that some published checkpoints drop
    # tensor-name prefixes as zerojax writes them -> the prefix other writers store instead
    # (transformers 5 saves PaliGemma's `vision_tower.vision_model.` as `vision_tower.`)
    aliases: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LeRobotLayout:
    """A family's LeRobot policy checkpoints (`PreTrainedPolicy.save_pretrained`: config.json with
    "type", model.safetensors): what `zerojax.interop.lerobot` reads and writes for it."""

    type: str  # config.json's "type"
    # (config.json, tensor name -> shape, config.json's path, the model keys the user gave) -> model.* keys;
    # ConfigError if the checkpoint makes no such model. A key no tensor shape holds: the user's wins.
    model_keys: Callable[[dict, dict, str, dict], dict]
    tensors: dict[str, Tensor]  # zerojax parameter path -> its LeRobot tensor
    to_config: Callable[[dict, dict], dict]  # (a run's model section, a LeRobot config.json to start from) -> config.json


def require(hf: dict, where: str, family: str, keys: list[str]) -> None:
    """ConfigError naming the `keys` that config.json lacks (or holds as null)."""
    missing = [key for key in keys if hf.get(key) is None]
    if missing:
        raise ConfigError(f"{where} has no {', '.join(missing)}; zerojax needs {'it' if len(missing) == 1 else 'them'} "
                          f"to build the {family} model")
