"""Flax NNX models behind one unit protocol (`protocol.py`). They know nothing about meshes."""

from zerojax.models import gpt, llama
from zerojax.models.gpt import GPT
from zerojax.models.llama import Llama
from zerojax.models.protocol import ProtocolError, Units, cross_entropy

FAMILIES = {"gpt": gpt.build, "llama": llama.build}  # model.family -> factory(cfg=, policy=, rngs=)

__all__ = ["FAMILIES", "GPT", "Llama", "ProtocolError", "Units", "cross_entropy"]
