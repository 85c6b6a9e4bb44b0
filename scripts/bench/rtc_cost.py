#!/usr/bin/env python3
"""The server's time per request of real-time chunking's kinds, side by side in one run on one
policy: no RTC, inference-time RTC (LeRobot's guidance, and the paper's through a vector-Jacobian
product), and training-time RTC (the first d actions given, `model.action.train_delay`). Each
request carries the previous chunk's leftover and `inference_delay` = d. Prints the median and the
95th percentile of `ServedPolicy.infer` (observation in, actions out; no websocket) over R requests
after the warm-up, the kinds interleaved request by request, as a Markdown table.

    .venv/bin/python scripts/bench/rtc_cost.py [--requests 50] [--delay 2]

The policy is the tiny LeRobot π0 of tests/fixtures/lerobot/pi0 (two cameras, chunks of 4, 10 Euler
steps), or `--policy RUN_DIR` a run's; the leftover is the last H - d actions of a chunk.
The cost of a kind does not depend on the weights, so the training-time row serves the same
weights with train_delay set (what a run trained with model.action.train_delay=d would run): it
times the sampler, it says nothing of the actions' quality. zerojax's own venv runs it; this
checkout goes first on sys.path.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from zerojax.serve import loaders  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "lerobot"
KINDS = {"none": {}, "inference-time RTC (LeRobot's)": {}, "inference-time RTC (Jacobian)": {"rtc_jacobian": True},
         "training-time RTC": {}}


def observation(served, rng) -> dict:
    obs = {"observation.state": rng.standard_normal(served.state_dim).astype(np.float32), "prompt": "pick up the cube"}
    obs.update({c: rng.integers(0, 256, served.observations.features[c]["shape"], dtype=np.uint8) for c in served.cameras})
    return obs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--delay", type=int, default=2)  # the fixture's chunks are 4 long
    parser.add_argument("--policy", help="a run directory or export (default: the LeRobot fixture)")
    args = parser.parse_args()
    if args.policy:
        target, where = Path(args.policy), {}
    else:
        target, where = FIXTURE / "pi0", {"tokenizer": str(FIXTURE / "pi0_tokenizer.json"), "vision_heads": 2}
    policies, rng = {}, np.random.default_rng(0)
    for kind, extra in KINDS.items():
        served = loaders.load(target, num_steps=10, **where, **extra)
        served.train_delay = args.delay if kind == "training-time RTC" else 0  # before the first trace
        leftover = served.infer(observation(served, rng), 0)["actions"][args.delay:]
        asked = {} if kind == "none" else {"prev_actions": leftover, "inference_delay": args.delay}
        served.infer({**observation(served, rng), **asked}, 1)  # compiles
        policies[kind] = served, asked
    # the kinds interleaved, request by request, so that the machine's other load falls on all alike
    times = {kind: [] for kind in KINDS}
    for request in range(args.requests):
        obs = observation(served, rng)
        for kind in list(KINDS)[request % len(KINDS):] + list(KINDS)[:request % len(KINDS)]:
            served, asked = policies[kind]
            start = time.perf_counter()
            served.infer({**obs, **asked}, request)
            times[kind].append((time.perf_counter() - start) * 1e3)
    print(f"| kind (d = {args.delay}) | median ms | p95 ms |")
    print("|---|---|---|")
    for kind, ms in times.items():
        print(f"| {kind} | {np.median(ms):.2f} | {np.percentile(ms, 95):.2f} |")

if __name__ == "__main__":
    main()
