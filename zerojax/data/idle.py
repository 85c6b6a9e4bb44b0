"""`data.filter_idle`: training frames whose action chunk barely moves are dropped before
training, openpi's DROID rule (`openpi/training/droid_rlds_dataset.py`, `filter_idle`).

A frame is kept when some action among the first half of its chunk (max(1, H // 2) steps from
the frame, H = data.action_horizon, clamped to the episode's last frame as LeRobot's chunk is)
moves more than the threshold in some dimension, in the dataset's own units (before
normalization, as openpi compares them):

    position (data.filter_idle_actions=position, openpi's joint positions): |a[t+k] - a[t]| > threshold
    velocity (openpi's joint velocities):                                    |a[t+k]| > threshold

Only the training split is filtered; held-out episodes are evaluated whole, so that an eval loss
means the same with the filter and without (with none held out, evaluation reads the training
frames, filtered). The count of dropped frames is on `zerojax train`'s start line (`start_note`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zerojax.errors import ConfigError

@dataclass(frozen=True)
class Idle:
    """What the filter did to the training split."""

    threshold: float  # data.filter_idle (0: off)
    dropped: int  # training frames dropped
    frames: int  # training frames before


def moving(actions_ND: np.ndarray, episode_N: np.ndarray, horizon: int, threshold: float, kind: str) -> np.ndarray:
    """bool [N]: which rows (a dataset's rows, episodes contiguous) keep (module docstring)."""
    n = len(actions_ND)
    last = np.flatnonzero(np.r_[episode_N[1:] != episode_N[:-1], True])  # each episode's last row
    end = last[np.searchsorted(last, np.arange(n))]
    base = actions_ND if kind == "position" else np.zeros_like(actions_ND)
    keep = np.zeros(n, bool)
    for k in range(max(1, horizon // 2)):
        ahead = actions_ND[np.minimum(np.arange(n) + k, end)]
        keep |= (np.abs(ahead - base) > threshold).any(axis=1)
    return keep


def drop_idle(dataset, splits: tuple, horizon: int, threshold: float, kind: str) -> tuple[tuple, Idle]:
    """(the splits with the idle training frames dropped, what was dropped); ConfigError if none is left."""
    train, held = splits
    if threshold <= 0:
        return splits, Idle(0.0, 0, len(train))
    keep = moving(dataset.columns["action"], dataset.episode, horizon, threshold, kind)
    kept = train[keep[np.searchsorted(dataset.index, train)]]
    if not len(kept):
        raise ConfigError(f"data.filter_idle={threshold} drops every one of the {len(train)} training frames of "
                          f"{dataset.root}: no action chunk moves more than that; lower it (openpi's DROID rule: 1e-3)")
    return (kept, kept if held is train else held), Idle(threshold, len(train) - len(kept), len(train))


def start_note(source) -> str:
    """The start line's words on data.filter_idle ('' when off): a source, or the source an
    adapter wraps (`.source`), that holds an `idle` record."""
    while source is not None and not hasattr(source, "idle"):
        source = getattr(source, "source", None)
    idle = getattr(source, "idle", None)
    if idle is None or not idle.threshold:
        return ""
    return (f", data.filter_idle={idle.threshold:g} dropped {idle.dropped} of {idle.frames} training frames "
            f"({idle.dropped / idle.frames:.1%})")
