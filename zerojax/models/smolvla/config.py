"""SmolVLA's config section, `model.smolvla.*` (beside the policies' `model.expert.*` and
`model.action.*`, which it reads too): a frozen dataclass that checks itself, declared to the
config through the registry (`registry.SECTIONS`). No jax here: the config imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerojax.models.family import at_least


@dataclass(frozen=True, kw_only=True)
class SmolVLAConfig:
    """model.smolvla: what SmolVLA adds to a VLM and an expert (LeRobot 0.6.1's SmolVLAConfig;
    ignored by the other families)."""

    self_attn_every_n_layers: int = 2  # every n-th expert layer attends to the prefix and itself; the rest cross-attend to the VLM's keys and values
    pixel_shuffle: int = 2  # the connector's pixel-shuffle factor (SmolVLMConfig.scale_factor; SmolVLM2-500M: 4)
    num_steps: int = 10  # Euler steps when sampling actions (LeRobot's num_steps)

    def __post_init__(self):
        for key in ("self_attn_every_n_layers", "pixel_shuffle", "num_steps"):
            at_least(f"model.smolvla.{key}", getattr(self, key), 1)
