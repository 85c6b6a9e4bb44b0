"""Real-time chunking (RTC: Black, Galliker and Levine, 2025): a flow policy's next action chunk
inpainted to agree with the actions already committed, so that a robot moving on while the next
chunk is computed does not jump at the seam. Family-agnostic: a policy's `sample_actions` asks
`guided` for each Euler step's velocity when it is given a `Guide`.

At the request the robot still holds the previous chunk's unexecuted actions (the *leftover*,
in the model's normalized space, zero-padded to [H, A]); `delay` of them will be executed while
this inference runs. Each denoising step estimates the clean chunk x1 = x_t - t·v_t (time runs
from 1, noise, to 0), weighs its disagreement with the leftover, err = (leftover - x1)·W, and
corrects the velocity: v_t - w(t)·correction, with W = `prefix_weights` (1 over the first
`delay` actions, then a ramp down to 0 at the execution horizon) and w(t) the paper's guidance
weight, capped at `max_weight`.

The correction is LeRobot 0.6.1's by default (`RTCProcessor.denoise_step`: it computes v_t before
marking x_t for the gradient, so ∂x1/∂x_t is the identity and the correction is err itself;
`tests/test_rtc.py` holds zerojax to LeRobot's numbers), or, with `jacobian=True`, the paper's
and Physical Intelligence's Kinetix code's: err pulled back through the denoiser,
(∂x1/∂x_t)ᵀ·err, one vector-Jacobian product (`jax.vjp`) a step, about a backward pass more.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

SCHEDULES = ("zeros", "ones", "linear", "exp")  # LeRobot's RTCAttentionSchedule


class Guide(NamedTuple):
    """What guides one sampling call: per row, the leftover and its weights."""

    leftover: jax.Array  # [B, H, A] the previous chunk's unexecuted actions (normalized, zero-padded)
    weights: jax.Array  # [B, H] `prefix_weights` (all 0: a row without a leftover samples as without RTC)
    max_weight: float = 10.0  # LeRobot's max_guidance_weight
    jacobian: bool = False  # the correction through the denoiser (the paper's) instead of LeRobot's err


def prefix_weights(delay: int, horizon: int, total: int, schedule: str = "linear") -> np.ndarray:
    """float32 [total]: 1 for the first `delay` actions (executed during inference: the new chunk
    must keep them), a ramp from 1 to 0 over the rest of the execution `horizon` (`schedule`:
    linear, or exp, LeRobot's x·expm1(x)/(e - 1) of the linear ramp), 0 after it; `zeros`: 1 for
    the first `delay` only; `ones`: 1 up to the horizon. LeRobot's get_prefix_weights."""
    start = min(delay, horizon)
    if schedule == "zeros":
        return (np.arange(total) < start).astype(np.float32)
    if schedule == "ones":
        return (np.arange(total) < horizon).astype(np.float32)
    steps = total - max(total - horizon, 0) - start
    ramp = np.linspace(1, 0, steps + 2, dtype=np.float32)[1:-1] if horizon > start and steps > 0 else np.zeros(0)
    if schedule == "exp":
        ramp = ramp * np.expm1(ramp) / np.float32(np.e - 1)
    out = np.concatenate([np.ones(min(start, total)), ramp, np.zeros(max(total - horizon, 0))]).astype(np.float32)
    return out[:total]


def guidance_weight(time: jax.Array, max_weight: float) -> jax.Array:
    """The paper's w(t), with τ = 1 - time (its time runs from 0, noise, to 1): (1-τ)/τ · ((1-τ)² +
    τ²)/(1-τ)², capped at `max_weight` (and max_weight where it is infinite, at τ = 0)."""
    tau = 1.0 - time
    c = (1.0 - tau) / tau
    inv_r2 = ((1.0 - tau) ** 2 + tau**2) / (1.0 - tau) ** 2
    w = jnp.where(jnp.isfinite(c), c * inv_r2, max_weight)
    return jnp.minimum(jnp.where(jnp.isfinite(w), w, max_weight), max_weight)


def guided(velocity: Callable[[jax.Array], jax.Array], x_t: jax.Array, time, guide: Guide) -> jax.Array:
    """The velocity at (x_t, time), corrected toward `guide.leftover` (module docstring)."""
    time = jnp.asarray(time, jnp.float32)

    def clean(x):
        v = velocity(x)
        return x - time * v, v

    if guide.jacobian:
        x1, pull_back, v = jax.vjp(clean, x_t, has_aux=True)
        err = (guide.leftover - x1) * guide.weights[..., None]
        correction = pull_back(err)[0]
    else:
        x1, v = clean(x_t)
        correction = (guide.leftover - x1) * guide.weights[..., None]
    return v - guidance_weight(time, guide.max_weight) * correction


def leftover_rows(leftover: np.ndarray | None, delay: int, horizon: int, total: int, width: int,
                  schedule: str = "linear") -> tuple[np.ndarray, np.ndarray]:
    """One row's (leftover [total, width] zero-padded, weights [total]) from the previous chunk's
    unexecuted actions [K, D] (normalized; None: no guidance, weights 0). The execution horizon
    is cut to what the leftover holds, as LeRobot cuts it."""
    if leftover is None or len(leftover) == 0:
        return np.zeros((total, width), np.float32), np.zeros(total, np.float32)
    k = min(len(leftover), total)
    padded = np.zeros((total, width), np.float32)
    padded[:k, : leftover.shape[1]] = leftover[:k, :width]
    return padded, prefix_weights(delay, min(horizon, k), total, schedule)


def integrate(velocity, noise: jax.Array, times: np.ndarray, guide: Guide | None) -> jax.Array:
    """Euler steps of `velocity(x_t, t)` from the noise at t = times[0] = 1 towards 0, dt = -1 /
    len(times) (a policy family's sampler; `times`: its `euler_times`); with a `guide`, each
    step's velocity is real-time chunking's (`guided`)."""
    dt = jnp.float32(-1.0 / len(times))
    x_t = noise.astype(jnp.float32)
    for time in times:
        t = jnp.float32(time)
        v_t = velocity(x_t, t) if guide is None else guided(lambda x: velocity(x, t), x_t, t, guide)
        x_t = x_t + dt * v_t
    return x_t
