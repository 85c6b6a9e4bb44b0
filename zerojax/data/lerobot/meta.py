"""The tables of a LeRobot dataset, read with pyarrow and checked once, when the source opens:
the columns of the data Parquet files that a batch reads (state, action, timestamps, task
indices, embedded images) and, from its metadata, each episode's rows and its place in the video
files, the tasks and the statistics (`Tables`). Codebase v3.0's metadata is read here
(meta/episodes/*.parquet, meta/tasks.parquet, meta/stats.json), v2.1's in `v21`.

Layout of v3.0 (LeRobot 0.4, `lerobot.datasets.utils`): `info["data_path"]` and `info["video_path"]`
are templates filled with an episode's `data/chunk_index`, `data/file_index` and
`videos/<camera>/chunk_index`, `file_index`; episodes are stored one after another in a file,
an episode's rows are the dataset indices [dataset_from_index, dataset_to_index) and its
frames start at `videos/<camera>/from_timestamp` in the MP4.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from zerojax.config.normalization import NormalizationMode
from zerojax.data.lerobot import frames
from zerojax.errors import ConfigError


@dataclass
class Episode:
    index: int
    start: int  # dataset_from_index
    stop: int  # dataset_to_index (exclusive)
    videos: dict = field(default_factory=dict)  # camera -> (mp4 path, from_timestamp)


@dataclass
class Dataset:
    root: Path
    fps: int
    index: np.ndarray  # int64 [N]: dataset index of each row, ascending
    episode: np.ndarray  # int64 [N]
    timestamp: np.ndarray  # float32 [N]: seconds since the episode's first frame
    task: np.ndarray  # int64 [N]: task_index
    columns: dict  # "observation.state" / "action" -> float32 [N, D]
    images: dict  # camera stored as images -> its Parquet cells (pyarrow), [N]
    episodes: dict  # episode_index -> Episode
    tasks: dict  # task_index -> the task's text
    stats: dict  # feature -> {"mean": [...], ...} (Tables.stats)

    def position(self, index: int) -> int:
        at = int(np.searchsorted(self.index, index))
        if at >= len(self.index) or self.index[at] != index:
            raise ConfigError(f"{self.root}: the data files hold no row with index {index}")
        return at

    def numbers(self, index: int, horizon: int) -> dict:
        """LeRobot's item for dataset index `index` without its images: the state, the action
        chunk of `horizon` steps (indices clamped to the episode, padding flagged), the task."""
        at = self.position(index)
        ep = self.episodes[int(self.episode[at])]
        wanted = index + np.arange(horizon)
        chunk = [self.position(i) for i in np.clip(wanted, ep.start, ep.stop - 1)]
        return {"observation.state": self.columns["observation.state"][at],
                "action": self.columns["action"][chunk],
                "action_is_pad": (wanted < ep.start) | (wanted >= ep.stop),
                "task": self.tasks[int(self.task[at])], "timestamp": self.timestamp[at]}

    def image(self, camera: str, index: int, video: frames.VideoReader) -> np.ndarray:
        """RGB uint8 [h, w, 3]: the camera's frame at dataset index `index`."""
        at = self.position(index)
        ep = self.episodes[int(self.episode[at])]
        if camera in self.images:
            return frames.decode_image(self.images[camera][at].as_py(), f"{camera}, episode {ep.index}, index {index}")
        path, start = ep.videos[camera]
        t = start + float(self.timestamp[at])  # LeRobot's from_timestamp + item["timestamp"].item()
        return video.frame(path, t, f"{camera}, episode {ep.index}")

    def split_frames(self, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
        """Dataset indices of the training and the evaluation episodes' frames: the last
        int(episodes * val_fraction) episodes are held out (none: evaluation reads training's)."""
        order = sorted(self.episodes)
        n_val = int(len(order) * val_fraction)
        held = set(order[len(order) - n_val:]) if n_val else set()
        train = self.index[~np.isin(self.episode, list(held))]
        return train, (self.index[np.isin(self.episode, list(held))] if held else train)


class Tables(NamedTuple):
    """What a dataset's metadata says, whichever its codebase version."""

    episodes: dict  # episode_index -> Episode
    data_files: list  # the Parquet files of the frames (Path)
    tasks: dict  # task_index -> the task's text
    stats: dict | None  # feature -> {"mean": [...], ...}; None: the dataset has no statistics file
    names: dict  # "episodes" / "tasks" / "stats" -> the file that said it, relative to the root


def read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err}); is this {what}?") from None


