"""A policy run served: an observation in the robot's units in, an action chunk in the robot's
units out (`zerojax serve`, docs/design.md "Serving a policy"), as openpi's `Policy` is a model
between its input and output transforms.

`ServedPolicy` holds the model and its `Observations` (observation.py: validation,
normalization, tokenization, the actions back in the robot's units), and owns what is about the
model: `sample_actions` jitted once, real-time chunking's guide, batches of observations padded to
a few compiled sizes, and the warm-up that compiles them. loaders.py builds it from a run, an
export or a LeRobot policy directory.

Each request draws fresh noise: request n (the server counts them from 0 over its life, all
connections together) draws jax.random.normal(fold_in(key(seed), n), [1, *chunk]), the chunk the
adapter names ([H, max_action_dim] for π0), so a restarted server answers the same requests with
the same actions. The actions are cut to the dataset's action width and unnormalized with the
run's statistics: float32 [H, D_a]; a run of relative actions has the observation's state added
back (its row carries the state as ROBOT_STATE, which the model never sees).

A request with `prev_actions` and `inference_delay` = d (real-time chunking) is answered by the
run's kind: a run trained with model.action.train_delay = D > 0 (training-time RTC) is given the
first d of them, d <= D, held exactly in its chunk (`sample_actions(prefix_actions, delay)`: no
guidance); a run trained without it is guided by them (inference-time RTC, `rtc.Guide`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zerojax.models.family import STATE
from zerojax.models.vla import rtc
from zerojax.serve.mixture import Datasets
from zerojax.serve.observation import DATASET, ObservationError, Observations

ROBOT_STATE = "robot_state"  # a row's state in the robot's units [1, D_s], where the actions are relative to it


@dataclass
class ServedPolicy:
    """A run's policy with what it needs to read observations and write actions (module docstring)."""

    where: str  # "RUN_DIR (step N)"
    model: object  # the loaded policy, one device, fp32
    # what reads its observations and writes its actions: a run's `Observations` (lerobot.json's
    # features and statistics, the tokenizer, the model's keys), or a mixture run's `Datasets`
    # (serve/mixture.py: a request names its dataset)
    observations: Observations | Datasets
    num_steps: int
    seed: int
    fps: float = 0.0
    compile_s: float = 0.0  # the first call (compiling sample_actions)
    call_ms: float = 0.0  # a call after it
    max_batch: int = 1  # observations sampled in one call at most (`infer_rows`; 1: one at a time, as openpi)
    rtc_horizon: int = 10  # real-time chunking's execution horizon (LeRobot's execution_horizon)
    rtc_jacobian: bool = False  # the paper's correction through the denoiser, not LeRobot's (models/vla/rtc.py)

    def __post_init__(self):
        seen = self.observations
        self.model_keys, self.relative, self.mixture = seen.model_keys, seen.relative, isinstance(seen, Datasets)
        self.cameras, self.state_dim, self.action_dim = seen.cameras, seen.state_dim, seen.action_dim
        self.adapter, self.pad_before, self.horizon = seen.adapter, seen.pad_before, seen.horizon
        graphdef, self.params = nnx.split(self.model)
        # training-time real-time chunking's capacity (0: the run is guided, inference-time RTC)
        self.train_delay = int(self.model_keys.get("action", {}).get("train_delay", 0))
        shape = (1, self.horizon, seen.chunk_width)

        def noise(request):
            return jax.random.normal(jax.random.fold_in(jax.random.key(self.seed), request), shape, jnp.float32)

        def sample(params, batch, noise):
            batch, model = dict(batch), nnx.merge(graphdef, params)
            batch.pop(ROBOT_STATE, None)  # for the actions' way back (`rows_actions`), not the model's
            if self.train_delay:  # a row given nothing has delay 0: it samples as without it
                return model.sample_actions(batch, noise, self.num_steps, prefix_actions=batch.pop("prefix_actions"),
                                            delay=batch.pop("prefix_delay"))
            # a row without a leftover has weights 0: its velocity is left as it is
            guide = rtc.Guide(batch.pop("rtc_leftover"), batch.pop("rtc_weights"), jacobian=self.rtc_jacobian)
            return model.sample_actions(batch, noise, self.num_steps, guide=guide)

        self._noise, self._sample = jax.jit(noise), jax.jit(sample)

    @property
    def max_message_bytes(self) -> int:
        """The largest observation accepted: every camera as float32 at its dataset size or up
        to 512 x 512, whichever is larger, and 1 MiB for the state, the prompt and msgpack."""
        shapes = self.observations.camera_shapes.values()
        return 2**20 + 4 * 3 * sum(max(math.prod(shape[:2]), 512 * 512) for shape in shapes)

    def metadata(self) -> dict:
        """What the server sends on connect: enough for a client to build an observation."""
        return {"policy": f"zerojax {self.model_keys['family']}", "run": self.where, **self.observations.describe(),
                "action_horizon": self.horizon, "fps": self.fps, "num_steps": self.num_steps,
                "seed": self.seed, "max_message_bytes": self.max_message_bytes,
                "real_time_chunking": ({"kind": "trained", "max_inference_delay": self.train_delay} if self.train_delay
                                       else {"kind": "guided"})}

    def batch(self, obs) -> dict:
        """The family's batch of one row for the observation, as training builds its rows, with
        its real-time-chunking guide."""
        seen = self.observations.member(obs)  # a mixture run's: the request's dataset's
        raw = seen.check(obs)
        # the state in the robot's units, padded to the run's width (a mixture's rows of several datasets stack)
        state = {ROBOT_STATE: np.pad(raw[STATE], (0, self.state_dim - len(raw[STATE])))[None]} \
            if self.observations.relative else {}
        return {**seen.row(raw), **state,
                **self.rtc_row(raw.get("prev_actions"), raw.get("inference_delay", 0), raw[STATE], seen)}

    def rtc_row(self, leftover, delay: int, state: np.ndarray, seen: Observations | None = None) -> dict:
        """The row's real-time chunking: the leftover normalized as the actions were (with `seen`'s
        statistics, a mixture's dataset's; relative to the observation's `state` where they were),
        padded; the guide's weights, or (a run trained with train_delay) the prefix given and its length."""
        x = None if leftover is None else (seen or self.observations).normalized_actions(leftover, state)
        padded, weights = rtc.leftover_rows(x, delay, self.rtc_horizon, self.horizon, self.observations.chunk_width)
        if not self.train_delay:
            return {"rtc_leftover": padded[None], "rtc_weights": weights[None]}
        if delay > self.train_delay:
            raise ObservationError(f"observation: 'inference_delay'={delay} is more than this run was trained to be "
                                   f"given (model.action.train_delay={self.train_delay}); send an inference_delay "
                                   f"from 0 to {self.train_delay}, or serve a run trained with a larger train_delay")
        return {"prefix_actions": padded[None], "prefix_delay": np.asarray([0 if x is None else delay], np.int32)}

    def noise(self, request: int) -> jax.Array:
        """The noise of request number `request` (module docstring): [1, *chunk]."""
        return self._noise(np.uint32(request))

    def actions(self, batch: dict, noise) -> np.ndarray:
        """float32 [H, D_a] in the robot's units: `sample_actions` on the batch from `noise`, cut to
        the dataset's action width and unnormalized with the run's statistics (a batch of rows:
        [B, H, D_a])."""
        out = self.rows_actions(batch, noise)
        return out[0] if len(out) == 1 else out

    def rows_actions(self, batch: dict, noise) -> np.ndarray:
        """`actions` of every row, [B, H, D_a] whatever B."""
        batch = dict(batch)
        datasets = batch.pop(DATASET, None)  # a mixture run's rows: each one's dataset
        actions = np.asarray(self._sample(self.params, batch, jnp.asarray(noise, jnp.float32)))
        return self.observations.robot_actions(actions, batch.get(ROBOT_STATE), datasets)

    def infer(self, obs, request: int) -> dict:
        """{"actions": float32 [H, D_a]} in the robot's units, for one observation, with the
        noise of request number `request`."""
        return {"actions": self.actions(self.batch(obs), self.noise(request))}

    # -- batched serving: the server checks each observation as it arrives (`prepare`), then
    # samples the rows that arrived together in one call (`infer_rows`)

    def prepare(self, obs) -> dict:
        """The observation checked and made into its batch row (ObservationError if it is bad)."""
        return self.batch(obs)

    def infer_rows(self, rows: list[dict], requests: list[int]) -> list[dict]:
        """`infer` for several prepared rows in one `sample_actions` call, each row with its own
        request's noise: the same actions as one at a time. The batch is padded (with its first
        row) to the next power of two up to `max_batch`, so that few shapes are ever compiled."""
        size = bucket(len(rows), self.max_batch)
        padded = rows + [rows[0]] * (size - len(rows))
        batch = {k: np.concatenate([r[k] for r in padded]) for k in rows[0]}
        noise = np.concatenate([np.asarray(self.noise(q)) for q in requests + [requests[0]] * (size - len(rows))])
        actions = self.rows_actions(batch, noise)
        return [{"actions": actions[i]} for i in range(len(rows))]

    @property
    def expected_keys(self) -> tuple:
        return self.observations.expected_keys

    def warm_up(self) -> None:
        """Compile sample_actions for every batch size `infer_rows` uses (1, 2, 4, ... max_batch),
        and time one call of one row after it, on a blank observation."""
        row = self.batch(self.observations.blank())
        start = time.perf_counter()
        for size in sorted({bucket(n, self.max_batch) for n in range(1, self.max_batch + 1)}):
            self.infer_rows([row] * size, [0] * size)
        self.compile_s = time.perf_counter() - start
        start = time.perf_counter()
        row = {k: v for k, v in row.items() if k != DATASET}
        jax.block_until_ready(self._sample(self.params, row, self.noise(0)))
        self.call_ms = (time.perf_counter() - start) * 1e3


def bucket(n: int, most: int) -> int:
    """The batch size n rows are padded to: the next power of two, at most `most` (n <= most)."""
    return min(1 << (n - 1).bit_length(), most) if n > 1 else 1
