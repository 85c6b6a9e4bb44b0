"""A LeRobot v3.0 dataset's statistics, computed as LeRobot 0.6.1 computes them (`zerojax stats DIR`):
min, max, mean, std, count, q01, q10, q50, q90 and q99 of every feature but strings, what
meta/stats.json holds and data.norm_*=quantiles reads.

LeRobot's algorithm, kept (lerobot/datasets/compute_stats.py, scripts/augment_dataset_quantile_stats.py):

- each episode alone (`episode_stats`): the numeric columns' every frame, a camera's frames at
  `sample_indices` (100 of an episode up to 500 frames, len**0.75 beyond, at most 10,000), decoded
  to [0, 1] and reduced per channel (stats shaped (3, 1, 1));
- within an episode (`vector_stats`, LeRobot's RunningQuantileStats fed once): the quantiles are
  read off a 5,000-bin histogram spanning [min - 1e-10, max + 1e-10], linearly interpolated within
  the bin holding the q * count-th value, so a quantile is within one bin, (max - min) / 5000, of
  the exact order statistic; std is sqrt(E[x^2] - E[x]^2) in the data's dtype (float32 for float32
  columns, float64 for integers);
- across episodes (`aggregate`, LeRobot's aggregate_feature_stats): min of mins, max of maxes, the
  count-weighted mean, the variance by the parallel algorithm, and each quantile the count-weighted
  mean of the episodes' quantiles (not a quantile of all frames: LeRobot's definition, kept so a
  dataset's numbers do not depend on which tool wrote them).

Relative actions (`zerojax stats --relative-actions`, `Relative`): the action's statistics are those
of the action chunks openpi's `DeltaActions` makes and its `compute_norm_stats` reduces: each frame's
chunk of `horizon` actions (past the episode's last frame, its last action again, as LeRobot's
`delta_timestamps` pad a chunk), minus the frame's state on every joint but the excluded ones, which
keep their absolute values (an excluded joint's statistics are its absolute actions' over the same
chunks). The joints are named by the action's `names` in meta/info.json and excluded as LeRobot's
`RelativeActionsProcessorStep` excludes them (a name, lower-cased, equal to or within the joint's);
each joint is relative to the state's dimension of the same index. They are reduced as any feature is
(LeRobot's per-episode statistics, then its aggregate), so count is frames x horizon; the action's
entry records how (`RELATIVE`). LeRobot 0.6.1's π0 and π0.5 normalize relative actions with the
absolute statistics (its PR #2970); these are the statistics of what the model is trained on.

One pass: the data files are read one at a time, each episode reduced to its statistics as its file
is read; only the per-episode statistics are kept. With several processes (jax.distributed), the
episodes are split into contiguous ranges, each process reads only its range's files, and process 0
aggregates every episode's statistics in episode order, so the result does not depend on the
process count (`gather`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from zerojax.data.lerobot import frames, meta
from zerojax.errors import ConfigError
from zerojax.models.family import ACTION, STATE

QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)  # LeRobot's DEFAULT_QUANTILES
Q_KEYS = tuple(f"q{int(q * 100):02d}" for q in QUANTILES)
BINS = 5000  # RunningQuantileStats' num_quantile_bins
CAMERA_DTYPES = ("image", "video")
ROW_INDEX = " rows"  # a data file's dataset indices [N] (its "index" column, flat), beside its features
RELATIVE = "relative"  # the action entry's record of relative statistics (`Relative.record`)


def _quantile(cumsum: np.ndarray, edges: np.ndarray, target: float) -> float:
    """RunningQuantileStats._compute_single_quantile: the target-th count, interpolated in its bin
    (`cumsum`: the histogram's running counts, float64, computed once for every quantile)."""
    idx = int(np.searchsorted(cumsum, target))
    if idx == 0:
        return edges[0]
    if idx >= len(cumsum):
        return edges[-1]
    before = cumsum[idx - 1]
    inside = cumsum[idx] - before
    if inside == 0:
        return edges[idx]
    return edges[idx] + (target - before) / inside * (edges[idx + 1] - edges[idx])


def vector_stats(x_ND: np.ndarray) -> dict:
    """LeRobot's get_feature_stats of N vectors [N, D] (axis 0): the statistics of one episode."""
    x = x_ND.astype(np.result_type(x_ND.dtype, np.float32), copy=False)
    n = x.shape[0]
    if n < 2:  # LeRobot's _compute_basic_stats: quantiles are the mean
        out = {"min": x.min(0), "max": x.max(0), "mean": x.mean(0), "std": x.std(0), "count": np.array([n])}
        return {**out, **{k: out["mean"].copy() for k in Q_KEYS}}
    lo, hi, mean = x.min(0), x.max(0), np.mean(x, axis=0)
    variance = np.mean(x ** 2, axis=0) - mean ** 2
    out = {"min": lo, "max": hi, "mean": mean, "std": np.sqrt(np.maximum(0, variance)), "count": np.array([n])}
    qs = np.zeros((len(QUANTILES), x.shape[1]))
    for d in range(x.shape[1]):
        edges = np.linspace(lo[d] - 1e-10, hi[d] + 1e-10, BINS + 1)
        cumsum = np.cumsum(np.histogram(x[:, d], bins=edges)[0].astype(np.float64))
        qs[:, d] = [_quantile(cumsum, edges, q * n) for q in QUANTILES]
    return {**out, **dict(zip(Q_KEYS, qs))}


def aggregate(parts: list[dict]) -> dict:
    """LeRobot's aggregate_feature_stats: one feature's statistics over its episodes' `parts`."""
    means = np.stack([p["mean"] for p in parts])
    counts = np.stack([p["count"] for p in parts])
    total = counts.sum(axis=0)
    while counts.ndim < means.ndim:
        counts = np.expand_dims(counts, -1)
    mean = (means * counts).sum(axis=0) / total
    variance = ((np.stack([p["std"] ** 2 for p in parts]) + (means - mean) ** 2) * counts).sum(axis=0) / total
    out = {"min": np.min(np.stack([p["min"] for p in parts]), axis=0),
           "max": np.max(np.stack([p["max"] for p in parts]), axis=0),
           "mean": mean, "std": np.sqrt(variance), "count": total}
    for k in Q_KEYS:
        out[k] = (np.stack([p[k] for p in parts]) * counts).sum(axis=0) / total
    return out


def sample_indices(length: int) -> list[int]:
    """LeRobot's sample_indices: the frames of an episode whose camera statistics are computed."""
    wanted = length if length < 100 else max(100, min(int(length ** 0.75), 10_000))
    return np.round(np.linspace(0, length - 1, wanted)).astype(int).tolist()


def camera_stats(images_NHWC: np.ndarray) -> dict:
    """A camera's statistics of its frames (RGB uint8 [N, H, W, C]) in [0, 1], per channel, shaped
    (C, 1, 1); count is the number of frames (LeRobot's axis (0, 2, 3) reduction)."""
    x = images_NHWC.astype(np.float32) / np.float32(255)
    out = vector_stats(x.reshape(-1, x.shape[-1]))
    out = {k: v.reshape(-1, 1, 1) for k, v in out.items() if k != "count"}
    return {**out, "count": np.array([images_NHWC.shape[0]])}


def _matrix(column) -> np.ndarray:
    """A Parquet column as [N, D] in its own dtype (a list column's vectors, or scalars as D = 1)."""
    import pyarrow as pa

    values = column.combine_chunks()
    if pa.types.is_list(values.type) or pa.types.is_fixed_size_list(values.type):
        return np.asarray(values.flatten()).reshape(len(values), -1)
    return np.asarray(values).reshape(len(values), 1)


def features_of(info: dict) -> tuple[list[str], list[str]]:
    """(numeric features, camera features) of meta/info.json, in its order; strings have no statistics."""
    features = info.get("features", {})
    numeric = [k for k, f in features.items() if f.get("dtype") not in (*CAMERA_DTYPES, "string", "language")]
    return numeric, [k for k, f in features.items() if f.get("dtype") in CAMERA_DTYPES]


def _episode_rows(table, ep) -> np.ndarray:
    rows = np.flatnonzero((table[ROW_INDEX] >= ep.start) & (table[ROW_INDEX] < ep.stop))
    if len(rows) != ep.stop - ep.start:
        raise ConfigError(f"episode {ep.index} spans dataset indices [{ep.start}, {ep.stop}) in meta/episodes, "
                          f"but its data file holds {len(rows)} of its {ep.stop - ep.start} frames")
    return rows


def check_finite(x_ND: np.ndarray, feature: str, episode: int, frames_N: np.ndarray) -> None:
    """ConfigError naming the first NaN or infinity of one episode's `feature` (its frame, the
    row's place in the episode `frames_N`, and dimension): its statistics would be NaN, and a run
    normalizing with them would train on NaN."""
    bad = np.argwhere(~np.isfinite(x_ND)) if x_ND.dtype.kind == "f" else ()
    if len(bad):
        row, dim = (int(i) for i in bad[np.argmin(frames_N[bad[:, 0]])])
        raise ConfigError(f"{feature} holds {x_ND[row, dim]} in episode {episode}, frame {int(frames_N[row])} "
                          f"(dimension {dim}; {len(bad)} non-finite values in the episode); statistics need finite "
                          "numbers: fix or drop the episode")


@dataclass(frozen=True)
class Relative:
    """The action's statistics taken of relative actions (module docstring): `horizon` actions per
    chunk, the joints in `exclude` kept absolute."""

    horizon: int
    exclude: tuple[str, ...] = ()
    flag: str = field(default="--exclude", compare=False)  # what the user set `exclude` with, for the errors

    def named(self, joints) -> str:
        """`joints` as the user would have written them: `--exclude a b`, or `model.action.relative_exclude=a,b`."""
        return f"{self.flag} {' '.join(joints)}" if self.flag.startswith("--") else f"{self.flag}={','.join(joints)}"

    def mask(self, info: dict) -> np.ndarray:
        """[D] True on the joints made relative: LeRobot's RelativeActionsProcessorStep._build_mask
        of the action's names, checked against the dataset (ConfigError before any frame is read)."""
        features = info.get("features", {})
        if ACTION not in features or STATE not in features:
            raise ConfigError(f"relative actions need {ACTION!r} and {STATE!r}; the dataset's features are "
                              f"{', '.join(features)}")
        width, state = (int(np.prod(features[k].get("shape", [1]))) for k in (ACTION, STATE))
        if state < width:
            raise ConfigError(f"relative actions subtract the state from the action joint by joint, but {STATE} "
                              f"has {state} dimensions and {ACTION} {width}")
        names = action_names(info)
        if not self.exclude:
            return np.ones(width, bool)
        if names is None:
            raise ConfigError(f"{self.named(self.exclude)}: the dataset's meta/info.json names no "
                              f"{ACTION} joints (its features.action.names), so none can be excluded by name")
        tokens = [t.lower() for t in self.exclude]
        unmatched = [t for t in self.exclude if not any(t.lower() in n.lower() for n in names)]
        if unmatched:
            raise ConfigError(f"{self.named(unmatched)} names none of the action's joints "
                              f"({', '.join(names)}); a joint is excluded where the name is within its own")
        return np.array([not any(t in n.lower() for t in tokens) for n in names[:width]]
                        + [True] * (width - len(names)))

    def record(self, info: dict) -> dict:
        """What the action's entry in stats.json says of them (`RELATIVE`)."""
        names = action_names(info) or [str(i) for i in range(int(np.prod(info["features"][ACTION]["shape"])))]
        return {"state": STATE, "horizon": self.horizon, "exclude_joints": list(self.exclude),
                "joints": [n for n, m in zip(names, self.mask(info)) if m]}


def action_names(info: dict) -> list[str] | None:
    """The action's joint names in meta/info.json (a list, or v2.x's {"motors": [...]}), or None."""
    names = info.get("features", {}).get(ACTION, {}).get("names")
    if isinstance(names, dict) and len(names) == 1:
        names = next(iter(names.values()))
    return [str(n) for n in names] if isinstance(names, list) else None


def relative_chunks(action_ND: np.ndarray, state_NS: np.ndarray, horizon: int, mask_D: np.ndarray) -> np.ndarray:
    """[N * horizon, D]: each frame's chunk of actions (an index past the episode's end clamped to its
    last frame, as LeRobot's delta_timestamps pad), minus the frame's state where `mask_D`, as openpi's
    DeltaActions computes it (`actions[..., :D] -= where(mask, state[..., :D], 0)`, in the action's dtype).
    The frames in episode order."""
    n, d = action_ND.shape
    chunk_NH = np.minimum(np.arange(n)[:, None] + np.arange(horizon)[None, :], n - 1)
    offset_ND = np.where(mask_D, state_NS[:, :d], 0).astype(action_ND.dtype)
    return (action_ND[chunk_NH] - offset_ND[:, None, :]).reshape(n * horizon, d)


def episode_stats(ep, table: dict, numeric: list[str], cameras: dict, video, relative=None) -> dict:
    """{feature: statistics} of one episode (module docstring). `table`: its data file's columns
    ([N, D] arrays, ROW_INDEX's [N], and a camera's Parquet image cells); `cameras`: camera ->
    its dtype; `relative`: (horizon, mask) where the action's are those of relative actions."""
    rows = _episode_rows(table, ep)
    for k in numeric:
        check_finite(table[k][rows], k, ep.index, table[ROW_INDEX][rows] - ep.start)
    out = {k: vector_stats(table[k][rows]) for k in numeric}
    if relative is not None:
        ordered = rows[np.argsort(table[ROW_INDEX][rows], kind="stable")]
        out[ACTION] = vector_stats(relative_chunks(table[ACTION][ordered], table[STATE][ordered], *relative))
    sampled = rows[sample_indices(len(rows))]
    for camera, dtype in cameras.items():
        where = f"{camera}, episode {ep.index}"
        if dtype == "image":
            images = [frames.decode_image(table[camera][int(r)].as_py(), where) for r in sampled]
        else:
            path, start = ep.videos[camera]
            images = [video.frame(path, start + float(table["timestamp"][r, 0]), where) for r in sampled]
        out[camera] = camera_stats(np.stack(images))
    return out


def process_episodes(episodes: list, process_index: int, process_count: int) -> list:
    """This process's contiguous share of the episodes (in episode order)."""
    if len(episodes) < process_count:
        raise ConfigError(f"the dataset has {len(episodes)} episodes, fewer than the {process_count} processes; "
                          "run with fewer processes")
    n = len(episodes)
    return episodes[process_index * n // process_count:(process_index + 1) * n // process_count]


def compute_local(root: Path, process_index: int = 0, process_count: int = 1,
                  relative: Relative | None = None) -> list[tuple[int, dict]]:
    """[(episode index, {feature: statistics})] of this process's episodes, its data files read once
    each; the action's of relative actions where `relative` says so."""
    info = meta.read_info(root)
    if info.get("codebase_version") != "v3.0":
        raise ConfigError(f"{root}: codebase_version {info.get('codebase_version')!r}; zerojax stats reads "
                          "LeRobot v3.0 datasets (LeRobot 0.4 and later)")
    numeric, cameras = features_of(info)
    chunks = (relative.horizon, relative.mask(info)) if relative else None
    kinds = {c: info["features"][c]["dtype"] for c in cameras}
    episodes, files = meta.read_episodes(root, info, cameras)
    mine = process_episodes(sorted(zip(episodes.values(), files), key=lambda e: e[0].index),
                            process_index, process_count)
    by_file: dict = {}
    for ep, path in mine:
        by_file.setdefault(path, []).append(ep)
    video, out = frames.VideoReader(), []
    columns = [*dict.fromkeys(["index", "timestamp", *numeric]), *(c for c, d in kinds.items() if d == "image")]
    for path, eps in by_file.items():
        table = meta.read_parquet(path, columns, "the dataset's frames")
        cols = {k: _matrix(table.column(k)) for k in dict.fromkeys(["index", "timestamp", *numeric])}
        cols[ROW_INDEX] = cols["index"][:, 0]
        cols.update({c: table.column(c) for c, d in kinds.items() if d == "image"})
        out += [(ep.index, episode_stats(ep, cols, numeric, kinds, video, chunks)) for ep in eps]
    video.close()
    return out


def gather(local: list[tuple[int, dict]], total: int, process_count: int) -> list[dict]:
    """Every episode's statistics on every process, in episode order: each process's list packed
    into float64 rows (bit-cast to uint32, which JAX moves without x64) and all-gathered."""
    if process_count == 1:
        return [s for _, s in local]
    from jax.experimental import multihost_utils

    layout = [(k, s, np.shape(v), np.asarray(v).dtype) for k, stats in sorted(local[0][1].items())
              for s, v in sorted(stats.items())]
    width, rows = 1 + sum(int(np.prod(shape)) for _, _, shape, _ in layout), -(-total // process_count)
    packed = np.full((rows, width), -1.0)
    for i, (index, stats) in enumerate(local):
        packed[i] = [index, *np.concatenate([np.ravel(stats[k][s]).astype(np.float64) for k, s, _, _ in layout])]
    everyone = np.asarray(multihost_utils.process_allgather(packed.view(np.uint32))).view(np.float64)
    found = sorted((row for row in everyone.reshape(-1, width) if row[0] >= 0), key=lambda row: row[0])
    out = []
    for row in found:
        stats, at = {}, 1
        for k, s, shape, dtype in layout:  # each in its own dtype again: exact, as one process has it
            size = int(np.prod(shape))
            stats.setdefault(k, {})[s] = row[at:at + size].reshape(shape).astype(dtype)
            at += size
        out.append(stats)
    return out


def compute(root, process_index: int = 0, process_count: int = 1, relative: Relative | None = None) -> dict:
    """The dataset's {feature: {statistic: array}} (module docstring), its features in meta/info.json's
    order; with `relative`, the action's of relative actions, its entry saying so (`RELATIVE`)."""
    root = Path(root)
    local = compute_local(root, process_index, process_count, relative)
    info = meta.read_json(root / "meta" / "info.json", "a LeRobot dataset's info.json")
    per_episode = gather(local, len(meta.read_episodes(root, info, [])[0]), process_count)
    numeric, cameras = features_of(info)
    out = {k: aggregate([ep[k] for ep in per_episode]) for k in (*numeric, *cameras)}
    if relative:
        out[ACTION][RELATIVE] = relative.record(info)
    return out


def to_json(stats: dict) -> str:
    """stats.json's text: each feature's statistics in LeRobot's order, and a relative action's record."""
    order = ("min", "max", "mean", "std", "count", *Q_KEYS)

    def entry(feature: dict) -> dict:
        out = {s: np.asarray(feature[s]).tolist() for s in order}
        return {**out, RELATIVE: feature[RELATIVE]} if RELATIVE in feature else out

    return json.dumps({k: entry(v) for k, v in stats.items()}, indent=4) + "\n"


def write(stats: dict, path: Path) -> None:
    """stats.json at `path`, atomically: written beside it and renamed (a reader never sees half)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(to_json(stats))
    os.replace(tmp, path)
