"""Real-time chunking (zerojax/models/rtc.py) against LeRobot 0.6.1's own RTCProcessor
(tests/fixtures/rtc/lerobot_rtc.npz, written by scripts/fixtures/make_rtc_fixture.py in LeRobot's
venv), and the paper's Jacobian correction against the Jacobian written out."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zerojax.models import rtc

REF = dict(np.load(Path(__file__).parent / "fixtures" / "rtc" / "lerobot_rtc.npz"))
WEIGHTS = sorted(k for k in REF if k.startswith("weights/"))
GUIDED = sorted(k for k in REF if k.startswith("guided/"))


@pytest.mark.parametrize("key", WEIGHTS, ids=[k[len("weights/"):] for k in WEIGHTS])
def test_prefix_weights_are_lerobots(key):
    _, schedule, grid = key.split("/")
    delay, horizon, total = map(int, grid.split("_"))
    np.testing.assert_allclose(rtc.prefix_weights(delay, horizon, total, schedule), REF[key], atol=1e-7)


def denoiser(x):
    return jnp.tanh(x @ REF["W"] + REF["b"])


def guide_of(delay, horizon, jacobian=False):
    rows = [rtc.leftover_rows(left, delay, horizon, 8, 3) for left in REF["leftover"]]
    return rtc.Guide(jnp.asarray(np.stack([r[0] for r in rows])), jnp.asarray(np.stack([r[1] for r in rows])),
                     10.0, jacobian)


@pytest.mark.parametrize("key", GUIDED, ids=[k[len("guided/"):] for k in GUIDED])
def test_the_guided_velocity_is_lerobots(key):
    _, grid, time = key.split("/")
    delay, horizon = map(int, grid.split("_"))
    v = rtc.guided(denoiser, jnp.asarray(REF["x_t"]), float(time), guide_of(delay, horizon))
    np.testing.assert_allclose(np.asarray(v), REF[key], rtol=1e-5, atol=1e-6)


def test_the_jacobian_correction_pulls_the_error_back_through_the_denoiser():
    x, time, guide = jnp.asarray(REF["x_t"]), 0.6, guide_of(2, 6, jacobian=True)
    def flat(z):  # x1 as a function of x_t, flattened
        z = z.reshape(x.shape)
        return (z - time * denoiser(z)).reshape(-1)

    J = jax.jacobian(flat)(x.reshape(-1))  # [n, n], written out
    err = ((guide.leftover - flat(x.reshape(-1)).reshape(x.shape)) * guide.weights[..., None]).reshape(-1)
    expected = denoiser(x) - rtc.guidance_weight(jnp.float32(time), 10.0) * (J.T @ err).reshape(x.shape)
    np.testing.assert_allclose(np.asarray(rtc.guided(denoiser, x, time, guide)), np.asarray(expected), rtol=1e-5,
                               atol=1e-6)
    lerobots = rtc.guided(denoiser, x, time, guide._replace(jacobian=False))
    assert not np.allclose(np.asarray(lerobots), np.asarray(expected), atol=1e-3)  # the two differ here


def test_a_row_without_a_leftover_samples_as_without_rtc():
    x = jnp.asarray(REF["x_t"])
    left, weights = rtc.leftover_rows(None, 2, 4, 8, 3)
    assert not weights.any()
    guide = rtc.Guide(jnp.asarray(np.stack([left, left])), jnp.asarray(np.stack([weights, weights])))
    for jacobian in (False, True):
        np.testing.assert_array_equal(np.asarray(rtc.guided(denoiser, x, 0.5, guide._replace(jacobian=jacobian))),
                                      np.asarray(denoiser(x)))
