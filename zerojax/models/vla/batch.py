"""A policy's batch from a robot dataset's features: the `PolicyAdapter` (`models/family.py`) of
π0 and SmolVLA, which read the state as a vector, and the base π0.5's (`pi05.batch`) builds on.

The features (a LeRobot source's rows, `zerojax.data.lerobot`, keyed by LeRobot's names) become
the dict the policy reads (`pi0.model.BATCH`, batch axis first):

    images        float32 [B, cameras, 3, S, S] in [-1, 1]
    image_masks   bool    [B, cameras]         (a missing camera: False, its image all -1)
    tokens        int32   [B, L]               the prompt: the task and "\\n" (LeRobot's newline processor),
                                               tokenized here with data.tokenizer, padded on the right
    token_mask    bool    [B, L]
    state         float32 [B, max_state_dim]   (normalized, zero-padded)
    actions       float32 [B, H, max_action_dim]
    action_is_pad bool    [B, H]               (steps past the episode's end: no loss)
    noise         float32 [B, H, max_action_dim]
    time          float32 [B]                  t ~ Beta(1.5, 1)·0.999 + 0.001
    delay         int32   [B]                  d ~ U{0..D}, with model.action.train_delay = D > 0 only

The cameras are stacked (a camera the dataset lacks all -1 and masked, as LeRobot's
`prepare_images` fills an empty camera), the state and the action chunk zero-padded to model.action.max_state_dim / max_action_dim, and each row's
noise and time for flow matching. Training (`PolicyRows`) and `zerojax serve` (`observation`)
build the observation here alike.

Flow matching's randomness is data: each row's noise and time are a pure function of (seed,
split, step, row), so that a step's loss is the same on any mesh, any number of processes and any
train.grad_accum (every row draws its own, wherever it is computed): t ~ Beta(1.5, 1)·0.999 +
0.001 and noise ~ N(0, I), as LeRobot's and openpi's π0 sample them. With training-time real-time
chunking (model.action.train_delay = D > 0) each row also draws its delay d, uniform on {0, ..., D}
as LeRobot's π0.5 draws it (`_sample_training_rtc_prefix_mask`, torch.randint(0, D + 1)), from the
same generator after the noise, so that the noise and time are those of D = 0 (`vla.flow`: the
first d actions are given clean and left out of the loss).

The data keys and the model keys must agree (data.action_horizon = model.action.horizon,
data.prompt_len = model.action.prompt_len, data.image_size = model.vision.image_size), and the
dataset must fit the model (its state and action no wider than the padded widths, no more
cameras than model.action.cameras): bad input, named, before anything is written. No jax here.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from zerojax.errors import ConfigError
from zerojax.models.family import ACTION, CAMERA, STATE, TASK, Field, PolicyAdapter

STREAM = 7  # a generator stream of its own, apart from the rows' (data.TRAIN, data.EVAL)


def noise_and_time(seed: int, split: int, step: int, rows: range, horizon: int, action_dim: int,
                   max_delay: int = 0) -> dict:
    """{"noise": float32 [len(rows), horizon, action_dim], "time": float32 [len(rows)]} for those
    rows of the global batch of `step`, and "delay" int32 [len(rows)] where max_delay > 0."""
    noise = np.empty((len(rows), horizon, action_dim), np.float32)
    time = np.empty(len(rows), np.float32)
    delay = np.zeros(len(rows), np.int32)
    for k, row in enumerate(rows):
        rng = np.random.default_rng((seed, STREAM, split, step, row))
        time[k] = rng.beta(1.5, 1.0) * 0.999 + 0.001
        noise[k] = rng.standard_normal((horizon, action_dim), np.float32)
        if max_delay:  # drawn last: the noise and time are D = 0's
            delay[k] = rng.integers(0, max_delay + 1)
    return {"noise": noise, "time": time, **({"delay": delay} if max_delay else {})}


def check(cfg, features: dict) -> None:
    """The data and model keys agree and the dataset fits the model (ConfigError if not)."""
    m, d = cfg.model, cfg.data
    for data_key, model_key, model_value in (("action_horizon", "model.action.horizon", m.action.horizon),
                                             ("prompt_len", "model.action.prompt_len", m.action.prompt_len),
                                             ("image_size", "model.vision.image_size", m.vision.image_size)):
        if getattr(d, data_key) != model_value:
            raise ConfigError(f"data.{data_key}={getattr(d, data_key)} and {model_key}={model_value} disagree; "
                              f"set both to the same value (the model reads what the data yields)")
    cameras = [k for k in features if k.startswith(CAMERA)]
    for key, width, limit in ((STATE, features[STATE].shape[1], m.action.max_state_dim),
                              (ACTION, features[ACTION].shape[2], m.action.max_action_dim)):
        if width > limit:
            which = "max_state_dim" if key == STATE else "max_action_dim"
            raise ConfigError(f"data.source={d.source}: {key} has {width} dimensions, more than "
                              f"model.action.{which}={limit}; raise model.action.{which}")
    real = m.action.action_dim or m.action.max_action_dim  # 0: every padded dimension is the loss's
    if features[ACTION].shape[2] > real:  # the real dimensions past it would leave the loss
        raise ConfigError(f"data.source={d.source}: {ACTION} has {features[ACTION].shape[2]} dimensions, more than "
                          f"model.action.action_dim={real} (the loss's real dimensions); "
                          f"set model.action.action_dim={features[ACTION].shape[2]}")
    if len(cameras) > m.action.cameras:
        raise ConfigError(f"data.source={d.source} has {len(cameras)} cameras ({', '.join(cameras)}), more than "
                          f"model.action.cameras={m.action.cameras}; raise it, or choose data.cameras")


def spec(cfg, features: dict) -> dict:
    """The policy's batch (`pi0.model.BATCH`) for a source of these features."""
    a, B, S = cfg.model.action, cfg.train.global_batch, cfg.model.vision.image_size
    return {"images": Field((B, a.cameras, 3, S, S), "float32"), "image_masks": Field((B, a.cameras), "bool"),
            "tokens": Field((B, a.prompt_len), "int32"), "token_mask": Field((B, a.prompt_len), "bool"),
            "state": Field((B, a.max_state_dim), "float32"),
            "actions": Field((B, a.horizon, a.max_action_dim), "float32"),
            "action_is_pad": features["action_is_pad"],
            "noise": Field((B, a.horizon, a.max_action_dim), "float32"), "time": Field((B,), "float32"),
            **({"delay": Field((B,), "int32")} if a.train_delay else {})}


