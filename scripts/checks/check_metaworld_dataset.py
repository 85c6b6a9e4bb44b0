"""Check by hand that LeRobot's own LeRobotDataset loads a dataset `zerojax collect`
wrote, and that its frames, states and actions are what the data files and the video hold
(run in LeRobot 0.4's venv; BENCHMARKS.md "Meta-World" records the command):

    /work/lerobotvenv/bin/python scripts/checks/check_metaworld_dataset.py DIR

It decodes the MP4 with PyAV itself (every frame, in order) as the reference for the pixels, and
reads the Parquet files with pyarrow for the numbers; LeRobot's items must equal them (numbers
exactly, pixels to within 1/255: LeRobot's decoder returns float32 in [0, 1])."""

import sys
from pathlib import Path

import av
import numpy as np
import pyarrow.parquet as pq
from lerobot.datasets.lerobot_dataset import LeRobotDataset

root = Path(sys.argv[1])
ds = LeRobotDataset(repo_id="local/metaworld", root=root, delta_timestamps={"action": [i / 80 for i in range(4)]},
                   video_backend="pyav")  # torchcodec needs FFmpeg libraries this machine lacks
table = pq.read_table(root / "data" / "chunk-000" / "file-000.parquet").to_pydict()
camera = "observation.images.corner2"
with av.open(str(root / "videos" / camera / "chunk-000" / "file-000.mp4")) as f:
    frames = np.stack([fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)])
print(f"LeRobotDataset: {ds.num_episodes} episodes, {ds.num_frames} frames, fps {ds.fps}, tasks "
      f"{list(ds.meta.tasks.index)}; the MP4 holds {len(frames)} frames")
assert len(frames) == ds.num_frames == len(table["index"])
worst = 0.0
for i in sorted({0, 1, ds.num_frames // 2, ds.num_frames - 1, *range(0, ds.num_frames, 37)}):
    item = ds[i]
    assert np.array_equal(item["observation.state"].numpy(), np.asarray(table["observation.state"][i], np.float32)), i
    ep = table["episode_index"][i]
    last = max(j for j in range(len(table["index"])) if table["episode_index"][j] == ep)
    want = [table["action"][min(i + k, last)] for k in range(4)]
    assert np.array_equal(item["action"].numpy(), np.asarray(want, np.float32)), i
    assert item["action_is_pad"].tolist() == [i + k > last for k in range(4)], i
    assert item["task"] == list(ds.meta.tasks.index)[table["task_index"][i]], i
    pixels = item[camera].numpy().transpose(1, 2, 0) * 255
    worst = max(worst, float(np.abs(pixels - frames[i]).max()))
print(f"states, action chunks, padding and tasks equal; pixels within {worst:.3f} of PyAV's frames (of 255)")
assert worst <= 1.0
