"""`zerojax stats` against LeRobot 0.6.1's augment_dataset_quantile_stats on the same dataset, side by
side in one run (BENCHMARKS.md, "Dataset statistics"): seconds for each, their ratio, and how far
apart their numbers are.

    python scripts/bench/bench_stats.py [--dataset DIR] [--episodes 60 --frames 400 --width 14 --camera 32]
                                  [--lerobot-python /work/lr06venv/bin/python] [--json]

zerojax's venv runs it; LeRobot's side runs as a subprocess in LeRobot 0.6.1's venv (LeRobot and
torch are never zerojax's dependencies), and so does writing the dataset where DIR does not exist
yet (LeRobot's own `LeRobotDataset.create` / `add_frame` / `save_episode` / `finalize`: codebase
v3.0; `observation.state` and `action` of --width floats, a random walk per episode, and, with
--camera S, one camera of S x S PNG images in the Parquet; the default DIR is under
~/.cache/zerojax/bench, keyed by the size).

- LeRobot: `LeRobotDataset(root=DIR)`, `compute_quantile_stats_for_dataset` (what the script runs
  before pushing to the hub; its threads: LEROBOT_STATS_MAX_WORKERS, default 16, as it ships) and
  `write_stats` into a scratch directory; timed from loading the dataset to the file written,
  torch's and LeRobot's import excluded.
- zerojax: `zerojax.data.lerobot.stats.compute` and `write` (what `zerojax stats DIR --out PATH` does),
  one process; timed likewise, its import excluded.

Each side runs --repeat times (the best is kept; the first also warms the page cache for both).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LEROBOT_PYTHON = "/work/lr06venv/bin/python"
FPS = 30


def write_dataset(root: Path, episodes: int, frames: int, width: int, camera: int) -> None:
    """LeRobot's own writer (run in LeRobot's venv)."""
    import numpy as np
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    features = {"observation.state": {"dtype": "float32", "shape": (width,), "names": None},
                "action": {"dtype": "float32", "shape": (width,), "names": None}}
    if camera:
        features["observation.images.cam"] = {"dtype": "image", "shape": (camera, camera, 3),
                                              "names": ["height", "width", "channels"]}
    rng = np.random.default_rng(0)
    dataset = LeRobotDataset.create("zerojax/bench_stats", FPS, features, root=root, robot_type="toy",
                                    use_videos=False)
    for episode in range(episodes):
        state = rng.normal(0, 1, width).astype(np.float32)
        for t in range(frames):
            action = rng.normal(0, 0.1, width).astype(np.float32)
            frame = {"observation.state": state.copy(), "action": action, "task": f"task {episode % 3}"}
            if camera:
                frame["observation.images.cam"] = rng.integers(0, 256, (camera, camera, 3), dtype=np.uint8)
            dataset.add_frame(frame)
            state += action
        dataset.save_episode()
    dataset.finalize()


def run_lerobot(root: Path, repeat: int) -> dict:
    import numpy as np
    import lerobot
    from lerobot.datasets import LeRobotDataset, write_stats
    from lerobot.scripts.augment_dataset_quantile_stats import compute_quantile_stats_for_dataset

    best, out = float("inf"), tempfile.mkdtemp()
    for _ in range(repeat):
        start = time.perf_counter()
        dataset = LeRobotDataset(repo_id="zerojax/bench_stats", root=root)
        stats = compute_quantile_stats_for_dataset(dataset, use_sampling=True)
        write_stats(stats, Path(out))
        best = min(best, time.perf_counter() - start)
    doc = {k: {s: np.asarray(v).tolist() for s, v in d.items()} for k, d in stats.items()}
    return {"seconds": best, "stats": doc, "lerobot": lerobot.__version__,
            "workers": int(os.environ.get("LEROBOT_STATS_MAX_WORKERS", 16))}


def run_zerojax(root: Path, repeat: int) -> dict:
    from zerojax.data.lerobot import stats

    best, out = float("inf"), Path(tempfile.mkdtemp()) / "stats.json"
    for _ in range(repeat):
        start = time.perf_counter()
        result = stats.compute(root)
        stats.write(result, out)
        best = min(best, time.perf_counter() - start)
    return {"seconds": best, "stats": json.loads(out.read_text())}


def lerobot_side(python: str, *args: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    proc = subprocess.run([python, __file__, *args], env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"LeRobot's side failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def farthest(a: dict, b: dict) -> dict:
    """Per statistic, the largest |a - b| / max(1, |b|) over features and dimensions."""
    import numpy as np

    out = {}
    for key in b:
        for name, want in b[key].items():
            got, want = np.asarray(a[key][name], np.float64), np.asarray(want, np.float64)
            err = float(np.max(np.abs(got - want) / np.maximum(1, np.abs(want))))
            out[name] = max(out.get(name, 0.0), err)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", type=Path)
    p.add_argument("--episodes", type=int, default=60)
    p.add_argument("--frames", type=int, default=400)
    p.add_argument("--width", type=int, default=14)
    p.add_argument("--camera", type=int, default=32, help="S: one camera of S x S images (0: none)")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--lerobot-python", default=LEROBOT_PYTHON)
    p.add_argument("--json", action="store_true")
    p.add_argument("--side", choices=["write", "lerobot"], help=argparse.SUPPRESS)  # LeRobot's venv
    args = p.parse_args()
    key = f"e{args.episodes}_f{args.frames}_w{args.width}_c{args.camera}"
    root = args.dataset or Path.home() / ".cache" / "zerojax" / "bench" / f"stats_{key}"
    if args.side == "write":
        write_dataset(root, args.episodes, args.frames, args.width, args.camera)
        print(json.dumps({"written": str(root)}))
        return
    if args.side == "lerobot":
        print(json.dumps(run_lerobot(root, args.repeat)))
        return
    sizes = ["--episodes", str(args.episodes), "--frames", str(args.frames), "--width", str(args.width),
             "--camera", str(args.camera), "--dataset", str(root)]
    if not (root / "meta" / "info.json").is_file():
        lerobot_side(args.lerobot_python, "--side", "write", *sizes)
    lerobot = lerobot_side(args.lerobot_python, "--side", "lerobot", "--repeat", str(args.repeat), *sizes)
    zerojax = run_zerojax(root, args.repeat)
    result = {"dataset": str(root), "frames": args.episodes * args.frames, "episodes": args.episodes,
              "mb": round(sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) / 2 ** 20, 1),
              "lerobot_s": round(lerobot["seconds"], 3), "zerojax_s": round(zerojax["seconds"], 3),
              "ratio": round(lerobot["seconds"] / zerojax["seconds"], 2),
              "farthest": farthest(zerojax["stats"], lerobot["stats"]), "lerobot": lerobot["lerobot"],
              "lerobot_workers": lerobot["workers"], "python": platform.python_version(),
              "cpus": os.cpu_count(), "load": os.getloadavg()[0]}
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
