"""Pieces the vision-language-action families share (π0's, and the ones built like it, as
openpi's and LeRobot's are): big_vision's prefix/suffix attention mask, and the sine-cosine
embedding of the flow's time, torch.nn.Linear's initialisation.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zerojax.precision import Policy


def make_att_2d_masks(pad_BL: jax.Array, ar_BL: jax.Array) -> jax.Array:
    """big_vision's (and LeRobot's) attention mask: token i attends to token j when both are real
    and j's cumulative autoregressive flag is at most i's. bool [B, L (query), L (key)]."""
    cum_BL = jnp.cumsum(ar_BL.astype(jnp.int32), axis=1)
    return (cum_BL[:, None, :] <= cum_BL[:, :, None]) & (pad_BL[:, None, :] & pad_BL[:, :, None])


def time_embedding(time_B: jax.Array, width: int, min_period: float = 4e-3, max_period: float = 4.0) -> jax.Array:
    """Sine-cosine embedding of scalar times, [B, width]: angles t·2π/period, periods from
    min_period to max_period, geometric (LeRobot's create_sinusoidal_pos_embedding).

    LeRobot computes the angles in float64 (up to 2π/4e-3 ≈ 1571 rad, where float32's spacing is
    1.2e-4); here in float32 pairs: each frequency split on the host into a 12-bit head and a
    tail, t into a 12-bit head and a tail, so that head x head is exact and the angle is that
    plus a small rest, sin(a + b) = sin a cos b + cos a sin b: within 1.2e-7 of float64's."""
    fraction = np.linspace(0.0, 1.0, width // 2, dtype=np.float64)
    scale = 1.0 / (min_period * (max_period / min_period) ** fraction) * 2 * math.pi
    s_hi = (scale.astype(np.float32).view(np.int32) & ~np.int32(0xFFF)).view(np.float32)
    s_lo = (scale - s_hi).astype(np.float32)
    t_BF = time_B.astype(jnp.float32)[:, None]
    c = t_BF * np.float32(4097.0)  # Veltkamp's split: t_hi keeps t's first 12 bits
    t_hi = c - (c - t_BF)
    t_lo = t_BF - t_hi
    a, b = t_hi * s_hi, t_hi * s_lo + t_lo * s_hi + t_lo * s_lo
    sin = jnp.sin(a) * jnp.cos(b) + jnp.cos(a) * jnp.sin(b)
    cos = jnp.cos(a) * jnp.cos(b) - jnp.sin(a) * jnp.sin(b)
    return jnp.concatenate([sin, cos], axis=1)


def linear(d_in: int, d_out: int, policy: Policy, rngs: nnx.Rngs) -> nnx.Linear:
    """torch.nn.Linear's layout and initialisation (uniform in ±1/sqrt(d_in)), with a bias."""
    bound = 1 / math.sqrt(d_in)
    init = lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)  # noqa: E731
    return nnx.Linear(d_in, d_out, dtype=policy.compute, param_dtype=policy.param, kernel_init=init,
                      bias_init=init, rngs=rngs)
