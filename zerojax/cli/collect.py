"""`zerojax collect`: Meta-World's scripted experts' successful episodes written as a LeRobot
v3.0 dataset (zerojax.sim.collect), which `data.source=lerobot:DIR` trains a policy (π0, π0.5, SmolVLA) on and
`zerojax rollout` then scores. Needs the sim extra, checked before anything is written."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from zerojax.cli.args import Parser

HELP = "Meta-World's scripted experts' episodes as a LeRobot v3.0 dataset (the sim extra), for training a policy (π0, π0.5, SmolVLA)"


def arguments(collect: Parser) -> None:
    collect.add_argument("--tasks", required=True, help="Meta-World tasks, comma-separated (reach-v3,drawer-close-v3)")
    collect.add_argument("--episodes", type=int, required=True, help="successful expert episodes per task")
    collect.add_argument("--out", type=Path, required=True, help="a new directory for the dataset")
    collect.add_argument("--size", type=int, default=64, help="the camera's height and width (default 64)")
    collect.add_argument("--seed", type=int, default=0, help="the first episode's seed (default 0)")
    collect.add_argument("--camera", default="corner2", help="the Meta-World camera recorded, as "
                         "observation.images.CAMERA: corner, corner2 (default: LeRobot's, moved as LeRobot moves it), "
                         "corner3, topview, behindGripper or gripperPOV")


def run(args) -> int:
    from zerojax import sim

    sim.require("collect")
    from zerojax.sim import collect

    start = time.perf_counter()
    summary = collect.collect([t for t in args.tasks.split(",") if t], args.episodes, args.out, args.size, args.seed,
                              log=lambda message, **_: print(f"zerojax: {message}", file=sys.stderr), camera=args.camera)
    print(f"zerojax: wrote {args.out}: {summary['episodes']} episodes, {summary['frames']} frames in "
          f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0
