"""Flow matching's randomness as data: each row's noise and time, a pure function of
(seed, split, step, row), so that a π0 step's loss is the same on any mesh, any number of
processes and any train.grad_accum (every row draws its own, wherever it is computed).

t ~ Beta(1.5, 1)·0.999 + 0.001 and noise ~ N(0, I), as LeRobot's and openpi's π0 sample them.
"""

from __future__ import annotations

import numpy as np

STREAM = 7  # a generator stream of its own, apart from the rows' (data.TRAIN, data.EVAL)


def noise_and_time(seed: int, split: int, step: int, rows: range, horizon: int, action_dim: int):
    """(noise float32 [len(rows), horizon, action_dim], time float32 [len(rows)]) for those rows
    of the global batch of `step`."""
    noise = np.empty((len(rows), horizon, action_dim), np.float32)
    time = np.empty(len(rows), np.float32)
    for k, row in enumerate(rows):
        rng = np.random.default_rng((seed, STREAM, split, step, row))
        time[k] = rng.beta(1.5, 1.0) * 0.999 + 0.001
        noise[k] = rng.standard_normal((horizon, action_dim), np.float32)
    return noise, time