def widest(cfg) -> dict:
    """The adapter's `widest`: a dataset's features at the model's widths (`spec`'s batch is
    the same for any dataset that fits: it pads to these), as `data.lerobot.spec` names them."""
    a, d, B = cfg.model.action, cfg.data, cfg.train.global_batch
    cameras = {f"{CAMERA}camera{i}": Field((B, 3, d.image_size, d.image_size), "float32") for i in range(a.cameras)}
    return {STATE: Field((B, a.max_state_dim), "float32"), **cameras,
            ACTION: Field((B, d.action_horizon, a.action_dim or a.max_action_dim), "float32"),  # the loss's width
            "action_is_pad": Field((B, d.action_horizon), "bool")}


def pad_last(x: np.ndarray, width: int) -> np.ndarray:
    return np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


class PolicyRows:
    """A source of the dataset's features seen through a policy's batch: the same rows, stacked
    and padded, their observation made by the family's `observe` (its adapter's `observation`)."""

    def __init__(self, source, cfg, batch_spec, observe):
        self.source, self.cfg, self.observe = source, cfg, observe
        self._spec = batch_spec(cfg, source.spec())
        self.cameras = [k for k in source.spec() if k.startswith(CAMERA)]
        self.model = dataclasses.asdict(cfg.model)  # the model section as `observe` reads it (as serve's)
        # the tokenizer the source tokenized the tasks with (None: bytes); a spec-only source has none
        self.tokenizer = getattr(source, "tokenizer", None)

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
        flow = noise_and_time(self.cfg.train.seed, split, step, range(*bounds), a.horizon, a.max_action_dim,
                              a.train_delay)
        return {**self.observe(raw, self.cameras, self.model, self.tokenizer),
                "actions": pad_last(raw[ACTION], a.max_action_dim), "action_is_pad": raw["action_is_pad"], **flow}