def read_parquet(path: Path, columns: list[str], what: str, only: bool = True):
    """The Parquet file's `columns` (`only=False`: all of its columns, `columns` among them)."""
    import pyarrow.parquet as pq

    import pyarrow as pa

    if not path.is_file():
        raise ConfigError(f"{path}: no such file ({what})")
    try:
        names = pq.read_schema(path).names
        missing = [c for c in columns if c not in names]
        if missing:
            raise ConfigError(f"{path}: no column {', '.join(map(repr, missing))} ({what}); its columns: "
                              f"{', '.join(names)}")
        return pq.read_table(path, columns=columns if only else None)
    except (pa.ArrowException, OSError) as err:  # cut short, overwritten, not Parquet at all
        raise ConfigError(f"{path}: not a Parquet file pyarrow can read ({what}; {str(err).splitlines()[0][:160]}); "
                          "copy the dataset again") from None


def as_matrix(column) -> np.ndarray:
    """A Parquet list column (LeRobot's vectors) as float32 [N, D]."""
    import pyarrow as pa

    values = pa.concat_arrays(column.chunks) if column.num_chunks else pa.array([], pa.list_(pa.float32()))
    return np.asarray(values.flatten(), np.float32).reshape(len(values), -1)


def read_tasks(path: Path) -> dict:
    """meta/tasks.parquet: a pandas frame whose index is the task's text, with a task_index column."""
    table = read_parquet(path, ["task_index"], "the dataset's tasks", only=False)  # the index column too
    meta = table.schema.pandas_metadata or {}
    text = next((c for c in [*meta.get("index_columns", []), "task"] if isinstance(c, str) and c in table.column_names),
                None)
    if text is None:
        raise ConfigError(f"{path}: no column of task texts; its columns: {', '.join(table.column_names)}")
    return dict(zip(table.column("task_index").to_pylist(), table.column(text).to_pylist()))


def read_episodes(root: Path, info: dict, cameras: list[str]) -> dict:
    files = sorted((root / "meta" / "episodes").glob("*/*.parquet"))
    if not files:
        raise ConfigError(f"{root / 'meta' / 'episodes'}: no episode files (chunk-*/file-*.parquet)")
    videos = [c for c in cameras if info["features"][c]["dtype"] == "video"]
    columns = ["episode_index", "dataset_from_index", "dataset_to_index", "data/chunk_index", "data/file_index"]
    columns += [f"videos/{c}/{k}" for c in videos for k in ("chunk_index", "file_index", "from_timestamp")]
    episodes, data_files = {}, {}
    for path in files:
        rows = read_parquet(path, columns, "the dataset's episodes").to_pylist()
        for row in rows:
            ep = Episode(row["episode_index"], row["dataset_from_index"], row["dataset_to_index"])
            for c in videos:
                mp4 = info["video_path"].format(video_key=c, chunk_index=row[f"videos/{c}/chunk_index"],
                                                file_index=row[f"videos/{c}/file_index"])
                ep.videos[c] = (str(root / mp4), float(row[f"videos/{c}/from_timestamp"]))
            episodes[ep.index] = ep
            data_files[ep.index] = root / info["data_path"].format(chunk_index=row["data/chunk_index"],
                                                                   file_index=row["data/file_index"])
    return episodes, list(data_files.values())


def read_tables(root: Path, info: dict, cameras: list[str]) -> Tables:
    """A v3.0 dataset's metadata (module docstring)."""
    episodes, data_files = read_episodes(root, info, cameras)
    if not episodes:
        raise ConfigError(f"{root / 'meta' / 'episodes'}: the dataset has no episodes (its files hold no rows)")
    path = root / "meta" / "stats.json"
    stats = read_json(path, "LeRobot's stats.json") if path.is_file() else None
    return Tables(episodes, data_files, read_tasks(root / "meta" / "tasks.parquet"), stats,
                  {"episodes": "meta/episodes", "tasks": "meta/tasks.parquet", "stats": "meta/stats.json"})


