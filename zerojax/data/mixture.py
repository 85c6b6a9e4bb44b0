"""Several LeRobot datasets in one run, each drawn at its weight: `data.source=mixture` with
`data.mixture` (docs/design.md §5, "Dataset mixtures"):

    data:                                  # or, on the command line:
      source: mixture                      #   data.source=mixture
      mixture:                             #   data.mixture=/data/arm_a:0.7,/data/arm_b:0.3
        /data/arm_a: 0.7
        /data/arm_b: 0.3

Each dataset is opened as a LeRobot source of its own (`data.lerobot`): its own statistics
normalize its state and actions, its own fps makes its chunks, its own tasks its prompts, its own
last episodes are held out (data.val_fraction), data.filter_idle drops its own idle frames. The
mixture's features are the batch `data.lerobot` documents, over all the datasets:

    observation.state / action    zero-padded to the widest dataset's width (the policy's adapter
                                  then pads to model.action.max_state_dim / max_action_dim)
    observation.images.<cam>     one slot a camera of any dataset (data.cameras, or every camera
                                  in the order the datasets name them); a row of a dataset without
                                  that camera holds -1 there and its `image_masks` slot is False,
                                  as LeRobot fills an empty camera (`Masked`)

Which dataset each row of a step's global batch comes from is a pure function of (train.seed,
split, step, row): row r of step s is the global draw n = s·B + r, whose dataset is where
frac(offset + n·φ) falls among the weights' cumulative sums (φ the golden ratio's fraction, the
offset drawn from (seed, split)): a Weyl sequence, so that after N draws each dataset's share is
within O(log N / N) of its weight (a random draw would be off by sqrt(w(1-w)/N), 1% at 2,000
draws), yet no dataset's rows come in a fixed pattern. The frame is then drawn uniformly from that
dataset's split by a generator seeded with (seed, split, step). So a batch is the same on any
mesh and any process count, each process building only its rows.

A mixture's run writes mixture.json (each dataset's weight and lerobot.json record: its features
and statistics) and no lerobot.json. Its safetensors export carries the file, and `zerojax serve`
of either reads each request with the statistics of the dataset it names (zerojax/serve/mixture.py).
A dataset's name (`names`) is its directory as data.mixture names it, or that directory's own name
where no other dataset of the mixture shares it. Its openpi export holds one assets/<asset_id>/
entry a dataset (`asset_ids`), as an openpi checkpoint holds one a robot; a LeRobot policy holds
one normalization, so `zerojax export --format lerobot --dataset NAME` writes one dataset's
(`record_of`: its statistics, cameras and widths).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path, PurePosixPath

import numpy as np

from zerojax.data import idle as idle_lib
from zerojax.data.lerobot import meta
from zerojax.data.lerobot import source as lerobot
from zerojax.errors import ConfigError
from zerojax.models.family import ACTION, CAMERA, STATE, TASK, Field

STREAM = 0x4D495854  # the generators' stream for the mixture's draws, apart from the rows' and the noise's
PHI = (math.sqrt(5.0) - 1.0) / 2.0  # the golden ratio's fraction: the Weyl sequence's step
RUN_FILE = "mixture.json"  # the run's record of its datasets (`MixtureSource.run_files`)


def member_cfg(cfg, root: str, cameras: tuple[str, ...] = ()):
    """The config of one dataset of the mixture, as if it were data.source=lerobot:ROOT."""
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source=f"lerobot:{root}", mixture=(),
                                                             cameras=cameras))


def members(cfg) -> list[tuple[str, float, dict]]:
    """(root, weight, info.json) of each dataset of data.mixture, checked readable."""
    out = []
    for root, weight in cfg.data.mixture:
        try:
            out.append((root, weight, meta.read_info(lerobot.root_of(member_cfg(cfg, root)))))
        except ConfigError as err:  # the reader names data.source=lerobot:ROOT; say which key gave it
            raise ConfigError(f"data.mixture's dataset {root}: {err}") from None
    return out


def camera_slots(cfg, infos: list[tuple[str, dict]]) -> tuple[list[str], list[list[str]]]:
    """(the mixture's camera slots, each dataset's cameras among them): data.cameras, or every
    camera of any dataset in the order the datasets name them; ConfigError for a dataset with none."""
    wanted = [c if c.startswith(CAMERA) else CAMERA + c for c in cfg.data.cameras]
    own = [lerobot.cameras_of(member_cfg(cfg, root), info) for root, info in infos]
    slots = wanted or list(dict.fromkeys(c for cams in own for c in cams))
    unknown = [c for c in wanted if not any(c in cams for cams in own)]
    if unknown:
        raise ConfigError(f"data.cameras names {', '.join(unknown)}, which no dataset of data.mixture has; "
                          f"their cameras: {', '.join(dict.fromkeys(c for cams in own for c in cams))}")
    return slots, [[c for c in slots if c in cams] for cams in own]


def spec(cfg) -> dict:
    """The mixture's features (module docstring), from the datasets' info.json alone."""
    infos = members(cfg)
    slots, _ = camera_slots(cfg, [(root, info) for root, _, info in infos])
    d, B = cfg.data, cfg.train.global_batch
    widths = {key: max(meta_width(info, key) for _, _, info in infos) for key in (STATE, ACTION)}
    out = {STATE: Field((B, widths[STATE]), "float32")}
    for camera in slots:
        out[camera] = Field((B, 3, d.image_size, d.image_size), "float32")
    out[ACTION] = Field((B, d.action_horizon, widths[ACTION]), "float32")
    out["action_is_pad"] = Field((B, d.action_horizon), "bool")
    return out


def meta_width(info: dict, key: str) -> int:
    if key not in info.get("features", {}):
        raise ConfigError(f"a dataset of data.mixture has no feature {key!r}; its features: "
                          f"{', '.join(info['features'])}")
    return int(np.prod(info["features"][key]["shape"]))


def open(cfg) -> "MixtureSource":  # noqa: A001 - the kind module's protocol name
    infos = members(cfg)
    slots, own = camera_slots(cfg, [(root, info) for root, _, info in infos])
    sources = [lerobot.open(member_cfg(cfg, root, tuple(cams))) for (root, _, _), cams in zip(infos, own)]
    return MixtureSource([root for root, _, _ in infos], np.array([w for _, w, _ in infos], np.float64),
                         sources, slots, spec(cfg), cfg.train.seed)


class MixtureSource:
    """The source (module docstring): `draw(split, step)` says which dataset and frame each row
    of a step's global batch is, `rows` builds this process's rows of it."""

    def __init__(self, roots: list[str], weights: np.ndarray, sources: list, slots: list[str], spec: dict, seed: int):
        self.roots, self.weights, self.sources = roots, weights / weights.sum(), sources
        self.slots, self._spec = slots, spec
        self.seed, self.batch = seed, spec[ACTION].shape[0]
        self.size = spec[slots[0]].shape[-1] if slots else 0
        self.present = np.array([[c in s.cameras for c in slots] for s in sources], bool)  # [datasets, slots]
        self.prefetch = lerobot.Prefetch(self._build, workers=min(16, 2 * (os.cpu_count() or 1)))

    @property
    def vocab_size(self) -> int:
        return self.sources[0].vocab_size

    @property
    def tokenizer(self):
        """data.tokenizer, one for every dataset (the adapter tokenizes each row's task with it)."""
        return self.sources[0].tokenizer

    @property
    def idle(self) -> idle_lib.Idle:
        """data.filter_idle over all the datasets (the start line's count)."""
        each = [s.idle for s in self.sources]
        return idle_lib.Idle(each[0].threshold, sum(i.dropped for i in each), sum(i.frames for i in each))

    def spec(self) -> dict:
        return self._spec

    def run_files(self) -> dict:
        """mixture.json: each dataset's weight and lerobot.json (its features and statistics)."""
        datasets = [{"dataset": root, "weight": float(w), "lerobot.json": json.loads(s.run_files()["lerobot.json"])}
                    for root, w, s in zip(self.roots, self.weights, self.sources)]
        doc = {"datasets": datasets, "camera_slots": self.slots}
        return {RUN_FILE: json.dumps(doc, indent=1) + "\n"}

    def draw(self, split: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(dataset of each row int [B], its dataset index int [B]) of the step's global batch."""
        offset = np.random.default_rng((self.seed, STREAM, split)).random()
        n = step * self.batch + np.arange(self.batch, dtype=np.int64)
        which = np.searchsorted(np.cumsum(self.weights), np.mod(offset + n * PHI, 1.0), side="right")
        which = np.minimum(which, len(self.weights) - 1)  # cumsum's last may round below 1
        rng = np.random.default_rng((self.seed, STREAM, split, step))
        u = rng.random(self.batch)
        frames = np.array([pool[int(x * len(pool))] for pool, x in
                           zip((self.sources[m].split_frames[split] for m in which), u)], np.int64)
        return which, frames

    def rows(self, split: int, step: int, rows: slice) -> dict:
        return self.prefetch.get((split, step, rows.start, rows.stop))

    def _build(self, key, pool) -> dict:
        split, step, start, stop = key
        which, frames = self.draw(split, step)
        items = list(pool.map(self.item, which[start:stop], frames[start:stop]))
        return {k: np.stack([it[k] for it in items]) for k in (*self._spec, TASK)}

    def item(self, member: int, index: int) -> dict:
        """One row: the dataset's own item, padded to the mixture's widths and camera slots."""
        raw = self.sources[member].item(index)
        out = {k: raw[k] for k in ("action_is_pad", TASK)}
        out[STATE] = pad_last(raw[STATE], self._spec[STATE].shape[-1])
        out[ACTION] = pad_last(raw[ACTION], self._spec[ACTION].shape[-1])
        empty = np.full((3, self.size, self.size), -1.0, np.float32)
        for camera in self.slots:
            out[camera] = raw.get(camera, empty)
        return out

    def camera_masks(self, split: int, step: int, rows: slice) -> np.ndarray:
        """bool [rows, slots]: which camera slots each of these rows really has."""
        return self.present[self.draw(split, step)[0][rows]]


def names(roots: list[str]) -> dict[str, int]:
    """{a name a request or --dataset may give: the dataset's index}: each dataset's directory as
    data.mixture names it, and the directory's own name where no other dataset of the mixture has it."""
    short = [Path(root).name for root in roots]
    out = {root: i for i, root in enumerate(roots)}
    out.update({name: i for i, name in enumerate(short) if short.count(name) == 1 and name not in out})
    return out


def choices(roots: list[str]) -> str:
    """The datasets' names for a message: 'short' (directory), or the directory alone."""
    given = names(roots)
    short = {i: name for name, i in given.items() if name not in roots}
    return ", ".join(f"{short[i]!r} ({root})" if i in short else repr(root) for i, root in enumerate(roots))


def asset_ids(roots: list[str]) -> list[str]:
    """Each dataset's asset id in an openpi export (assets/<asset_id>/norm_stats.json): its
    directory's own name where no other dataset of the mixture shares it (as a single dataset's
    export names its one asset), else its directory as data.mixture names it, relative (openpi's
    asset ids may hold a "/"); ConfigError where that does not tell two apart, or climbs out of
    assets/ ("..")."""
    short = [Path(root).name for root in roots]
    out = [name if short.count(name) == 1 else PurePosixPath(root).as_posix().lstrip("/")
           for name, root in zip(short, roots)]
    odd = [root for root, asset in zip(roots, out) if ".." in PurePosixPath(asset).parts or out.count(asset) > 1]
    if odd:
        raise ConfigError(f"data.mixture's dataset {odd[0]!r} shares its directory's name with another, and its path "
                          "does not tell them apart inside assets/: no openpi asset id names it; give the datasets "
                          "distinct directory names")
    return out


def record_of(run_dir, dataset: str | None) -> dict:
    """The lerobot.json record (features, statistics, fps) of the dataset `dataset` names in the
    mixture run's mixture.json, for a format that holds one normalization; ConfigError naming the
    datasets where `dataset` is None or names none of them."""
    doc = json.loads((Path(run_dir) / RUN_FILE).read_text())
    roots = [d["dataset"] for d in doc["datasets"]]
    given = names(roots)
    if dataset not in given:
        what = (f"--dataset {dataset!r} names none of them" if dataset is not None else
                "LeRobot's policy directory holds one dataset's normalization: give --dataset NAME")
        raise ConfigError(f"{run_dir} trained on a mixture of datasets (data.source=mixture): {choices(roots)}; {what}")
    return doc["datasets"][given[dataset]]["lerobot.json"]


def pad_last(x: np.ndarray, width: int) -> np.ndarray:
    return np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


class Masked:
    """A policy adapter's rows of a mixture, with each row's missing cameras masked: the
    adapter sets `image_masks` from the slots the source has; a row of a dataset that lacks a
    camera gets its slot masked here (its image is already -1)."""

    def __init__(self, rows, mixture: MixtureSource):
        self.inner, self.source = rows, mixture

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def spec(self):
        return self.inner.spec()

    def run_files(self) -> dict:
        return self.source.run_files()

    def rows(self, split: int, step: int, rows: slice) -> dict:
        batch = dict(self.inner.rows(split, step, rows))
        masks = batch["image_masks"].copy()
        slots = len(self.source.slots)
        masks[:, :slots] &= self.source.camera_masks(split, step, rows)
        batch["image_masks"] = masks
        return batch
