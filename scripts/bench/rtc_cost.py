#!/usr/bin/env python3
"""The server's time per request of real-time chunking's kinds, side by side in one run on one
policy: no RTC, inference-time RTC (LeRobot's guidance, and the paper's through a vector-Jacobian
product), and training-time RTC (the first d actions given, `model.action.train_delay`). Each
request carries the previous chunk's leftover and `inference_delay` = d. Prints the median and the
95th percentile of `ServedPolicy.infer` (observation in, actions out; no websocket) over R requests
after the warm-up, as a Markdown table.

    .venv/bin/python scripts/bench/rtc_cost.py [--requests 50] [--delay 4]

The policy is the tiny LeRobot π0 of tests/fixtures/lerobot/pi0 (two cameras, 10 Euler steps).
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
    obs.update({c: rng.integers(0, 256, served.features[c]["shape"], dtype=np.uint8) for c in served.cameras})
    return obs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--delay", type=int, default=4)
    args = parser.parse_args()
    print(f"| kind (d = {args.delay}) | median ms | p95 ms |")
    print("|---|---|---|")
    for kind, extra in KINDS.items():
        served = loaders.load(FIXTURE / "pi0", num_steps=10, tokenizer=str(FIXTURE / "pi0_tokenizer.json"),
                              vision_heads=2, **extra)
        served.train_delay = args.delay if kind == "training-time RTC" else 0  # before the first trace
        rng = np.random.default_rng(0)
        obs = observation(served, rng)
        leftover = served.infer(obs, 0)["actions"][args.delay:]
        asked = {} if kind == "none" else {"prev_actions": leftover, "inference_delay": args.delay}
        served.infer({**obs, **asked}, 1)  # compiles
        times = []
        for request in range(args.requests):
            start = time.perf_counter()
            served.infer({**observation(served, rng), **asked}, request)
            times.append((time.perf_counter() - start) * 1e3)
        print(f"| {kind} | {np.median(times):.1f} | {np.percentile(times, 95):.1f} |")


if __name__ == "__main__":
    main()
