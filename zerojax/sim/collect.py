"""`zerojax collect`: Meta-World's scripted experts' episodes as a LeRobot v3.0 dataset, written
with pyarrow and PyAV (no torch, no LeRobot), laid out as LeRobot 0.4's
`LeRobotDataset.save_episode` lays it out:

    meta/info.json                   codebase v3.0, the features, fps 80, the path templates
    meta/stats.json                  the features' statistics, aggregated over the episodes as
                                     LeRobot's aggregate_stats does
    meta/tasks.parquet               one instruction a task (LeRobot's), task_index by its order
    meta/episodes/chunk-000/file-000.parquet  each episode's rows, video span and statistics
    data/chunk-000/file-000.parquet  observation.state [39], action [4], timestamp, frame_index,
                                     episode_index, index, task_index
    videos/observation.images.corner2/chunk-000/file-000.mp4  the camera, every episode in turn
                                     (--camera CAMERA: observation.images.CAMERA)

The observation and the camera are zerojax.sim.metaworld's (the goal observable, corner2 at S x
S); frame t is the observation before action t. Only the expert's successful episodes are
kept: task k's episodes are tried from seed `--seed + 10000 k` upwards until `--episodes` have
succeeded (each episode ends at its first success). Statistics: per episode as LeRobot's
compute_episode_stats (images per channel in [0, 1], over every frame rather than a sample;
quantiles exact, where LeRobot estimates them from a histogram), aggregated as LeRobot does.

    zerojax collect --tasks reach-v3,drawer-close-v3 --episodes 20 --out /tmp/mw [--size 64] [--seed 0] [--camera corner2]

(MuJoCo renders through OSMesa unless MUJOCO_GL names another backend: `sim.require`.)
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np

from zerojax.errors import ConfigError
from zerojax.sim import metaworld, video

QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)  # LeRobot's DEFAULT_QUANTILES
TASK_SEED_STRIDE = 10000
DATA = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEOS = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"


def episode(env: metaworld.Env, seed: int) -> dict | None:
    """The expert's episode from reset(seed): states, actions, frames; None where it fails."""
    obs = env.reset(seed)
    states, actions, frames = [], [], []
    for _ in range(env.max_steps):
        states.append(obs[metaworld.STATE_KEY])
        frames.append(env.image())
        actions.append(np.clip(env.expert_action(), -1.0, 1.0))
        obs, success = env.step(actions[-1])
        if success:
            return {"state": np.stack(states), "action": np.stack(actions).astype(np.float32),
                    "image": np.stack(frames), "seed": seed}
    return None


def feature_stats(x: np.ndarray, image: bool) -> dict:
    """LeRobot's get_feature_stats: vectors per dimension; images [T, h, w, 3] per channel in
    [0, 1] with shape [3, 1, 1]."""
    if image:
        flat = x.reshape(-1, 3).astype(np.float64) / 255.0
        shape = (3, 1, 1)
    else:
        flat = x.astype(np.float64)
        shape = (x.shape[1],)
    stats = {"min": flat.min(0), "max": flat.max(0), "mean": flat.mean(0), "std": flat.std(0)}
    stats.update({f"q{int(q * 100):02d}": np.quantile(flat, q, axis=0) for q in QUANTILES})
    out = {k: v.reshape(shape) for k, v in stats.items()}
    out["count"] = np.array([len(x)])
    return out


def aggregate(stats: list[dict]) -> dict:
    """LeRobot's aggregate_feature_stats: count-weighted means, the parallel variance, the
    extremes, count-weighted quantiles."""
    counts = np.stack([s["count"] for s in stats]).astype(np.float64)
    means = np.stack([s["mean"] for s in stats])
    while counts.ndim < means.ndim:
        counts = counts[..., None]
    total = counts.sum(0)
    mean = (means * counts).sum(0) / total
    var = ((np.stack([s["std"] for s in stats]) ** 2 + (means - mean) ** 2) * counts).sum(0) / total
    out = {"min": np.min([s["min"] for s in stats], 0), "max": np.max([s["max"] for s in stats], 0),
           "mean": mean, "std": np.sqrt(var), "count": np.array([int(sum(s["count"][0] for s in stats))])}
    for q in QUANTILES:
        key = f"q{int(q * 100):02d}"
        out[key] = (np.stack([s[key] for s in stats]) * counts).sum(0) / total
    return out


