"""Flax NNX models behind one unit protocol (`protocol.py`). They know nothing about meshes.

    protocol.py        the unit protocol: STACKED, enter / between / exit, Units, forward, cross_entropy
    registry.py        model.family -> a family's module, or a factory of the user's (no jax)
    family.py          what a family declares: Family, its layouts (HfLayout, LeRobotLayout, OpenpiLayout,
                       Tensor, Rule) and a policy's PolicyAdapter (no jax)
    flops.py           PaLM's FLOPs formula, once (no jax)
    attention.py       masks and the attention kernels (dense, chunked, cuDNN), as model.attention says
    vocab_loss.py      the cross-entropy of a plain LM head, in blocks of tokens and of the vocabulary
    decoder.py         the pre-norm decoder layer (Llama's, Gemma's, a VLA's stream) and its one HF key table
    siglip.py          SigLIP's vision tower and its HF key table
    gpt.py             GPT-2; llama.py Llama (and Mistral); gemma.py Gemma; paligemma.py PaliGemma: each a
                       language or vision-language family with its config rule and HF layout
    vla/               what the policies share: the flow-matching base, joint attention, RTC, the batch
                       adapter, model.expert/action, the LeRobot layouts' readers
    paligemma_expert/  PaliGemma with an action expert: the body π0 and π0.5 share, its LeRobot and openpi names
    pi0/ pi05/ smolvla/  the policy families, one package each: model (and FAMILY), layouts, own batch or config

The package names nothing: `zerojax.models.registry` must import no jax, and importing it runs
this file first. Import the module (`from zerojax.models import protocol`, `protocol.Units`).
"""
