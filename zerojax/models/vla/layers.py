"""Pieces the vision-language-action families share (π0's, π0.5's and SmolVLA's, as openpi's and
LeRobot's are built): big_vision's prefix/suffix attention mask, the joint attention of two
streams, the sine-cosine embedding of the flow's time, torch.nn.Linear's initialisation.

The joint attention: a prefix stream (the VLM's, [B, P, ...]) and a suffix stream (the action
expert's, [B, S, ...]) each project their own queries, keys and values (`decoder.Stream`); these
are concatenated over the sequence, rotated at the tokens' positions (the real tokens counted),
and attended once under the mask the pad and autoregressive flags make. Sampling runs the prefix
once (`prefix_attention`, keeping its keys and values) and then the suffix alone over them
(`cached_attention`).

Shapes: B batch, P prefix, S suffix, L = P + S, Q query heads, G key/value heads, K head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zerojax.errors import ConfigError
from zerojax.models import attention
from zerojax.models.decoder import rope
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


def check_time_width(cfg) -> None:
    """model.expert.d_model holds the action tokens' time embedding: one sine and one cosine per
    frequency, so it is even (ConfigError if not)."""
    if cfg.expert.d_model % 2:
        raise ConfigError(f"model.expert.d_model={cfg.expert.d_model} must be even: the action tokens' sine-cosine "
                          "time embedding has one sine and one cosine per frequency")


def linear(d_in: int, d_out: int, policy: Policy, rngs: nnx.Rngs) -> nnx.Linear:
    """torch.nn.Linear's layout and initialisation (uniform in ±1/sqrt(d_in)), with a bias."""
    bound = 1 / math.sqrt(d_in)
    init = lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)  # noqa: E731
    return nnx.Linear(d_in, d_out, dtype=policy.compute, param_dtype=policy.param, kernel_init=init,
                      bias_init=init, rngs=rngs)


def attend(q_BTQK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array, mask: attention.Mask,
           spec: attention.Spec) -> jax.Array:
    """Grouped-query attention under `mask`, scores (from fp32 queries and keys, as openpi's) and
    softmax in fp32: [B, T, Q, K]. A masked score is fp32's lowest, openpi's -2.38e38: either
    underflows to a zero weight, and a row with no key left averages every key under both."""
    return attention.attend(q_BTQK.astype(jnp.float32), k_BSGK.astype(jnp.float32), v_BSGK, mask, spec)


def joint_attention(prefix_qkv, suffix_qkv, pad_BL: jax.Array, ar_BL: jax.Array, theta: float,
                    spec: attention.Spec) -> jax.Array:
    """Both streams' queries, keys and values in one attention (module docstring): [B, L, Q, K]."""
    (qp, kp, vp), (qs, ks, vs) = prefix_qkv, suffix_qkv
    positions_BL = jnp.cumsum(pad_BL.astype(jnp.int32), axis=1) - 1
    q = rope(jnp.concatenate([qp, qs.astype(qp.dtype)], axis=1), theta, positions_BL)
    k = rope(jnp.concatenate([kp, ks.astype(kp.dtype)], axis=1), theta, positions_BL)
    v = jnp.concatenate([vp, vs.astype(vp.dtype)], axis=1)
    return attend(q, k, v, attention.blocks(pad_BL, ar_BL), spec)


def prefix_attention(qkv, positions_BP: jax.Array, mask: attention.Mask, theta: float, spec: attention.Spec):
    """The prefix alone (sampling): (its attention [B, P, Q, K], its rotated keys and values)."""
    q, k, v = qkv
    q, k = rope(q, theta, positions_BP), rope(k, theta, positions_BP)
    return attend(q, k, v, mask, spec), (k, v)


def cached_attention(qkv, kv, positions_BS: jax.Array, mask: attention.Mask, theta: float,
                     spec: attention.Spec) -> jax.Array:
    """The suffix's queries over the cached prefix's keys and values `kv` and its own: [B, S, Q, K]."""
    q, k, v = qkv
    q, k = rope(q, theta, positions_BS), rope(k, theta, positions_BS)
    k = jnp.concatenate([kv[0], k.astype(kv[0].dtype)], axis=1)
    v = jnp.concatenate([kv[1], v.astype(kv[1].dtype)], axis=1)
    return attend(q, k, v, mask, spec)
