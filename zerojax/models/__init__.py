"""Flax NNX models behind one unit protocol (`protocol.py`). They know nothing about meshes.

    protocol.py   the unit protocol: STACKED, enter / between / exit, Units, forward, cross_entropy
    registry.py   model.family -> a family's module, or a factory of the user's (no jax)
    family.py     what a family declares besides its modules: HfLayout, Tensor (no jax)
    flops.py      PaLM's FLOPs formula, once (no jax)
    gpt.py        GPT-2's layout, llama.py  Llama's (and Mistral's): each with its config rule and HF layout
    gemma.py      Gemma's, paligemma.py  PaliGemma's (siglip.py's vision tower, then Gemma's layers)
    pi0.py        π0's: PaliGemma's layers beside an action expert's

The package names nothing: `zerojax.models.registry` must import no jax, and importing it runs
this file first. Import the module (`from zerojax.models import protocol`, `protocol.Units`).
"""
