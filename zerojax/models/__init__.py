"""Flax NNX models behind one unit protocol (`protocol.py`). They know nothing about meshes.

    protocol.py   the unit protocol: STACKED, enter / between / exit, Units, forward
    registry.py   model.family -> a family's module, or a factory of the user's
    family.py     what a family declares besides its modules: HfLayout, Tensor (no jax)
    gpt.py        GPT-2's layout, llama.py  Llama's (and Mistral's): each with its config rule and HF layout
    gemma.py      Gemma's, paligemma.py  PaliGemma's (siglip.py's vision tower, then Gemma's layers)

Names are imported on first use, so `zerojax.models.registry` imports no jax.
"""

import importlib

_API = {"GPT": ("zerojax.models.gpt", "GPT"), "Llama": ("zerojax.models.llama", "Llama"),
        "ProtocolError": ("zerojax.models.protocol", "ProtocolError"),
        "Units": ("zerojax.models.protocol", "Units"),
        "cross_entropy": ("zerojax.models.protocol", "cross_entropy"),
        "FAMILIES": ("zerojax.models.registry", "FAMILIES")}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'zerojax.models' has no attribute {name!r}")
    module, attr = _API[name]
    return getattr(importlib.import_module(module), attr)
