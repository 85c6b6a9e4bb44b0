"""LeRobot datasets as a data source: `data.source=lerobot:DIR` (codebase v3.0, as LeRobot 0.4
writes it, and v2.1, as LeRobot 0.3 does), read with pyarrow, PyAV and Pillow; no torch.

The batch of the dataset's features (B = train.global_batch, H = data.action_horizon,
S = data.image_size, D_s and D_a the state's and the action's widths):

    observation.state         float32 [B, D_s]      the frame's state, normalized (data.norm_state)
    observation.images.<cam>  float32 [B, 3, S, S]  the frame's camera image in [-1, 1], resized
                                                    with padding (-1) to S x S; one per camera
                                                    (data.cameras, default all)
    action                    float32 [B, H, D_a]   the frame's action and the next H-1 (delta
                                                    timestamps 0, 1/fps, ...), normalized (data.norm_action)
    action_is_pad             bool    [B, H]        True where the chunk runs past the episode's
                                                    end; those steps repeat its last action
    task                      str     [B]           the frame's task (meta/tasks.parquet or .jsonl), as text:
                                                    the family's adapter writes its prompt from it and
                                                    tokenizes it with data.tokenizer (the source's
                                                    `tokenizer`; bytes if none)

Each row is one frame, as LeRobot's `LeRobotDataset.__getitem__` gives it with
`delta_timestamps={"action": [0, 1/fps, ..., (H-1)/fps]}` (the boundary row repeated, flagged in
`action_is_pad`), normalized as LeRobot's `NormalizerProcessorStep` does (eps 1e-8), its
images mapped to [-1, 1] and then resized with a -1 pad (openpi's `resize_with_pad`, in openpi's
order; LeRobot 0.4 resizes the [0, 1] pixels with a -1 pad first and maps them after, leaving -3
in the pad). tests/test_lerobot.py checks these against LeRobot's own output. A policy family reads
these features through its adapter (`family.PolicyAdapter`, applied by `data.sources`).

Frames: for step s the rows are frames drawn uniformly from the split's episodes by a generator
seeded with (train.seed, split, s), so the batch is a pure function of (seed, split, s); each
process decodes only its rows. The last int(episodes * data.val_fraction) episodes are held
out for evaluation (none held out: evaluation reads the training episodes). Decoding runs one
step ahead in a background thread, rows in parallel (`Prefetch`); the result does not depend
on the timing.

A run writes lerobot.json beside its checkpoints (`run_files`): the features, the normalization
modes and statistics (`unnormalize` maps a policy's actions back), the chunk and prompt lengths.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zerojax.config.normalization import NormalizationMode
from zerojax.data import corpus as corpus_lib
from zerojax.data import idle
from zerojax.data.lerobot import frames, meta, relative, v21
from zerojax.errors import ConfigError
from zerojax.models import registry
from zerojax.models.family import ACTION, CAMERA, STATE, TASK, Field

# codebase version (meta.CODEBASE_VERSIONS, which read_info accepts) -> its metadata's reader
VERSIONS = dict(zip(meta.CODEBASE_VERSIONS, (v21.read_tables, meta.read_tables)))
# (LeRobot 0.3 writes v2.1, LeRobot 0.4 v3.0; the frames' Parquet columns are the same)
# NormalizerProcessorStep's default eps, used as LeRobot (0.4 to 0.6.1) uses it: mean_std divides by std + eps;
# min_max, quantiles (q01/q99) and quantile10 (q10/q90) put eps in place of a denominator that is exactly 0
# and add nothing elsewhere. openpi adds 1e-6 to q99 - q01 always (a relative 1e-6 / (q99 - q01) apart);
# zerojax follows LeRobot, whose processor files and stats.json it reads and writes (tests/test_quantiles.py).
EPS = 1e-8


def root_of(cfg) -> Path:
    return Path(cfg.data.source[len("lerobot:"):])




def cameras_of(cfg, info: dict) -> list[str]:
    """The camera features the batch holds, every feature it needs checked present."""
    features = info.get("features", {})
    listed = ", ".join(features)
    all_cameras = [k for k, f in features.items() if k.startswith(CAMERA) and f.get("dtype") in ("video", "image")]
    wanted = [c if c.startswith(CAMERA) else CAMERA + c for c in cfg.data.cameras] or all_cameras
    for key in (STATE, ACTION, *wanted):
        if key not in features:
            raise ConfigError(f"{root_of(cfg) / 'meta' / 'info.json'}: the dataset has no feature {key!r}, which "
                              f"data.source=lerobot needs{' (data.cameras)' if key.startswith(CAMERA) else ''}; "
                              f"its features: {listed}")
        if key.startswith(CAMERA) and key not in all_cameras:
            raise ConfigError(f"data.cameras: {key!r} is a {features[key].get('dtype')} feature, not a camera "
                              f"(video or image); the dataset's cameras: {', '.join(all_cameras) or 'none'}")
    return wanted


def spec(cfg) -> dict:
    """The batch of the dataset's own features (module docstring), from meta/info.json alone."""
    info = meta.read_info(root_of(cfg))
    features = info["features"]
    d, B = cfg.data, cfg.train.global_batch
    width = lambda key: int(np.prod(features[key]["shape"]))  # noqa: E731
    out = {STATE: Field((B, width(STATE)), "float32")}
    for camera in cameras_of(cfg, info):
        out[camera] = Field((B, 3, d.image_size, d.image_size), "float32")
    out[ACTION] = Field((B, d.action_horizon, width(ACTION)), "float32")
    out["action_is_pad"] = Field((B, d.action_horizon), "bool")
    return out


