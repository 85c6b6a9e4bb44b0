"""The model families: `model.family` names a built-in one or a factory of the user's.

A built-in family is one module under `zerojax.models` that declares `FAMILY`, a
`family.Family` (its kind, factory, config rule, checkpoint layouts and, for a policy, its batch
adapter); this table is the only other place that names it. The rest of zerojax asks questions
of the registry ("is this family a policy", "its adapter") and never names a family. Importing
the registry imports no family (and no jax): a family's module is imported when it is first
asked for.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable

from zerojax.errors import ConfigError
from zerojax.models.family import POLICY, VISION_LANGUAGE

FAMILIES = {"gpt": "zerojax.models.gpt", "llama": "zerojax.models.llama", "gemma": "zerojax.models.gemma",
            "paligemma": "zerojax.models.paligemma", "pi0": "zerojax.models.pi0.model",
            "pi05": "zerojax.models.pi05.model", "smolvla": "zerojax.models.smolvla.model"}  # model.family -> module
DEFAULT = next(iter(FAMILIES))  # model.family's default: the first (GPT-2, the course's model)
# model.<section> keys a family declares beyond the shared ones: section -> its dataclass, in a
# module of the family's with no jax (the config imports it)
SECTIONS = {"expert": "zerojax.models.vla.config:ExpertConfig", "action": "zerojax.models.vla.config:ActionConfig",
            "smolvla": "zerojax.models.smolvla.config:SmolVLAConfig"}


def sections() -> dict[str, type]:
    """model.<section> -> the dataclass of its keys, for the sections families declare."""
    out = {}
    for section, spec in SECTIONS.items():
        module, _, cls = spec.partition(":")
        out[section] = getattr(importlib.import_module(module), cls)
    return out


def family(name: str):
    """The `family.Family` a built-in family's module declares."""
    return importlib.import_module(FAMILIES[name]).FAMILY


def kind(name: str) -> str | None:
    """What `model.family` is (`family.KINDS`); None for a model of the user's (module:factory),
    which declares no kind and reads token, chat or LeRobot rows as they are."""
    return family(name).kind if name in FAMILIES else None


def is_policy(name: str) -> bool:
    """`model.family` is a policy: robot observations in, action chunks out."""
    return kind(name) == POLICY


def is_vision_language(name: str) -> bool:
    """`model.family` reads image-and-text rows (.jsonl / .parquet of images)."""
    return kind(name) == VISION_LANGUAGE


def of_kind(wanted: str) -> tuple[str, ...]:
    """The built-in families of one kind, for messages ("policies: ...")."""
    return tuple(name for name in FAMILIES if family(name).kind == wanted)


def adapter(name: str):
    """A policy family's `family.PolicyAdapter` (None for any other family)."""
    return family(name).adapter if is_policy(name) else None


def pads_before(name: str) -> bool:
    """Whether a family pads a camera that is not square on the top and left (`PolicyAdapter.pad_before`)."""
    return is_policy(name) and adapter(name).pad_before


def hf_layouts() -> dict:
    """model.family -> its Hugging Face layout (a `family.HfLayout`), for the families that have one."""
    return {name: family(name).hf for name in FAMILIES if family(name).hf is not None}


def hf_architectures() -> dict:
    """config.json architecture -> the model.family that reads it."""
    return {arch: name for name, layout in hf_layouts().items() for arch in layout.architectures}


def hf_layout(name: str):
    """The Hugging Face layout of `model.family` (ConfigError if it has none)."""
    layouts = hf_layouts()
    if name not in layouts:
        raise ConfigError(f"model.family={name}: no Hugging Face layout; zerojax converts "
                          f"{', '.join(layouts)} ({', '.join(hf_architectures())})")
    return layouts[name]


def lerobot_layouts() -> dict:
    """LeRobot policy type (config.json's "type") -> (the model.family that reads it, its `family.LeRobotLayout`)."""
    return {family(name).lerobot.type: (name, family(name).lerobot) for name in FAMILIES
            if family(name).lerobot is not None}


def lerobot_layout(family_name: str):
    """The LeRobot layout of `model.family` (ConfigError if it has none)."""
    for name, layout in lerobot_layouts().values():
        if name == family_name:
            return layout
    raise ConfigError(f"model.family={family_name}: no LeRobot layout; zerojax converts LeRobot's "
                      f"{', '.join(lerobot_layouts()) or 'none'} policies")


def openpi_layouts() -> dict:
    """model.family -> its openpi layout (a `family.OpenpiLayout`), for the families that have one."""
    return {name: family(name).openpi for name in FAMILIES if family(name).openpi is not None}


def users_callable(spec: str, where: str) -> Callable:
    """The callable `module:name` of the user's (a model's or a data source's factory), the
    current directory on sys.path as `python -m` has it; ConfigError naming `where` if it cannot
    be imported or is not there."""
    module_name, _, attr = spec.partition(":")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - any failure to import is the user's module's, reported as such
        raise ConfigError(f"{where}: cannot import {module_name} ({type(err).__name__}: "
                          f"{str(err).splitlines()[0] if str(err) else ''})") from None
    found = getattr(module, attr, None)
    if not callable(found):
        raise ConfigError(f"{where}: module {module_name} has no callable {attr!r}")
    return found


def check_config(cfg) -> None:
    """A built-in family's own rules on a ModelConfig (imports its module, and jax); none for a
    model of the user's."""
    if cfg.family in FAMILIES:
        family(cfg.family).check_config(cfg)


def model_factory(name: str) -> Callable:
    """The factory `model.family` names, called as factory(cfg=, policy=, rngs=) (ConfigError if
    it cannot be found)."""
    from zerojax.models import protocol  # jax: only once a model is built

    if name in FAMILIES:
        return family(name).build
    module_name, _, attr = name.partition(":")
    where = f"model.family={name}"
    if not module_name or not attr:
        raise ConfigError(f"{where} is not valid; use {', '.join(FAMILIES)}, or module:factory (e.g. my_model:build)")
    factory = users_callable(name, where)
    try:
        protocol.check_factory(factory, attr)
    except protocol.ProtocolError as err:
        raise ConfigError(f"{where}: {err}") from None
    return factory


def build(cfg, policy, seed: int):
    """The model of `cfg` (a ModelConfig), checked against the unit protocol: a bug inside the
    model's own code raises as it is; a model that breaks the protocol is a ConfigError. Call
    under nnx.eval_shape for shapes only."""
    from flax import nnx

    from zerojax.models import protocol

    model = model_factory(cfg.family)(cfg=cfg, policy=policy, rngs=nnx.Rngs(seed))
    try:
        protocol.check(model)
    except protocol.ProtocolError as err:
        raise ConfigError(f"model.family={cfg.family}: {err}") from None
    return model
