"""What a schedule needs of the config beyond the plan and the policy."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepOptions:
    """What a schedule needs of the config beyond the plan and the policy."""

    grad_accum: int = 1  # microbatches per step
    remat: str = "full"  # model.remat: none | full | dots
    prefetch: int = 1  # stage 3: units gathered ahead of the one computing
    reshard_after_forward: bool = True  # stage 3: free the forward's gathered units