def check_stats(root: Path, tables: Tables, norms: dict) -> dict:
    """The statistics, checked to hold what each normalized feature's mode needs."""
    path, stats = root / tables.names["stats"], tables.stats or {}
    needed = {key: NormalizationMode.of_config(mode).stats for key, mode in norms.items()}
    needed = {key: names for key, names in needed.items() if names}
    for key, names in needed.items():
        have = stats.get(key, {})
        missing = [n for n in names if n not in have]
        if missing:
            mode = norms[key]
            setting = f"data.norm_{'state' if key == 'observation.state' else 'action'}={mode}"
            raise ConfigError(f"{path}: no {'/'.join(missing)} statistics for {key!r} ({setting} needs "
                              f"{' and '.join(names)}; " + (f"it has {', '.join(have) or 'none'}"
                                                            if tables.stats is not None else "the file is missing") +
                              f"); compute them with LeRobot, or set {setting.split('=')[0]}=identity")
    return stats


def width(info: dict, key: str) -> int:
    return int(np.prod(info["features"][key]["shape"]))


def check_widths(path: Path, key: str, stats: dict, expected: int) -> None:
    """Each statistic holds one finite number per dimension of the feature: a shorter one would
    broadcast and normalize every dimension by the wrong numbers without an error."""
    for name, value in stats.items():
        try:
            x = np.asarray(value, np.float64).reshape(-1)
        except (TypeError, ValueError):
            x = None
        if x is None or x.size != expected or not np.isfinite(x).all():
            got = f"{x.size} number(s)" if x is not None else f"{str(value)[:40]!r}"
            raise ConfigError(f"{path}: {key}'s {name} holds {got}" + (", not all finite" if x is not None and
                                                                         x.size == expected else "") +
                              f"; meta/info.json gives the feature {expected} (recompute the statistics: "
                              "zerojax stats or LeRobot's)")


def check_videos(ds: Dataset, cameras: list[str]) -> None:
    """Every frame a video camera will be asked for lies within its MP4's span (headers), and the
    last one of each file decodes (a file cut short keeps headers that claim its whole length)."""
    spans, last = {}, {}
    for ep in ds.episodes.values():
        rows = ds.timestamp[(ds.index >= ep.start) & (ds.index < ep.stop)]
        for camera, (path, start) in ep.videos.items():
            if path not in spans:
                if not Path(path).is_file():
                    raise ConfigError(f"{path}: no such file (episode {ep.index}'s {camera} video)")
                spans[path] = frames.video_span(path)
            first, end = spans[path]
            for t in (start + float(rows.min()), start + float(rows.max())) if len(rows) else ():
                if not first - frames.TOLERANCE_S < t < end:
                    raise ConfigError(f"{path}: episode {ep.index} needs its {camera} frame at t={t:.4f} s, "
                                      f"outside the video ({first:.4f} s to {end:.4f} s); the video cannot be "
                                      "decoded there (meta/episodes' from_timestamp, or a cut-short file?)")
                if t > last.get(path, (-1.0,))[0]:
                    last[path] = (t, f"{camera}, episode {ep.index}")
    reader = frames.VideoReader()
    for path, (t, where) in last.items():
        reader.frame(path, t, where)
    reader.close()


