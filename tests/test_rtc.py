"""Real-time chunking (zerojax/models/vla/rtc.py) against LeRobot 0.6.1's own RTCProcessor
(tests/fixtures/rtc/lerobot_rtc.npz, written by scripts/fixtures/make_rtc_fixture.py in LeRobot's
venv), and the paper's Jacobian correction against the Jacobian written out."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import robot_observation
from zerojax.models.vla import rtc

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


# -- the rollout loop's timing: what is executed when, and what a request carries ---------------------

class Line:
    """A stand-in environment: the state is the step count; it records the actions it is given."""

    max_steps = 12

    def __init__(self):
        self.done = []

    def reset(self, seed):
        self.t = 0
        return {"observation.state": np.array([0.0])}

    def image(self):
        return None

    def step(self, action):
        self.done.append(float(action[0]))
        self.t += 1
        return {"observation.state": np.array([float(self.t)])}, False


def test_a_delay_keeps_the_committed_actions_and_rtc_sends_them_with_the_request():
    from zerojax.sim import rollout

    asked = []

    def policy(obs, request, env, leftover=None, delay=0):
        asked.append((request, float(obs["observation.state"][0]), None if leftover is None else leftover[:, 0].tolist(),
                      delay))
        return np.array([[100 * (request % 10) + k] for k in range(6)], np.float32)  # chunk r: 100r + k

    policy.reads_camera = False
    env = Line()
    ep = rollout.episode(env, policy, 0, 0, rollout.Chunking(n_action_steps=3, delay=2, rtc=True), None, 12)
    # chunk 0 from step 0: actions 0-2; chunk 1 asked at step 3, while 3 and 4 of chunk 0 run; then chunk 1
    # from its action 2 (step 5), and so on: each chunk runs 3 steps from its request
    assert env.done == [0, 1, 2, 3, 4, 102, 103, 104, 202, 203, 204, 302]
    assert asked[:3] == [(0, 0.0, None, 0), (1, 3.0, [3.0, 4.0, 5.0], 2), (2, 6.0, [103.0, 104.0, 105.0], 2)]
    assert ep.seams == [5, 8, 11] and ep.steps == 12
    seams, inner = ep.jumps()
    assert seams == [98.0] * 3 and set(inner) == {1.0}
    env = Line()  # a delay as long as the actions a chunk runs: each runs only while the next is computed
    ep = rollout.episode(env, policy, 0, 0, rollout.Chunking(n_action_steps=3, delay=3, rtc=True), None, 12)
    assert env.done == [0, 1, 2, 3, 4, 5, 103, 104, 105, 203, 204, 205]
    assert ep.seams == [6, 9] and ep.jumps()[0] == [98.0, 98.0]
    asked.clear()
    env = Line()
    rollout.episode(env, policy, 0, 0, rollout.Chunking(n_action_steps=4), None, 12)  # no delay, no RTC: as before
    assert env.done == [0, 1, 2, 3, 100, 101, 102, 103, 200, 201, 202, 203]
    assert [a[2] for a in asked] == [None, None, None]


# -- a policy's sampling under a guide, and `zerojax serve`'s requests that carry one ---------------

@pytest.fixture(scope="module")
def lerobot_pi0():
    from zerojax.serve import loaders

    lerobot = Path(__file__).parent / "fixtures" / "lerobot"
    return loaders.load(lerobot / "pi0", num_steps=10, tokenizer=str(lerobot / "pi0_tokenizer.json"), vision_heads=2)


def test_a_request_with_committed_actions_gets_a_chunk_that_keeps_them(lerobot_pi0):
    served, obs = lerobot_pi0, robot_observation(lerobot_pi0)
    plain = served.infer(obs, 3)["actions"]
    previous = served.infer(obs, 4)["actions"]  # another chunk: what the robot is executing
    leftover = previous[2:]  # two of its actions already done when the request leaves
    guided = served.infer({**obs, "prev_actions": leftover, "inference_delay": 2}, 3)["actions"]
    # the first two actions (executed while this request is served) follow the committed ones
    far, near = np.abs(plain[:2] - leftover[:2]).mean(), np.abs(guided[:2] - leftover[:2]).mean()
    assert near < 0.25 * far, (near, far)
    # with no leftover the guide weighs nothing: the chunk is the plain one
    np.testing.assert_allclose(served.infer(obs, 3)["actions"], plain, rtol=0, atol=0)


BAD_RTC = {  # (what the request adds, for actions of width w; what the error says)
    "a delay alone": (lambda w: {"inference_delay": 2}, "'inference_delay' goes with 'prev_actions'"),
    "the wrong width": (lambda w: {"prev_actions": np.zeros((3, w + 2), np.float32)},
                        "'prev_actions' must be the previous chunk's unexecuted actions"),
    "a delay past them": (lambda w: {"prev_actions": np.zeros((3, w)), "inference_delay": 4},
                          "'inference_delay' must be an int from 0 to the 3"),
    "a NaN": (lambda w: {"prev_actions": np.full((1, w), np.nan)}, "'prev_actions' holds a NaN"),
    "a float delay": (lambda w: {"prev_actions": np.zeros((1, w)), "inference_delay": 1.5},
                      "'inference_delay' must be an int"),
    "ragged": (lambda w: {"prev_actions": [[0.0] * w, [0.0]]}, "'prev_actions' is not an array of numbers"),
}


@pytest.mark.parametrize("case", BAD_RTC)
def test_a_bad_rtc_request_is_an_observation_error(lerobot_pi0, case):
    from zerojax.serve.observation import ObservationError

    make, message = BAD_RTC[case]
    with pytest.raises(ObservationError) as err:
        lerobot_pi0.infer({**robot_observation(lerobot_pi0), **make(lerobot_pi0.action_dim)}, 0)
    assert message in str(err.value), str(err.value)
