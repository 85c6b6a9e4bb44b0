"""The model families: `model.family` names a built-in one or a factory of the user's.

A built-in family is one module under `zerojax.models` (its modules, its config rule, its
Hugging Face layout, its FLOPs: `models/family.py` says what it declares); this table is the
only other place that names it. Importing the registry imports no family (and no jax): a
family's module is imported when it is first asked for.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable

from zerojax.errors import ConfigError

FAMILIES = {"gpt": "zerojax.models.gpt", "llama": "zerojax.models.llama", "gemma": "zerojax.models.gemma",
            "paligemma": "zerojax.models.paligemma", "pi0": "zerojax.models.pi0"}  # model.family -> module


def family_module(family: str):
    """The module of a built-in family."""
    return importlib.import_module(FAMILIES[family])


def hf_layouts() -> dict:
    """model.family -> its Hugging Face layout (a `family.HfLayout`), for the families that have one."""
    modules = {family: family_module(family) for family in FAMILIES}
    return {family: module.HF for family, module in modules.items() if getattr(module, "HF", None) is not None}


def hf_architectures() -> dict:
    """config.json architecture -> the model.family that reads it."""
    return {arch: family for family, layout in hf_layouts().items() for arch in layout.architectures}


def hf_layout(family: str):
    """The Hugging Face layout of `model.family` (ConfigError if it has none)."""
    layouts = hf_layouts()
    if family not in layouts:
        raise ConfigError(f"model.family={family}: no Hugging Face layout; zerojax converts "
                          f"{', '.join(layouts)} ({', '.join(hf_architectures())})")
    return layouts[family]


def lerobot_layouts() -> dict:
    """LeRobot policy type (config.json's "type") -> (the model.family that reads it, its `family.LeRobotLayout`)."""
    modules = {family: family_module(family) for family in FAMILIES}
    return {module.LEROBOT.type: (family, module.LEROBOT) for family, module in modules.items()
            if getattr(module, "LEROBOT", None) is not None}


def lerobot_layout(family: str):
    """The LeRobot layout of `model.family` (ConfigError if it has none)."""
    for name, layout in lerobot_layouts().values():
        if name == family:
            return layout
    raise ConfigError(f"model.family={family}: no LeRobot layout; zerojax converts LeRobot's "
                      f"{', '.join(lerobot_layouts()) or 'none'} policies")


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


def model_factory(family: str) -> Callable:
    """The factory `model.family` names, called as factory(cfg=, policy=, rngs=) (ConfigError if
    it cannot be found)."""
    from zerojax.models import protocol  # jax: only once a model is built

    if family in FAMILIES:
        return family_module(family).build
    module_name, _, attr = family.partition(":")
    where = f"model.family={family}"
    if not module_name or not attr:
        raise ConfigError(f"{where} is not valid; use {', '.join(FAMILIES)}, or module:factory (e.g. my_model:build)")
    factory = users_callable(family, where)
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
