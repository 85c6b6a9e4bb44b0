"""The optimizer and what wraps it: AdamW with clipping, host offload, LoRA.

    adamw.py     the optax chain as an `Optimizer` (its two parts, its update in place on the
                 device), its schedule, decay mask and freezing
    offload.py   zero.offload: the same Optimizer's update streamed unit by unit through host memory
    lora.py      LoRA adapters on a model's nnx.Linear layers
components.py  which parameters a key names: path patterns, or a model's named components
"""

from zerojax.optim.adamw import (NO_DECAY, Optimizer, check_freeze, decay_mask, is_frozen, make_optimizer,
                                 make_schedule, moving_average)

__all__ = ["NO_DECAY", "Optimizer", "check_freeze", "decay_mask", "is_frozen", "make_optimizer", "make_schedule",
           "moving_average"]
