"""The mixed-precision policy: which dtype each copy of the weights and gradients lives in.

fp32 master weights (`param`) are the source of truth; the forward and backward run in
`compute`; weights travel in `gather` and gradients are reduced in `reduce`. Optimizer moments
stay fp32 whatever the policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Policy:
    param: jnp.dtype = jnp.float32
    compute: jnp.dtype = jnp.float32
    gather: jnp.dtype = jnp.float32
    reduce: jnp.dtype = jnp.float32

    def cast_to_compute(self, tree):
        return jax.tree.map(lambda x: x.astype(self.compute) if _is_float(x) else x, tree)


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def default_compute(platform: str) -> str:
    """bf16 where the hardware has it; fp32 on CPU, where XLA emulates bf16 dots with converts."""
    return "float32" if platform == "cpu" else "bfloat16"


def make_policy(param: str, compute: str, gather: str, reduce: str, platform: str) -> Policy:
    """A Policy from config names; `auto` resolves by platform (compute) or to compute (gather)."""
    compute = default_compute(platform) if compute == "auto" else compute
    gather = compute if gather == "auto" else gather
    return Policy(*(jnp.dtype(name) for name in (param, compute, gather, reduce)))
