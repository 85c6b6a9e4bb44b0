"""A ZeRO stage as data: which copies of a parameter are split over the `data` axis.

    stage  master + Adam moments  gradient  accumulator  compute params
    0      replicated             repl.     repl.        replicated      (DDP, NO_SHARD)
    1      sharded                sharded   repl.        replicated
    2      sharded                sharded   sharded      replicated      (SHARD_GRAD_OP)
    3      sharded                sharded   sharded      sharded         (FULL_SHARD)

The schedules read what to do (gather per unit or per step, scatter per unit or per step) from
these four booleans; no stage has code of its own."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageLayout:
    master: bool  # fp32 master weights and the optimizer moments
    grads: bool  # the gradient handed to the optimizer
    accum: bool  # the gradient-accumulation buffer
    compute: bool  # the params the forward/backward sees

    # What the unit schedule does, read from the layout (stages are data, not code paths):
    @property
    def gather_per_unit(self) -> bool:
        """Weights gathered unit by unit, in each pass (stage 3)."""
        return self.compute

    @property
    def gather_per_step(self) -> bool:
        """Sharded weights gathered whole once per step (stages 1, 2)."""
        return self.master and not self.compute

    @property
    def scatter_per_unit(self) -> bool:
        """Each unit's gradient reduce-scattered as soon as it exists (stages 2, 3)."""
        return self.accum

    @property
    def scatter_per_step(self) -> bool:
        """Full local gradients reduce-scattered once per step (stage 1)."""
        return self.grads and not self.accum


LAYOUTS = {
    0: StageLayout(master=False, grads=False, accum=False, compute=False),
    1: StageLayout(master=True, grads=True, accum=False, compute=False),
    2: StageLayout(master=True, grads=True, accum=True, compute=False),
    3: StageLayout(master=True, grads=True, accum=True, compute=True),
}
