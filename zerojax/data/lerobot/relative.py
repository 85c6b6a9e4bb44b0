"""Relative actions (model.action.relative): a policy learns each action of its chunk as its offset
from the frame's state, on every joint but those model.action.relative_exclude names, as openpi's
`DeltaActions` and LeRobot 0.6.1's `RelativeActionsProcessorStep` make them, and its sampled
actions get the state back (openpi's `AbsoluteActions`, LeRobot's `AbsoluteActionsProcessorStep`).

The order is openpi's and LeRobot's: the robot's actions minus its state (both in the robot's
units), then normalized; on the way out unnormalized, then the state added. The action's
statistics are those of the relative actions (`stats.Relative`, what `zerojax stats
--relative-actions` writes to meta/stats_relative.json): the file where it was computed for this
chunk length and these exclusions, else the same numbers computed at start from the frames the
source has read. LeRobot 0.6.1's π0 and π0.5 normalize relative actions with the dataset's
absolute statistics (its PR #2970); openpi computes its norm stats after the delta, as here.

A run records what it did in its lerobot.json (`RECORD`: the excluded joints, the action's names
and the mask), which `zerojax serve`, `rollout` and the exports read.
"""

from __future__ import annotations

import numpy as np

from zerojax.data.lerobot import meta, stats
from zerojax.errors import ConfigError
from zerojax.models.family import ACTION, STATE

RECORD = "relative_actions"  # lerobot.json's record of them
FILE = "stats_relative.json"  # what `zerojax stats --relative-actions` writes under meta/


def of_config(cfg, info: dict) -> tuple[stats.Relative, np.ndarray] | None:
    """(the chunks' `Relative`, its mask [D_a]) where model.action.relative is on, checked against
    the dataset (ConfigError naming the key); None where it is off."""
    a = cfg.model.action
    if not a.relative:
        return None
    relative = stats.Relative(horizon=cfg.data.action_horizon, exclude=tuple(a.relative_exclude),
                              flag="model.action.relative_exclude")
    return relative, relative.mask(info)


def to_relative(actions: np.ndarray, state: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """actions [..., H, D] minus state [..., D_s] on the joints of `mask` [D] (openpi's DeltaActions:
    `actions[..., :D] -= where(mask, state[..., :D], 0)`)."""
    return actions - _offset(state, mask, actions.dtype)


def to_absolute(actions: np.ndarray, state: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The inverse: the state added back on the joints of `mask` (openpi's AbsoluteActions)."""
    return actions + _offset(state, mask, actions.dtype)


def _offset(state: np.ndarray, mask: np.ndarray, dtype) -> np.ndarray:
    mask = np.asarray(mask, bool)
    return np.where(mask, state[..., :len(mask)], 0).astype(dtype)[..., None, :]


def statistics(dataset, relative: stats.Relative, info: dict) -> dict:
    """The action's statistics of relative actions: meta/stats_relative.json where it holds this
    chunk length and these exclusions, else computed from the dataset's frames (`dataset`:
    meta.Dataset) as `zerojax stats --relative-actions` computes them."""
    path = dataset.root / "meta" / FILE
    if path.is_file():
        kept = meta.read_json(path, "zerojax stats' relative statistics").get(ACTION, {})
        said = kept.get(stats.RELATIVE, {})
        if said.get("horizon") == relative.horizon and said.get("exclude_joints") == list(relative.exclude):
            numbers = {k: v for k, v in kept.items() if k != stats.RELATIVE}
            meta.check_widths(path, ACTION, {k: v for k, v in numbers.items() if k != "count"}, meta.width(info, ACTION))
            return numbers
    mask, parts = relative.mask(info), []
    for index in sorted(dataset.episodes):
        rows = np.flatnonzero(dataset.episode == index)  # the frames are in index order
        chunks = stats.relative_chunks(dataset.columns[ACTION][rows], dataset.columns[STATE][rows], relative.horizon,
                                       mask)
        parts.append(stats.vector_stats(chunks))
    if not parts:
        raise ConfigError(f"{dataset.root}: no episodes to compute relative-action statistics of")
    return {k: np.asarray(v).tolist() for k, v in stats.aggregate(parts).items()}


def record(relative: stats.Relative, info: dict) -> dict:
    """lerobot.json's RECORD: what serve and the exports need to make the actions absolute again."""
    return {"state": STATE, "exclude_joints": list(relative.exclude), "action_names": stats.action_names(info),
            "mask": relative.mask(info).tolist()}
