"""Samples/s of zerojax's LeRobot loader against LeRobot's own `LeRobotDataset` with a torch
`DataLoader`, on the same dataset, with the same H-step action chunks, normalization and image
size, in one run (BENCHMARKS.md, "Loading LeRobot datasets").

    python scripts/bench/bench_data.py [--dataset DIR] [--episodes 12 --frames 100 --cameras 2 --video-size 224]
                                 [--horizon 50 --image-size 224 --batch 32 --seconds 30]
                                 [--lerobot-python /work/lerobotvenv/bin/python] [--json]

zerojax's venv runs it; LeRobot's side runs as a subprocess in LeRobot's venv (torch and LeRobot
are never zerojax's dependencies), and so does writing the dataset where DIR does not exist yet
(LeRobot's own `LeRobotDataset.create` / `add_frame` / `save_episode`, as
scripts/fixtures/make_lerobot_dataset.py writes the test fixture; the default DIR is under
~/.cache/zerojax/bench, keyed by the size). Both sides produce, per sample: the state normalized
(mean/std from meta/stats.json), the action chunk of `--horizon` steps normalized likewise, with
its padding mask, and every camera frame in [-1, 1] resized with padding to `--image-size`.

- zerojax: `data.source=lerobot:DIR`'s source (zerojax/data/lerobot/source.py), `rows` for successive
  steps of `--batch` frames, as the run loop asks for them (its prefetch builds step s + 1 while
  step s is taken); the prompt is tokenized too (bytes), which LeRobot's side does not do.
- LeRobot: `LeRobotDataset(delta_timestamps={"action": [0, 1/fps, ...]})` in a
  `DataLoader(batch_size=--batch, shuffle=True, num_workers=cores)`, each batch then through
  LeRobot's `NormalizerProcessorStep` (mean/std) and pi0's `resize_with_pad_torch`, as LeRobot's
  training applies them to the batch the loader gives it.

Each side runs for about `--seconds` after a warm-up (the first batches: worker start-up, file
opening), and its samples/s is counted over whole batches. `--smoke` runs zerojax's side alone
on a dataset given with --dataset, for a few batches (tests/test_lerobot.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LEROBOT_PYTHON = "/work/lerobotvenv/bin/python"
FPS = 10
TASKS = ("pick up the red cube", "open the drawer", "push the block to the goal")


# -- the dataset, written with LeRobot's own writer (LeRobot's venv) ----------------------------------------

def write_dataset(root: Path, episodes: int, frames: int, cameras: int, size: int) -> None:
    import numpy as np
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    image = {"dtype": "video", "shape": (size, size, 3), "names": ["height", "width", "channels"]}
    features = {"observation.state": {"dtype": "float32", "shape": (8,), "names": None},
                "action": {"dtype": "float32", "shape": (7,), "names": None},
                **{f"observation.images.cam{c}": image for c in range(cameras)}}
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size]
    dataset = LeRobotDataset.create("zerojax/bench", FPS, features, root=root, robot_type="toy", use_videos=True)
    for episode in range(episodes):
        for t in range(frames):
            frame = {"observation.state": rng.normal(episode, 1, 8).astype(np.float32),
                     "action": rng.normal(0, 1, 7).astype(np.float32), "task": TASKS[episode % len(TASKS)]}
            for c in range(cameras):  # a scene that moves, with some texture for the codec to keep
                base = np.stack([(xx + 3 * t + 40 * c) % 256, (yy + 2 * t + 30 * episode) % 256,
                                 (xx + yy + 5 * t) % 256], -1)
                noise = rng.integers(0, 24, (size // 8, size // 8, 3)).repeat(8, 0).repeat(8, 1)
                frame[f"observation.images.cam{c}"] = ((base + noise) % 256).astype(np.uint8)
            dataset.add_frame(frame)
        dataset.save_episode()
    dataset.finalize()


# -- LeRobot's loader (LeRobot's venv) ------------------------------------------------------------------------

def run_lerobot(root: Path, horizon: int, image_size: int, batch: int, seconds: float, workers: int) -> dict:
    import torch
    from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from lerobot.policies.pi0.modeling_pi0 import resize_with_pad_torch
    from lerobot.processor.core import TransitionKey
    from lerobot.processor.normalize_processor import NormalizerProcessorStep

    delta = {"action": [i / FPS for i in range(horizon)]}
    meta = LeRobotDataset("zerojax/bench", root=root).meta
    backend = os.environ.get("BENCH_VIDEO_BACKEND", "pyav")  # torchcodec finds no system FFmpeg here
    dataset = LeRobotDataset("zerojax/bench", root=root, delta_timestamps=delta, video_backend=backend)
    cameras = [k for k in meta.features if k.startswith("observation.images.")]
    features = {"observation.state": PolicyFeature(FeatureType.STATE, tuple(meta.features["observation.state"]["shape"])),
                "action": PolicyFeature(FeatureType.ACTION, tuple(meta.features["action"]["shape"]))}
    normalize = NormalizerProcessorStep(features=features, stats=meta.stats,
                                        norm_map={FeatureType.STATE: NormalizationMode.MEAN_STD,
                                                  FeatureType.ACTION: NormalizationMode.MEAN_STD})
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers,
                                         drop_last=True, persistent_workers=workers > 0,
                                         generator=torch.Generator().manual_seed(0))

    def batches():
        while True:
            yield from loader

    def process(b):
        out = normalize({TransitionKey.OBSERVATION: {"observation.state": b["observation.state"]},
                         TransitionKey.ACTION: b["action"]})
        images = [resize_with_pad_torch(b[c].permute(0, 2, 3, 1) * 2.0 - 1.0, image_size, image_size).permute(0, 3, 1, 2)
                  for c in cameras]  # BCHW -> BHWC (what it resizes) -> BCHW, as LeRobot's pi0 does
        return out, images, b["action_is_pad"]

    shapes = measure(batches(), process, batch, seconds,
                     lambda r: {"action": list(r[0][TransitionKey.ACTION].shape),
                                "image": list(r[1][0].shape), "action_is_pad": list(r[2].shape)})
    return {**shapes, "workers": workers, "video_backend": dataset.video_backend, "lerobot": version("lerobot"),
            "torch": torch.__version__}


# -- zerojax's loader (zerojax's venv) ------------------------------------------------------------------------

def zerojax_source(root: Path, horizon: int, image_size: int, batch: int):
    from zerojax import config
    from zerojax.data import sources

    cfg = config.load(overrides=[f"data.source=lerobot:{root}", f"data.action_horizon={horizon}",
                                 f"data.image_size={image_size}", "data.norm_state=mean_std",
                                 "data.norm_action=mean_std", "data.val_fraction=0", f"train.global_batch={batch}",
                                 "model.family=gpt", "mesh.cpu_devices=1"])
    return sources.open_source(cfg)


def run_zerojax(root: Path, horizon: int, image_size: int, batch: int, seconds: float) -> dict:
    src = zerojax_source(root, horizon, image_size, batch)
    everything = slice(0, batch)

    def batches():
        step = 0
        while True:
            yield src.rows(0, step, everything)
            step += 1

    result = measure(batches(), lambda b: b, batch, seconds,
                     lambda b: {"action": list(b["action"].shape), "image": list(b[src.cameras[0]].shape),
                                "action_is_pad": list(b["action_is_pad"].shape)})
    return {**result, "threads": src.prefetch.workers, "zerojax": version("zerojax")}


# -- shared --------------------------------------------------------------------------------------------------

def measure(batches, process, batch: int, seconds: float, shapes) -> dict:
    """Samples/s over whole batches for about `seconds`, after a warm-up of two batches (or a
    quarter of the time, whichever is longer)."""
    start = time.perf_counter()
    for i, b in enumerate(batches):
        last = process(b)
        if i >= 1 and time.perf_counter() - start >= seconds / 4:
            break
    timed_start, n = time.perf_counter(), 0
    for b in batches:
        last = process(b)
        n += 1
        if time.perf_counter() - timed_start >= seconds:
            break
    elapsed = time.perf_counter() - timed_start
    return {"samples_per_s": n * batch / elapsed, "batches": n, "seconds": elapsed, "shapes": shapes(last)}


def version(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


def default_dataset(a) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "zerojax" / "bench" / f"lerobot-{a.episodes}x{a.frames}-{a.cameras}cam-{a.video_size}"


def in_lerobot_venv(a, *args: str) -> dict:
    out = subprocess.run([a.lerobot_python, __file__, *args], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"bench_data: {' '.join(args[:1])} in {a.lerobot_python} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", nargs="?", default="compare", choices=("compare", "write", "lerobot"),
                   help="compare (default); write and lerobot run in LeRobot's venv (called by compare)")
    p.add_argument("--dataset", type=Path)
    p.add_argument("--episodes", type=int, default=12)
    p.add_argument("--frames", type=int, default=100, help="frames per episode")
    p.add_argument("--cameras", type=int, default=2)
    p.add_argument("--video-size", type=int, default=224, help="the cameras' height and width as stored")
    p.add_argument("--horizon", type=int, default=50)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="LeRobot's DataLoader workers")
    p.add_argument("--lerobot-python", default=LEROBOT_PYTHON)
    p.add_argument("--smoke", action="store_true", help="zerojax's side only, a few batches")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    root = a.dataset or default_dataset(a)
    if a.mode == "write":
        write_dataset(root, a.episodes, a.frames, a.cameras, a.video_size)
        print(json.dumps({"written": str(root)}))
        return
    if a.mode == "lerobot":
        print(json.dumps(run_lerobot(root, a.horizon, a.image_size, a.batch, a.seconds, a.workers)))
        return
    if a.smoke:
        if a.dataset is None:
            sys.exit("bench_data: --smoke needs --dataset DIR")
        print(json.dumps({"zerojax": run_zerojax(root, a.horizon, a.image_size, a.batch, a.seconds)}))
        return
    size = ["--episodes", str(a.episodes), "--frames", str(a.frames), "--cameras", str(a.cameras),
            "--video-size", str(a.video_size), "--dataset", str(root)]
    if not (root / "meta" / "info.json").is_file():
        print(f"bench_data: writing {root} with LeRobot ({a.lerobot_python})", file=sys.stderr)
        in_lerobot_venv(a, "write", *size)
    common = ["--horizon", str(a.horizon), "--image-size", str(a.image_size), "--batch", str(a.batch),
              "--seconds", str(a.seconds)]
    result = {"dataset": str(root), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "date": time.strftime("%Y-%m-%d"), "horizon": a.horizon, "image_size": a.image_size, "batch": a.batch}
    result["zerojax"] = run_zerojax(root, a.horizon, a.image_size, a.batch, a.seconds)
    result["lerobot"] = in_lerobot_venv(a, "lerobot", *size, *common, "--workers", str(a.workers))
    result["ratio"] = result["zerojax"]["samples_per_s"] / result["lerobot"]["samples_per_s"]
    if a.json:
        print(json.dumps(result))
        return
    print(f"{root}: H={a.horizon}, {a.image_size}x{a.image_size}, batches of {a.batch}")
    for side in ("zerojax", "lerobot"):
        r = result[side]
        print(f"  {side:8s} {r['samples_per_s']:8.1f} samples/s ({r['batches']} batches in {r['seconds']:.1f} s)")
    print(f"  zerojax / lerobot: {result['ratio']:.2f}x")


if __name__ == "__main__":
    main()