def load(root: Path, info: dict, cameras: list[str], norms: dict, read_meta) -> Dataset:
    """The dataset's tables, every problem a ConfigError naming the file (before any step);
    `read_meta` reads its codebase version's metadata (`read_tables`: v3.0's)."""
    tables = read_meta(root, info, cameras)
    images = [c for c in cameras if info["features"][c]["dtype"] == "image"]
    columns = ["index", "episode_index", "timestamp", "task_index", "observation.state", "action", *images]
    parts = [read_parquet(path, columns, "the dataset's frames") for path in sorted(set(tables.data_files))]
    import pyarrow as pa

    table = pa.concat_tables(parts).sort_by("index")
    ds = Dataset(root, int(info["fps"]), np.asarray(table.column("index"), np.int64),
                 np.asarray(table.column("episode_index"), np.int64), np.asarray(table.column("timestamp"), np.float32),
                 np.asarray(table.column("task_index"), np.int64),
                 {k: as_matrix(table.column(k)) for k in ("observation.state", "action")},
                 {c: table.column(c) for c in images}, tables.episodes, tables.tasks, check_stats(root, tables, norms))
    check_tables(ds, info, tables.names)
    check_videos(ds, cameras)
    return ds


def check_tables(ds: Dataset, info: dict, names: dict) -> None:
    """The frames agree with meta/info.json, the episodes and the tasks (`names`: Tables.names)."""
    for key, matrix in ds.columns.items():
        if matrix.shape[1] != width(info, key):
            raise ConfigError(f"{ds.root}: the data files' {key!r} holds {matrix.shape[1]} numbers a frame; "
                              f"meta/info.json says shape {list(info['features'][key]['shape'])}")
        check_widths(ds.root / names["stats"], key, {n: v for n, v in (ds.stats or {}).get(key, {}).items()
                                                     if n != "count"}, width(info, key))
    for ep in ds.episodes.values():
        held = np.count_nonzero((ds.index >= ep.start) & (ds.index < ep.stop) & (ds.episode == ep.index))
        if held != ep.stop - ep.start:
            raise ConfigError(f"{ds.root}: episode {ep.index} spans dataset indices [{ep.start}, {ep.stop}) in "
                              f"{names['episodes']}, but the data files hold {held} of its {ep.stop - ep.start} frames")
    unknown = sorted(set(ds.task.tolist()) - set(ds.tasks))
    if unknown:
        raise ConfigError(f"{ds.root / names['tasks']}: no task with task_index {unknown[0]} (the frames use it)")


CODEBASE_VERSIONS = ("v2.1", "v3.0")  # the codebase versions zerojax reads (LeRobot 0.3 writes v2.1, 0.4+ v3.0)
INFO_KEYS = ("fps", "features", "data_path")  # what the reader takes from info.json (video_path: with a video)


def read_info(root: Path) -> dict:
    """meta/info.json, checked: a LeRobot dataset of a codebase version zerojax reads."""
    path = root / "meta" / "info.json"
    if not path.is_file():
        what = ("a file, not a directory" if root.is_file() else "no such directory" if not root.is_dir() else
                "no meta/info.json in it")
        raise ConfigError(f"data.source=lerobot:{root}: {what}; a LeRobot dataset directory holds meta/info.json")
    info = read_json(path, "a LeRobot dataset's info.json")
    version = info.get("codebase_version") if isinstance(info, dict) else None
    if version not in CODEBASE_VERSIONS:
        raise ConfigError(f"{path}: codebase_version {version!r} is not supported; zerojax reads "
                          f"{', '.join(CODEBASE_VERSIONS)} (LeRobot 0.3's and 0.4's formats; LeRobot 0.3's "
                          "lerobot.datasets.v21.convert_dataset_v20_to_v21 converts v2.0)")
    videos = any(isinstance(f, dict) and f.get("dtype") == "video" for f in (info.get("features") or {}).values())
    needed = (*INFO_KEYS, *(("chunks_size",) if version == "v2.1" else ()), *(("video_path",) if videos else ()))
    missing = [key for key in needed if key not in info]
    if missing:
        raise ConfigError(f"{path}: no {', '.join(map(repr, missing))}, which a LeRobot {version} info.json holds "
                          f"({', '.join(needed)}); is the file complete?")
    if not isinstance(info["features"], dict) or not isinstance(info["fps"], (int, float)) or info["fps"] <= 0:
        raise ConfigError(f"{path}: 'features' must be a map of features and 'fps' a number > 0; got "
                          f"{type(info['features']).__name__} and {info['fps']!r}")
    return info
