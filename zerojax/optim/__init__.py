"""The optimizer and what wraps it: AdamW with clipping, host offload, LoRA.

    adamw.py     the optax chain, its schedule, decay mask and freezing
    offload.py   zero.offload: the update streamed unit by unit through host memory
    lora.py      LoRA adapters on a model's nnx.Linear layers
"""

from zerojax.optim.adamw import *  # noqa: F401,F403