def open(cfg) -> "LeRobotSource":  # noqa: A001 - the kind module's protocol name
    root = root_of(cfg)
    info = meta.read_info(root)
    cameras = cameras_of(cfg, info)
    d = cfg.data
    norms = {STATE: d.norm_state, ACTION: d.norm_action}
    chunks = relative.of_config(cfg, info)  # model.action.relative: checked before any frame is read
    dataset = meta.load(root, info, cameras, norms, VERSIONS[info["codebase_version"]])
    if chunks:  # the action's statistics are those of what the model learns: the relative actions
        dataset.stats = {**dataset.stats, ACTION: relative.statistics(dataset, chunks[0], info)}
    check_normalized_range(dataset, norms, relative_actions=chunks is not None)
    tokenizer = corpus_lib.load_tokenizer(d.tokenizer) if d.tokenizer else None
    source = LeRobotSource(dataset, spec(cfg), cameras, norms, tokenizer, d.prompt_len, cfg.train.seed,
                           d.val_fraction, info, pad_before=registry.pads_before(cfg.model.family), relative=chunks)
    source.split_frames, source.idle = idle.drop_idle(dataset, source.split_frames, d.action_horizon, d.filter_idle,
                                                      d.filter_idle_actions)  # data.filter_idle (data/idle.py)
    return source


NORMALIZED_LIMIT = 1e3  # a quantile-normalized value this far outside [-1, 1] is a collapsed range, not an outlier


def check_normalized_range(dataset, norms: dict, relative_actions: bool = False) -> None:
    """Refuse quantile statistics that would blow the data up (ConfigError). LeRobot's quantiles
    are the episodes' own, averaged: a feature constant within each episode but not across them (a
    goal, a gripper command per task) gets q01 = q99, and eps (1e-8) for a denominator; normalized,
    its frames reach 1e7 and more, and the run trains, finite, on nothing. LeRobot does the same.
    With `relative_actions` the action's ends are its relative statistics' min and max."""
    quantiles = (NormalizationMode.QUANTILES, NormalizationMode.QUANTILE10)
    for key, mode in norms.items():
        if NormalizationMode.of_config(mode) not in quantiles or key not in dataset.columns:
            continue
        x = dataset.columns[key]
        lo, hi = (np.asarray(dataset.stats[key][s], np.float32) for s in ("min", "max")) \
            if key == ACTION and relative_actions else (x.min(0), x.max(0))
        ends = normalize(np.stack([lo, hi]).astype(np.float32), dataset.stats[key], mode)
        worst = int(np.argmax(np.abs(ends).max(0)))
        if np.abs(ends[:, worst]).max() > NORMALIZED_LIMIT:
            low, high = NormalizationMode.of_config(mode).stats
            setting = f"data.norm_{'state' if key == STATE else 'action'}"
            raise ConfigError(
                f"{dataset.root / 'meta' / 'stats.json'}: {key}[{worst}] spans [{lo[worst]:.4g}, "
                f"{hi[worst]:.4g}] but its {low} and {high} are {dataset.stats[key][low][worst]:.4g} and "
                f"{dataset.stats[key][high][worst]:.4g}: {setting}={mode} would map it to "
                f"[{ends[0, worst]:.3g}, {ends[1, worst]:.3g}] (LeRobot's per-episode quantiles collapse on a "
                f"feature constant within each episode); set {setting}=mean_std or min_max")


