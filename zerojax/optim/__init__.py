"""The optimizer and what wraps it: AdamW with clipping, host offload, LoRA.

    adamw.py     the optax chain as an `Optimizer` (its two parts, its update in place on the
                 device), its schedule, decay mask and freezing
    offload.py   zero.offload: the same Optimizer's update streamed unit by unit through host memory
    lora.py      LoRA adapters on a model's nnx.Linear layers
"""

from zerojax.optim.adamw import *  # noqa: F401,F403
