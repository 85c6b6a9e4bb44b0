"""Write the tiny LeRobot dataset of tests/fixtures/lerobot/ in codebase v2.1, with LeRobot 0.3's
own code, and what LeRobot 0.3 makes of it: the reference tests/test_lerobot.py checks zerojax's
v2.1 reader against.

Runs in a venv with LeRobot 0.3 (it brings torch, which zerojax never depends on; its datasets
code imports torchvision). The committed fixture was made with lerobot 0.3.3 and datasets 3.6.0
(0.3.3 pins datasets<=3.6) installed without dependencies into a venv whose .pth adds
/work/lerobotvenv's torch 2.10, torchvision 0.25 and av 15.1 (/work/pi0venv has lerobot 0.3.3
but no torchvision, and no CPU build of one matches its torch here):

    /work/lerobotvenv/bin/python -m venv /work/v21venv
    echo /work/lerobotvenv/lib/python3.11/site-packages > /work/v21venv/lib/python3.11/site-packages/zz_lerobotvenv.pth
    /work/v21venv/bin/pip install --no-deps lerobot==0.3.3 datasets==3.6.0
    /work/v21venv/bin/python scripts/make_lerobot_v21_dataset.py tests/fixtures/lerobot/v21

It writes OUT/tiny/ with `LeRobotDataset.create` / `add_frame` / `save_episode`: the dataset of
scripts/lerobot_tiny.py (the v3.0 fixture's features, episodes, tasks and frames; `front` as AV1
video, one MP4 per episode, `wrist` as PNG images embedded in each episode's Parquet), with
meta/episodes.jsonl, tasks.jsonl and episodes_stats.jsonl. Then OUT/reference.npz: LeRobot's
`__getitem__` at INDICES with action chunks of HORIZON steps (`delta_timestamps`), each field
stacked over the indices, and `stats/<feature>/<name>`: the statistics LeRobot 0.3 aggregates
from episodes_stats.jsonl (`LeRobotDatasetMetadata.stats`, `aggregate_stats`).
"""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from lerobot.datasets.lerobot_dataset import CODEBASE_VERSION, LeRobotDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # lerobot_tiny: the dataset's spec, shared with v3.0's
from lerobot_tiny import FEATURES, FPS, HORIZON, INDICES, LENGTHS, frame_of  # noqa: E402

STATS_OF = ("observation.state", "action")  # the features zerojax normalizes


def write_dataset(root: Path) -> None:
    rng = np.random.default_rng(0)
    dataset = LeRobotDataset.create("zerojax/tiny", FPS, FEATURES, root=root, robot_type="toy", use_videos=True)
    for episode, length in enumerate(LENGTHS):
        for t in range(length):
            frame = frame_of(rng, episode, t)
            dataset.add_frame(frame, task=frame.pop("task"))  # 0.3's add_frame takes the task apart
        dataset.save_episode()
    shutil.rmtree(root / "images", ignore_errors=True)  # the PNGs the videos were encoded from


def reference(root: Path) -> dict:
    delta = {"action": [i / FPS for i in range(HORIZON)]}
    dataset = LeRobotDataset("zerojax/tiny", root=root, delta_timestamps=delta, video_backend="pyav")
    assert dataset.meta.info["codebase_version"] == CODEBASE_VERSION == "v2.1", dataset.meta.info
    items = [dataset[i] for i in INDICES]
    out = {}
    for key in items[0]:
        values = [item[key] for item in items]
        out[key] = np.stack([v.numpy() if isinstance(v, torch.Tensor) else np.asarray(v) for v in values])
    for key in STATS_OF:
        for name, value in dataset.meta.stats[key].items():
            out[f"stats/{key}/{name}"] = np.asarray(value)
    return out


def main(out: Path) -> None:
    root = out / "tiny"
    if root.exists():
        shutil.rmtree(root)
    write_dataset(root)
    ref = reference(root)
    np.savez_compressed(out / "reference.npz", indices=np.asarray(INDICES), horizon=HORIZON, **ref)
    print(json.dumps({k: [list(v.shape), str(v.dtype)] for k, v in ref.items()}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
