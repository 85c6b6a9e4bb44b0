"""Flax NNX models. They declare their units and know nothing about meshes."""

from zerojax.models.gpt import GPT, cross_entropy

__all__ = ["GPT", "cross_entropy"]