def normalize(x: np.ndarray, stats: dict, mode: str) -> np.ndarray:
    """NormalizerProcessorStep's formulas, in float32 as it computes them (mode: data.norm_*; the
    quantile modes map [q01, q99] or [q10, q90] to [-1, 1], unclipped; eps as EPS says)."""
    mode = NormalizationMode.of_config(mode)
    if mode is NormalizationMode.IDENTITY:
        return x
    lo, hi = (np.asarray(stats[k], np.float32) for k in mode.stats)
    if mode is NormalizationMode.MEAN_STD:
        return (x - lo) / (hi + np.float32(EPS))
    denom = hi - lo
    denom = np.where(denom == 0, np.float32(EPS), denom)
    return np.float32(2) * (x - lo) / denom - np.float32(1)


def unnormalize(x: np.ndarray, stats: dict, mode: str) -> np.ndarray:
    """The inverse (UnnormalizerProcessorStep's formulas, float32): a policy's actions back in
    the robot's units."""
    mode = NormalizationMode.of_config(mode)
    if mode is NormalizationMode.IDENTITY:
        return x
    lo, hi = (np.asarray(stats[k], np.float32) for k in mode.stats)
    if mode is NormalizationMode.MEAN_STD:
        return x * hi + lo
    denom = hi - lo
    denom = np.where(denom == 0, np.float32(EPS), denom)
    if mode is NormalizationMode.MIN_MAX:
        return (x + np.float32(1)) / np.float32(2) * denom + lo
    return (x + np.float32(1)) * denom / np.float32(2) + lo


def observation(raw: dict, cameras: list[str], state_stats: dict, norm_state: str, size: int,
                pad_before: bool = False) -> dict:
    """One frame's observation as the batch holds it (module docstring): from `raw`, the state
    float32 [D_s] in the robot's units, each camera float32 [3, h, w] in [0, 1] and the task's
    text, the state normalized, each camera mapped to [-1, 1] and resized with padding, the task
    tokenized. Training (`LeRobotSource.item`) and `zerojax serve` both build it here, so what a
    served policy reads cannot drift from what it was trained on (`pad_before`: the top-left
    padding of SmolVLA and of LeRobot 0.3.x's π0, `frames.resize_with_pad`)."""
    out = {STATE: normalize(raw[STATE], state_stats, norm_state)}
    for camera in cameras:
        out[camera] = frames.resize_with_pad(raw[camera] * np.float32(2) - np.float32(1), size, pad_before)
    out[TASK] = np.asarray(raw[TASK])  # the text: the family's adapter writes its prompt from it
    return out