def rows_of(batch_spec, observe):
    """The adapter's `rows` of a family's batch (`batch_spec(cfg, features)`) and observation
    (`observe`, the adapter's `observation`): the features' source checked against the model, then wrapped."""
    def rows(source, cfg) -> PolicyRows:
        check(cfg, source.spec())
        return PolicyRows(source, cfg, batch_spec, observe)
    return rows


def tokenize(text: str, length: int, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """`text` tokenized (bytes if no tokenizer), truncated to `length`, padded with 0 on the
    right; its mask."""
    ids = tokenizer.encode(text).ids if tokenizer is not None else list(text.encode("utf-8"))
    ids = ids[:length]
    tokens, mask = np.zeros(length, np.int32), np.zeros(length, bool)
    tokens[:len(ids)], mask[:len(ids)] = ids, True
    return tokens, mask


def prompts(raw: dict, length: int, tokenizer, text_of=lambda task, row: task if task.endswith("\n") else task + "\n"):
    """Each row's prompt tokens and mask from its task's text: `text_of(task, row index)`, by
    default the task and a newline (LeRobot's Pi0NewLineProcessor, π0's and SmolVLA's prompt)."""
    if TASK not in raw:
        raise ValueError(f"the prompt is written from the task's text: the rows carry no {TASK!r} "
                         f"(they carry {', '.join(sorted(raw))}); a LeRobot source gives it")
    rows = [tokenize(text_of(str(task), i), length, tokenizer) for i, task in enumerate(raw[TASK])]
    return {"tokens": np.stack([r[0] for r in rows]), "token_mask": np.stack([r[1] for r in rows])}


def observation_batch(raw: dict, cameras: list[str], slots: int, max_state_dim: int) -> dict:
    """π0's observation less its prompt (images, image_masks, state) from stacked rows of the
    dataset's features (batch first): the cameras stacked into `slots` (an empty slot all -1 and
    masked, as LeRobot's prepare_images fills it), the state zero-padded."""
    n = len(raw[STATE])
    images = np.stack([raw[c] for c in cameras], axis=1)
    if slots > len(cameras):
        images = np.concatenate([images, np.full((n, slots - len(cameras), *images.shape[2:]), -1, np.float32)],
                                axis=1)
    masks = np.broadcast_to(np.arange(slots) < len(cameras), (n, slots)).copy()
    return {"images": images, "image_masks": masks, "state": pad_last(raw[STATE], max_state_dim)}


def observation(raw: dict, cameras: list[str], model: dict, tokenizer=None) -> dict:
    """The adapter's `observation`, in training and for `zerojax serve`: `model` is the run's model
    section as a dict; the prompt, the task and a newline, tokenized with `tokenizer` (the run's
    data.tokenizer; bytes if None) to model.action.prompt_len."""
    a = model["action"]
    return {**observation_batch(raw, cameras, a["cameras"], a["max_state_dim"]),
            **prompts(raw, a["prompt_len"], tokenizer)}


def chunk(model: dict) -> tuple[int, int]:
    """The noise `sample_actions` integrates: [horizon, max_action_dim] a row."""
    return model["action"]["horizon"], model["action"]["max_action_dim"]


ADAPTER = PolicyAdapter(check=check, rows=rows_of(spec, observation), observation=observation, chunk=chunk,
                        widest=widest)