def features(size: int, video_info: dict, camera: str = metaworld.CAMERA) -> dict:
    scalar = lambda dtype: {"dtype": dtype, "shape": [1], "names": None}  # noqa: E731
    return {
        metaworld.STATE_KEY: {"dtype": "float32", "shape": [39], "names": [f"obs_{i}" for i in range(39)]},
        "action": {"dtype": "float32", "shape": [4], "names": ["dx", "dy", "dz", "gripper"]},
        metaworld.image_key(camera): {"dtype": "video", "shape": [size, size, 3],
                                      "names": ["height", "width", "channels"], "info": video_info},
        "timestamp": scalar("float32"), "frame_index": scalar("int64"), "episode_index": scalar("int64"),
        "index": scalar("int64"), "task_index": scalar("int64"),
    }


HF_FEATURES = {  # the `datasets` features LeRobot stores in the data files' schema metadata
    metaworld.STATE_KEY: {"feature": {"dtype": "float32", "_type": "Value"}, "length": 39, "_type": "List"},
    "action": {"feature": {"dtype": "float32", "_type": "Value"}, "length": 4, "_type": "List"},
    **{k: {"dtype": d, "_type": "Value"} for k, d in (("timestamp", "float32"), ("frame_index", "int64"),
                                                        ("episode_index", "int64"), ("index", "int64"),
                                                        ("task_index", "int64"))},
}


