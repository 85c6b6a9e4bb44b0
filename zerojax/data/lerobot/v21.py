"""The tables of a LeRobot v2.1 dataset (as LeRobot 0.3 writes it), in the shape
`meta.Tables` gives v3.0's: meta/episodes.jsonl, meta/tasks.jsonl and
meta/episodes_stats.jsonl, read as LeRobot 0.3.3's `LeRobotDatasetMetadata.load_metadata` does.

Layout (LeRobot 0.3.3, `lerobot.datasets.utils`): one Parquet file per episode and one MP4 per
episode and camera, at `info["data_path"]` / `info["video_path"]` filled with the episode's
`episode_index` and `episode_chunk` (episode_index // info["chunks_size"]); each video starts at
0 s. Episodes follow one another in episode_index order, an episode's rows being the dataset
indices [the previous episodes' lengths summed, + its length) (`get_episode_data_index`).
The statistics are the episodes' combined by `aggregate_stats` (a count-weighted mean, the
variance by the parallel algorithm, min of mins, max of maxes; LeRobot 0.3 has no quantiles):
LeRobot 0.3 reads no meta/stats.json for v2.1, and neither does zerojax.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from zerojax.data.lerobot import meta
from zerojax.errors import ConfigError

AGGREGATED = ("min", "max", "mean", "std", "count")  # what aggregate_feature_stats reads of each episode


def read_jsonl(path: Path, what: str) -> list[dict]:
    if not path.is_file():
        raise ConfigError(f"{path}: no such file ({what})")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path}: line {n} is not valid JSON ({err}); is this {what}?") from None
    return rows


def read_episodes(root: Path, info: dict, cameras: list[str]) -> tuple[dict, list[Path]]:
    """Each episode's dataset indices and videos (module docstring), and its Parquet file."""
    path = root / "meta" / "episodes.jsonl"
    rows = sorted(read_jsonl(path, "the dataset's episodes"), key=lambda row: row.get("episode_index", -1))
    videos = [c for c in cameras if info["features"][c]["dtype"] == "video"]
    episodes, data_files, start = {}, [], 0
    for row in rows:
        if not isinstance(row.get("episode_index"), int) or not isinstance(row.get("length"), int):
            raise ConfigError(f"{path}: an episode without an integer episode_index and length: {row}")
        index, chunk = row["episode_index"], row["episode_index"] // int(info["chunks_size"])
        ep = meta.Episode(index, start, start + row["length"])
        for c in videos:
            mp4 = info["video_path"].format(episode_chunk=chunk, video_key=c, episode_index=index)
            ep.videos[c] = (str(root / mp4), 0.0)
        episodes[index], start = ep, ep.stop
        data_files.append(root / info["data_path"].format(episode_chunk=chunk, episode_index=index))
    if not episodes:
        raise ConfigError(f"{path}: no episodes")
    return episodes, data_files


def read_tasks(root: Path) -> dict:
    path = root / "meta" / "tasks.jsonl"
    rows = read_jsonl(path, "the dataset's tasks")
    bad = [row for row in rows if not isinstance(row.get("task_index"), int) or not isinstance(row.get("task"), str)]
    if bad:
        raise ConfigError(f"{path}: a task without an integer task_index and a task text: {bad[0]}")
    return {row["task_index"]: row["task"] for row in rows}


def aggregate(per_episode: list[dict]) -> dict:
    """One feature's statistics over the episodes, as LeRobot 0.3.3's `aggregate_feature_stats`
    computes them (float64, in its order of operations)."""
    means = np.stack([np.asarray(s["mean"], np.float64) for s in per_episode])
    variances = np.stack([np.asarray(s["std"], np.float64) ** 2 for s in per_episode])
    counts = np.stack([np.asarray(s["count"]) for s in per_episode])
    total_count = counts.sum(axis=0)
    counts = counts.reshape(counts.shape + (1,) * (means.ndim - counts.ndim))
    total_mean = (means * counts).sum(axis=0) / total_count
    total_variance = ((variances + (means - total_mean) ** 2) * counts).sum(axis=0) / total_count
    return {"min": np.min(np.stack([s["min"] for s in per_episode]), axis=0).tolist(),
            "max": np.max(np.stack([s["max"] for s in per_episode]), axis=0).tolist(),
            "mean": total_mean.tolist(), "std": np.sqrt(total_variance).tolist(), "count": total_count.tolist()}


def read_stats(root: Path) -> dict:
    """feature -> its statistics over the dataset, aggregated from meta/episodes_stats.jsonl."""
    path = root / "meta" / "episodes_stats.jsonl"
    by_feature = {}
    for row in read_jsonl(path, "the dataset's per-episode statistics"):
        for key, stats in row.get("stats", {}).items():
            missing = [n for n in AGGREGATED if n not in stats]
            if missing:
                raise ConfigError(f"{path}: episode {row.get('episode_index')}'s {key!r} has no {'/'.join(missing)} "
                                  f"(LeRobot's aggregate_stats combines {', '.join(AGGREGATED)})")
            by_feature.setdefault(key, []).append(stats)
    return {key: aggregate(stats) for key, stats in by_feature.items()}


def read_tables(root: Path, info: dict, cameras: list[str]) -> meta.Tables:
    """The v2.1 dataset's metadata (module docstring)."""
    episodes, data_files = read_episodes(root, info, cameras)
    stats = read_stats(root) if (root / "meta" / "episodes_stats.jsonl").is_file() else None
    return meta.Tables(episodes, data_files, read_tasks(root), stats,
                       {"episodes": "meta/episodes.jsonl", "tasks": "meta/tasks.jsonl", "stats": "meta/episodes_stats.jsonl"})