class LeRobotSource:
    """The source (module docstring): `item(index)` is one frame's row, `rows` a step's."""

    def __init__(self, dataset, spec, cameras, norms, tokenizer, prompt_len: int, seed: int, val_fraction: float,
                 info: dict, pad_before: bool = False, relative=None):
        self.dataset, self._spec, self.cameras, self.norms, self.info = dataset, spec, cameras, norms, info
        self.pad_before = pad_before
        self.relative = relative  # (stats.Relative, mask [D_a]): model.action.relative's chunks, or None
        self.tokenizer, self.seed = tokenizer, seed
        self.horizon = spec[ACTION].shape[1]
        self.prompt_len = prompt_len  # data.prompt_len, for lerobot.json
        self.size = spec[cameras[0]].shape[-1] if cameras else 0
        self.split_frames = dataset.split_frames(val_fraction)
        self.video = frames.VideoReader()
        # twice the cores: a row holds the GIL part of its time (Python, small numpy ops); on 2 cores
        # 4 threads built 113-131 samples/s, 2 threads 76-103 (224x224, two cameras, H=50)
        self.prefetch = Prefetch(self._build, workers=min(16, 2 * (os.cpu_count() or 1)))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size() if self.tokenizer is not None else 256

    def spec(self) -> dict:
        return self._spec

    def run_files(self) -> dict:
        """lerobot.json for the run directory, beside its checkpoints: what a policy trained on this
        data needs to be served (the observation's features, the normalization's modes and
        statistics, to unnormalize its actions with `unnormalize`, the chunk and prompt lengths)."""
        features = {k: self.info["features"][k] for k in (STATE, *self.cameras, ACTION)}
        # the relative actions' statistics all kept: no file of the dataset holds them (an export completes
        # the absolute ones from meta/stats.json)
        stats = self.dataset.stats
        kept = {k: stats[k] if k == ACTION and self.relative else
                {s: stats[k][s] for s in NormalizationMode.of_config(m).stats} for k, m in self.norms.items()}
        doc = {"dataset": str(self.dataset.root), "fps": self.dataset.fps, "features": features,
               "normalization": {k: {"mode": m, **kept[k]} for k, m in self.norms.items()},
               "action_horizon": self.horizon, "image_size": self.size, "prompt_len": self.prompt_len,
               **({relative.RECORD: relative.record(self.relative[0], self.info)} if self.relative else {})}
        return {"lerobot.json": json.dumps(doc, indent=1) + "\n"}

    def frames_of(self, split: int, step: int) -> np.ndarray:
        """The dataset indices of every row of the step's global batch."""
        pool = self.split_frames[split]
        rng = np.random.default_rng((self.seed, split, step))
        return pool[rng.integers(0, len(pool), size=self._spec[ACTION].shape[0])]

    def rows(self, split: int, step: int, rows: slice) -> dict:
        return self.prefetch.get((split, step, rows.start, rows.stop))

    def _build(self, key, pool) -> dict:
        split, step, start, stop = key
        indices = self.frames_of(split, step)[slice(start, stop)]
        items = list(pool.map(self.item, indices))
        return {k: np.stack([it[k] for it in items]) for k in (*self._spec, TASK)}

    def raw_item(self, index: int) -> dict:
        """Frame `index` as LeRobot's __getitem__ gives it (before normalization, resizing and
        tokenization): state, the action chunk, action_is_pad, images in [0, 1], the task."""
        ds = self.dataset
        item = ds.numbers(index, self.horizon)
        for camera in self.cameras:
            item[camera] = frames.to_unit_float(ds.image(camera, index, self.video))
        return item

    def item(self, index: int) -> dict:
        raw, stats = self.raw_item(index), self.dataset.stats
        out = observation(raw, self.cameras, stats.get(STATE, {}), self.norms[STATE], self.size, self.pad_before)
        actions = raw[ACTION] if self.relative is None else relative.to_relative(raw[ACTION], raw[STATE],
                                                                                 self.relative[1])
        out[ACTION] = normalize(actions, stats.get(ACTION, {}), self.norms[ACTION])
        out["action_is_pad"] = raw["action_is_pad"]
        return out


@dataclass
class Prefetch:
    """Step batches built ahead: asking for (split, step, rows) returns it (built now, or taken
    from the background thread) and starts building (split, step + 1, rows). Each batch is a
    pure function of its key, so what comes back never depends on the timing."""

    build: object  # (key, row pool) -> batch
    workers: int

    def __post_init__(self):
        self.rows_pool = ThreadPoolExecutor(self.workers, thread_name_prefix="zerojax-lerobot-rows")
        self.ahead = ThreadPoolExecutor(1, thread_name_prefix="zerojax-lerobot-ahead")
        self.pending = {}

    def get(self, key):
        future = self.pending.pop(key, None)
        batch = future.result() if future is not None else self.build(key, self.rows_pool)
        split, step, start, stop = key
        for stale in [k for k in self.pending if k[0] == split]:  # guessed wrong (a resume): dropped
            self.pending.pop(stale).cancel()
        following = (split, step + 1, start, stop)
        self.pending[following] = self.ahead.submit(self.build, following, self.rows_pool)
        return batch
