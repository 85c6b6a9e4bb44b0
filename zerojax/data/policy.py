"""A LeRobot source's rows as the batch a policy family reads (`model.family=pi0`).

LeRobot's rows (`data/lerobot.py`) name the dataset's features; π0 reads one dict
(`zerojax.models.pi0`): the cameras stacked ([B, cameras, 3, S, S], a camera the dataset lacks
all -1 and masked, as LeRobot's `prepare_images` fills an empty camera), the state and the
action chunk zero-padded to model.action.max_state_dim / max_action_dim, and each row's noise
and time for flow matching (`data/flow.py`, from (seed, split, step, row)).

The data keys and the model keys must agree (data.action_horizon = model.action.horizon,
data.prompt_len = model.action.prompt_len, data.image_size = model.vision.image_size), and the
dataset must fit the model (its state and action no wider than the padded widths, no more
cameras than model.action.cameras): bad input, named, before anything is written.
"""

from __future__ import annotations

import numpy as np

from zerojax.data import flow
from zerojax.data.lerobot import ACTION, STATE
from zerojax.data.sources import Field
from zerojax.errors import ConfigError



def check(cfg, lerobot_spec: dict) -> None:
    """The data and model keys agree and the dataset fits the model (ConfigError if not)."""
    m, d = cfg.model, cfg.data
    for data_key, model_key, model_value in (("action_horizon", "model.action.horizon", m.action.horizon),
                                             ("prompt_len", "model.action.prompt_len", m.action.prompt_len),
                                             ("image_size", "model.vision.image_size", m.vision.image_size)):
        if getattr(d, data_key) != model_value:
            raise ConfigError(f"data.{data_key}={getattr(d, data_key)} and {model_key}={model_value} disagree; "
                              f"set both to the same value (the model reads what the data yields)")
    cameras = [k for k in lerobot_spec if k.startswith("observation.images.")]
    for key, width, limit in ((STATE, lerobot_spec[STATE].shape[1], m.action.max_state_dim),
                              (ACTION, lerobot_spec[ACTION].shape[2], m.action.max_action_dim)):
        if width > limit:
            which = "max_state_dim" if key == STATE else "max_action_dim"
            raise ConfigError(f"data.source={d.source}: {key} has {width} dimensions, more than "
                              f"model.action.{which}={limit}; raise model.action.{which}")
    if len(cameras) > m.action.cameras:
        raise ConfigError(f"data.source={d.source} has {len(cameras)} cameras ({', '.join(cameras)}), more than "
                          f"model.action.cameras={m.action.cameras}; raise it, or choose data.cameras")


def spec(cfg, lerobot_spec: dict) -> dict:
    """π0's batch (`zerojax.models.pi0.BATCH`) for a LeRobot source of this spec."""
    a, B, S = cfg.model.action, cfg.train.global_batch, cfg.model.vision.image_size
    return {"images": Field((B, a.cameras, 3, S, S), "float32"), "image_masks": Field((B, a.cameras), "bool"),
            "tokens": lerobot_spec["tokens"], "token_mask": lerobot_spec["token_mask"],
            "state": Field((B, a.max_state_dim), "float32"),
            "actions": Field((B, a.horizon, a.max_action_dim), "float32"),
            "action_is_pad": lerobot_spec["action_is_pad"],
            "noise": Field((B, a.horizon, a.max_action_dim), "float32"), "time": Field((B,), "float32")}


def pad_last(x: np.ndarray, width: int) -> np.ndarray:
    return np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


class PolicyRows:
    """A LeRobot source seen through π0's batch: the same rows, stacked and padded."""

    def __init__(self, source, cfg):
        self.source, self.cfg = source, cfg
        self._spec = spec(cfg, source.spec())
        self.cameras = [k for k in source.spec() if k.startswith("observation.images.")]

    @property
    def vocab_size(self) -> int:
        return self.source.vocab_size

    def spec(self) -> dict:
        return self._spec

    def run_files(self) -> dict:
        return self.source.run_files()

    def rows(self, split: int, step: int, rows: slice) -> dict:
        raw, a = self.source.rows(split, step, rows), self.cfg.model.action
        bounds = rows.indices(self._spec["time"].shape[0])
        noise, time = flow.noise_and_time(self.cfg.train.seed, split, step, range(*bounds), a.horizon,
                                          a.max_action_dim)
        return {**observation_batch(raw, self.cameras, a.cameras, a.max_state_dim),
                "actions": pad_last(raw[ACTION], a.max_action_dim), "action_is_pad": raw["action_is_pad"],
                "noise": noise, "time": time}


def observation_batch(raw: dict, cameras: list[str], slots: int, max_state_dim: int) -> dict:
    """π0's observation (images, image_masks, tokens, token_mask, state) from stacked rows of the
    dataset's (`lerobot.observation`, batch first): the cameras stacked into `slots` (an empty
    slot all -1 and masked, as LeRobot's prepare_images fills it), the state zero-padded.
    Training (`PolicyRows.rows`) and `zerojax serve` both build it here."""
    n = len(raw["tokens"])
    images = np.stack([raw[c] for c in cameras], axis=1)
    if slots > len(cameras):
        images = np.concatenate([images, np.full((n, slots - len(cameras), *images.shape[2:]), -1, np.float32)],
                                axis=1)
    masks = np.broadcast_to(np.arange(slots) < len(cameras), (n, slots)).copy()
    return {"images": images, "image_masks": masks, "tokens": raw["tokens"], "token_mask": raw["token_mask"],
            "state": pad_last(raw[STATE], max_state_dim)}
