"""Mixed precision: the dtype policy and loss scaling.

fp32 master weights (`param`) are the source of truth; the forward and backward run in
`compute`; weights travel in `gather` and gradients are reduced in `reduce`. A gather dtype of
int8 or float8_e4m3fn is a block-quantized gather (`zerojax.quant`, blocks of `quant_block`
elements), dequantized into `compute` on arrival. Optimizer moments and gradient accumulators
stay fp32 whatever the policy. fp16's narrow range needs the loss
scaled so that small gradients do not underflow (Micikevicius et al. 2017); bf16 does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Policy:
    param: jnp.dtype = jnp.float32
    compute: jnp.dtype = jnp.float32
    gather: jnp.dtype = jnp.float32
    reduce: jnp.dtype = jnp.float32
    quant_block: int = 2048  # elements per scale of a quantized gather (zero.quant_block)
    quant_scale: jnp.dtype = jnp.float32  # dtype of those scales (bf16 measured no better: BENCHMARKS.md)


def default_compute(platform: str) -> str:
    """bf16 where the hardware has it; fp32 on CPU, where XLA emulates bf16 dots with converts."""
    return "float32" if platform == "cpu" else "bfloat16"


def make_policy(param: str, compute: str, gather: str, reduce: str, platform: str,
                quant_block: int = 2048) -> Policy:
    """A Policy from config names; `auto` resolves by platform (compute) or to compute (gather)."""
    compute = default_compute(platform) if compute == "auto" else compute
    gather = compute if gather == "auto" else gather
    return Policy(*(jnp.dtype(name) for name in (param, compute, gather, reduce)), quant_block)


class LossScaleState(NamedTuple):
    scale: jax.Array  # float32: the loss is multiplied by this before the backward pass
    hysteresis: jax.Array  # int32: overflows still tolerated before the scale is lowered
    good_steps: jax.Array  # int32: finite steps since the last overflow or growth


@dataclass(frozen=True)
class LossScaler:
    """Loss scaling with DeepSpeed's dynamic rule (fp16 `DynamicLossScaler`).

    dynamic: start at 2**initial_scale_power; after `window` finite steps in a row double the
    scale (and restore the hysteresis); on a non-finite step skip the update and use up one
    unit of hysteresis, or, with none left, halve the scale (never below `min_scale`).
    static: a constant scale. none: scale 1. Every mode skips non-finite steps.
    """

    mode: str = "none"  # dynamic | static | none
    initial: float = 1.0
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0

    def init(self) -> LossScaleState:
        return LossScaleState(jnp.float32(self.initial), jnp.int32(self.hysteresis), jnp.int32(0))

    def update(self, state: LossScaleState, finite: jax.Array) -> LossScaleState:
        if self.mode != "dynamic":
            return state
        good = jnp.where(finite, state.good_steps + 1, 0)
        grow = finite & (good >= self.window)
        lower = ~finite & (state.hysteresis <= 1)
        scale = jnp.where(grow, state.scale * 2, state.scale)
        scale = jnp.where(lower, jnp.maximum(state.scale / 2, self.min_scale), scale)
        hysteresis = jnp.where(grow, self.hysteresis,
                               jnp.where(finite | lower, state.hysteresis, state.hysteresis - 1))
        return LossScaleState(scale.astype(jnp.float32), hysteresis.astype(jnp.int32),
                              jnp.where(grow, 0, good).astype(jnp.int32))


def make_loss_scaler(loss_scale: str | float, policy: Policy, *, initial_scale_power: int,
                     loss_scale_window: int, hysteresis: int, min_loss_scale: float) -> LossScaler:
    """`dynamic` scales only fp16 compute: bf16 and fp32 have fp32's range and need no scaling."""
    if isinstance(loss_scale, (int, float)):
        return LossScaler("static", float(loss_scale))
    if loss_scale == "none" or jnp.float16 not in (policy.compute, policy.gather):
        return LossScaler("none")
    return LossScaler("dynamic", 2.0**initial_scale_power, loss_scale_window, hysteresis, min_loss_scale)
