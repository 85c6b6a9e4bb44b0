"""Write the tiny LeRobot dataset of tests/fixtures/lerobot/ with LeRobot's own code, and what
LeRobot makes of it: the reference tests/test_lerobot.py checks zerojax's loader against.

Runs in a venv of its own (LeRobot brings torch, which zerojax never depends on):

    python3 -m venv /work/lerobotvenv && /work/lerobotvenv/bin/pip install 'lerobot==0.4.*'
    /work/lerobotvenv/bin/python scripts/make_lerobot_dataset.py tests/fixtures/lerobot

It writes OUT/tiny/ with `LeRobotDataset.create` / `add_frame` / `save_episode` (codebase
v3.0): two cameras (`front` stored as AV1 video, 24x32, and `wrist` as PNG images embedded in
the Parquet, 16x16), `observation.state` [3] and `action` [2], three episodes of 6, 9 and 4
frames at 10 fps, two tasks. Then OUT/reference.npz: LeRobot's `__getitem__` for INDICES, with
action chunks of HORIZON steps (`delta_timestamps`), each field stacked over the indices;
the same items through LeRobot's `NormalizerProcessorStep` (its four modes), also with the
statistics of OUT/degenerate_stats.json (a constant gripper: the eps paths), and the normalized actions back
through `UnnormalizerProcessorStep` (what a policy server applies to its output); and the
camera frames through `resize_with_pad_torch` (LeRobot's pi0, openpi's order: to [-1, 1] first)
to SIZE x SIZE.
"""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
from lerobot.datasets.lerobot_dataset import LeRobotDataset
from lerobot.policies.pi0.modeling_pi0 import resize_with_pad_torch
from lerobot.processor.core import TransitionKey
from lerobot.processor.normalize_processor import NormalizerProcessorStep, UnnormalizerProcessorStep

sys.path.insert(0, str(Path(__file__).resolve().parent))  # lerobot_tiny: the dataset's spec, shared with v2.1's
from lerobot_tiny import FEATURES, FPS, HORIZON, INDICES, LENGTHS, SIZE, frame_of  # noqa: E402


def write_dataset(root: Path) -> None:
    rng = np.random.default_rng(0)
    dataset = LeRobotDataset.create("zerojax/tiny", FPS, FEATURES, root=root, robot_type="toy", use_videos=True)
    for episode, length in enumerate(LENGTHS):
        for t in range(length):
            dataset.add_frame(frame_of(rng, episode, t))
        dataset.save_episode()
    dataset.finalize()


def degenerate(stats: dict) -> dict:
    """The statistics with a constant gripper: std 0, and each pair of bounds equal (the eps paths)."""
    stats = {k: {s: np.array(v, copy=True) for s, v in d.items()} for k, d in stats.items()}
    state = stats["observation.state"]
    state["std"][2] = 0
    for lo, hi in (("min", "max"), ("q01", "q99"), ("q10", "q90")):
        state[hi][2] = state[lo][2]
    return stats


def reference(root: Path) -> dict:
    delta = {"action": [i / FPS for i in range(HORIZON)]}
    dataset = LeRobotDataset("zerojax/tiny", root=root, delta_timestamps=delta, video_backend="pyav")
    # pyav: LeRobot's decoder where torchcodec is missing or, as here, finds no system FFmpeg
    items = [dataset[i] for i in INDICES]
    out = {}
    for key in items[0]:
        values = [item[key] for item in items]
        out[key] = np.stack([v.numpy() if isinstance(v, torch.Tensor) else np.asarray(v) for v in values])
    features = {"observation.state": PolicyFeature(FeatureType.STATE, (3,)),
                "action": PolicyFeature(FeatureType.ACTION, (2,))}
    for name, stats in (("", dataset.meta.stats), ("degenerate/", degenerate(dataset.meta.stats))):
        for mode in (NormalizationMode.MEAN_STD, NormalizationMode.MIN_MAX, NormalizationMode.QUANTILES,
                     NormalizationMode.QUANTILE10):
            step = NormalizerProcessorStep(features=features, stats=stats,
                                           norm_map={FeatureType.STATE: mode, FeatureType.ACTION: mode})
            transition = step({TransitionKey.OBSERVATION: {"observation.state": torch.from_numpy(out["observation.state"])},
                               TransitionKey.ACTION: torch.from_numpy(out["action"])})
            key = f"{name}{mode.value.lower()}"
            out[f"{key}/observation.state"] = transition[TransitionKey.OBSERVATION]["observation.state"].numpy()
            out[f"{key}/action"] = transition[TransitionKey.ACTION].numpy()
            inverse = UnnormalizerProcessorStep(features=features, stats=stats,
                                                norm_map={FeatureType.STATE: mode, FeatureType.ACTION: mode})
            back = inverse({TransitionKey.ACTION: transition[TransitionKey.ACTION]})  # a policy's output
            out[f"{key}/unnormalized/action"] = back[TransitionKey.ACTION].numpy()
    for camera in ("front", "wrist"):
        images = torch.from_numpy(out[f"observation.images.{camera}"]).permute(0, 2, 3, 1)  # BCHW -> BHWC
        resized = resize_with_pad_torch(images * 2.0 - 1.0, SIZE, SIZE)
        out[f"resized/observation.images.{camera}"] = resized.permute(0, 3, 1, 2).numpy()
    return out


def main(out: Path) -> None:
    root = out / "tiny"
    if root.exists():
        shutil.rmtree(root)
    write_dataset(root)
    ref = reference(root)
    stats = degenerate(LeRobotDataset("zerojax/tiny", root=root).meta.stats)
    (out / "degenerate_stats.json").write_text(json.dumps({k: {s: v.tolist() for s, v in d.items()}
                                                          for k, d in stats.items()}, indent=1))
    np.savez_compressed(out / "reference.npz", indices=np.asarray(INDICES), horizon=HORIZON, size=SIZE, **ref)
    print(json.dumps({k: [list(v.shape), str(v.dtype)] for k, v in ref.items()}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
