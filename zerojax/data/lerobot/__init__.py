"""LeRobot datasets (codebase v3.0, as LeRobot 0.4+ writes them, and v2.1, as LeRobot 0.3 does),
read with pyarrow, PyAV and Pillow; no torch. `data.source=lerobot:DIR` opens this package
(`data.sources.KINDS`: its `spec` and `open`).

    source.py  the data source: a frame's row (state, cameras, action chunk, prompt), normalized
               as LeRobot's processors do; the observation `zerojax serve` builds the same way
    meta.py    the tables (pyarrow), checked once: the data files' columns and v3.0's metadata
               (episodes, tasks, stats.json)
    v21.py     v2.1's metadata (episodes.jsonl, tasks.jsonl, episodes_stats.jsonl aggregated as
               LeRobot 0.3 does), in meta.py's shape
    frames.py  camera frames: MP4 decoded with PyAV, embedded images with Pillow, the resize
               with padding
    stats.py   a v3.0 dataset's statistics computed as LeRobot 0.6.1 computes them (`zerojax stats`)
    relative.py  relative actions (model.action.relative): the state subtracted and added back,
               the relative actions' statistics a run normalizes with

The package names the source's entry points and the normalization both ways; the modules are
`zerojax.data.lerobot.NAME` (`from zerojax.data.lerobot import frames, stats`).
"""

from zerojax.data.lerobot.meta import read_info
from zerojax.data.lerobot.source import (VERSIONS, LeRobotSource, normalize, observation, open, spec,
                                         unnormalize)

__all__ = ["VERSIONS", "LeRobotSource", "normalize", "observation", "open", "read_info", "spec", "unnormalize"]