def write_data(path: Path, episodes: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    state = np.concatenate([e["state"] for e in episodes]).astype(np.float32)
    action = np.concatenate([e["action"] for e in episodes]).astype(np.float32)
    frame = np.concatenate([np.arange(len(e["action"])) for e in episodes])
    columns = {
        metaworld.STATE_KEY: pa.FixedSizeListArray.from_arrays(pa.array(state.ravel()), state.shape[1]),
        "action": pa.FixedSizeListArray.from_arrays(pa.array(action.ravel()), action.shape[1]),
        "timestamp": pa.array((frame / metaworld.FPS).astype(np.float32)),
        "frame_index": pa.array(frame.astype(np.int64)),
        "episode_index": pa.array(np.concatenate([np.full(len(e["action"]), i) for i, e in enumerate(episodes)])),
        "index": pa.array(np.arange(len(frame), dtype=np.int64)),
        "task_index": pa.array(np.concatenate([np.full(len(e["action"]), e["task_index"]) for e in episodes])),
    }
    table = pa.table(columns).replace_schema_metadata(
        {"huggingface": json.dumps({"info": {"features": HF_FEATURES}})})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def write_tasks(path: Path, tasks: list[str]) -> None:
    """A pandas frame indexed by the task's text, as LeRobot's `write_tasks` (DataFrame.to_parquet)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pandas_meta = {"index_columns": ["__index_level_0__"],
                   "column_indexes": [{"name": None, "field_name": None, "pandas_type": "unicode", "numpy_type": "str",
                                       "metadata": {"encoding": "UTF-8"}}],
                   "columns": [{"name": "task_index", "field_name": "task_index", "pandas_type": "int64",
                                "numpy_type": "int64", "metadata": None},
                               {"name": None, "field_name": "__index_level_0__", "pandas_type": "unicode",
                                "numpy_type": "object", "metadata": None}],
                   "attributes": {}, "creator": {"library": "pyarrow", "version": pa.__version__}}
    table = pa.table({"task_index": pa.array(range(len(tasks)), pa.int64()),
                      "__index_level_0__": pa.array([metaworld.INSTRUCTIONS[t] for t in tasks], pa.string())})
    pq.write_table(table.replace_schema_metadata({"pandas": json.dumps(pandas_meta)}), path)


def write_episodes(path: Path, episodes: list[dict], tasks: list[str], ep_stats: list[dict], camera: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    camera_key = metaworld.image_key(camera)
    rows, start, t0 = [], 0, 0.0
    for i, (e, stats) in enumerate(zip(episodes, ep_stats)):
        n = len(e["action"])
        row = {"episode_index": i, "tasks": [metaworld.INSTRUCTIONS[tasks[e["task_index"]]]], "length": n,
               "data/chunk_index": 0, "data/file_index": 0, "dataset_from_index": start, "dataset_to_index": start + n,
               f"videos/{camera_key}/chunk_index": 0, f"videos/{camera_key}/file_index": 0,
               f"videos/{camera_key}/from_timestamp": t0, f"videos/{camera_key}/to_timestamp": t0 + n / metaworld.FPS}
        for key, s in stats.items():
            row.update({f"stats/{key}/{name}": v.tolist() for name, v in s.items()})
        row.update({"meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0})
        rows.append(row)
        start, t0 = start + n, t0 + n / metaworld.FPS
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def episode_stats(e: dict, camera: str) -> dict:
    n = len(e["action"])
    frame = np.arange(n)
    return {metaworld.STATE_KEY: feature_stats(e["state"], False), "action": feature_stats(e["action"], False),
            metaworld.image_key(camera): feature_stats(e["image"], True),
            "timestamp": feature_stats((frame / metaworld.FPS)[:, None], False),
            "frame_index": feature_stats(frame[:, None], False),
            "episode_index": feature_stats(np.full((n, 1), e["episode_index"]), False),
            "index": feature_stats(e["index"][:, None], False),
            "task_index": feature_stats(np.full((n, 1), e["task_index"]), False)}


def collect(tasks: list[str], episodes: int, out: Path, size: int, seed: int, log=print,
            camera: str = metaworld.CAMERA) -> dict:
    """Write the dataset (module docstring) of `camera`'s frames; its summary: frames, episodes,
    seeds, tries."""
    metaworld.check_tasks(tasks)
    metaworld.check_camera(camera)
    if episodes < 1:
        raise ConfigError(f"--episodes {episodes}: at least 1")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out}: not empty; give a new directory")
    recorded, tried = [], {}
    for k, task in enumerate(tasks):
        kept, tried[task] = record(task, k, episodes, size, seed, camera)
        recorded += kept
        log(f"{task}: {episodes} of {tried[task]} expert episodes succeeded", file=sys.stderr)
    start = 0
    for i, e in enumerate(recorded):
        e["episode_index"], e["index"] = i, start + np.arange(len(e["action"]))
        start += len(e["action"])
    out.mkdir(parents=True, exist_ok=True)
    try:
        write(out, recorded, tasks, size, start, camera)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # nothing half-written
        raise
    return {"frames": start, "episodes": len(recorded), "tries": tried,
            "seeds": {t: [e["seed"] for e in recorded if e["task_index"] == k] for k, t in enumerate(tasks)}}


def record(task: str, k: int, episodes: int, size: int, seed: int, camera: str) -> tuple[list[dict], int]:
    """Task k's first `episodes` successful expert episodes, tried from seed + TASK_SEED_STRIDE k
    upwards, and how many were tried; a ConfigError where the expert fails too often."""
    env = metaworld.Env(task, size, camera)
    kept, first = [], seed + TASK_SEED_STRIDE * k
    s = first
    while len(kept) < episodes:
        if s - first >= 3 * episodes + 10:
            raise ConfigError(f"{task}: the scripted expert succeeded in {len(kept)} of {s - first} "
                              "episodes; choose tasks whose expert succeeds")
        e = episode(env, s)
        s += 1
        if e is not None:
            e["task_index"] = k
            kept.append(e)
    env.close()
    return kept, s - first


def write(out: Path, recorded: list[dict], tasks: list[str], size: int, frames: int, camera: str) -> None:
    """The dataset's files (module docstring) in `out`, the video first: its encoder settings
    are part of info.json's features."""
    mp4 = out / VIDEOS.format(video_key=metaworld.image_key(camera), chunk_index=0, file_index=0)
    video_info = video.write(mp4, (f for e in recorded for f in e["image"]), metaworld.FPS)
    write_data(out / DATA.format(chunk_index=0, file_index=0), recorded)
    stats = [episode_stats(e, camera) for e in recorded]
    write_episodes(out / "meta" / "episodes" / "chunk-000" / "file-000.parquet", recorded, tasks, stats, camera)
    write_tasks(out / "meta" / "tasks.parquet", tasks)
    total = {key: {k: v.tolist() for k, v in aggregate([s[key] for s in stats]).items()} for key in stats[0]}
    (out / "meta" / "stats.json").write_text(json.dumps(total, indent=4))
    info = {"codebase_version": "v3.0", "robot_type": "sawyer", "total_episodes": len(recorded),
            "total_frames": frames, "total_tasks": len(tasks), "chunks_size": 1000, "data_files_size_in_mb": 100,
            "video_files_size_in_mb": 200, "fps": metaworld.FPS, "splits": {"train": f"0:{len(recorded)}"},
            "data_path": DATA, "video_path": VIDEOS, "features": features(size, video_info, camera)}
    (out / "meta" / "info.json").write_text(json.dumps(info, indent=4))
