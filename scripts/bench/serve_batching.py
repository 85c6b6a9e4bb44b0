#!/usr/bin/env python3
"""`zerojax serve` one request at a time against batched (`--max-batch N`), side by side in one run:
C clients connected at once, each sending R observations in a row (a fleet of robots), against a
server of each kind on the same policy. Prints requests/s over the whole run and each request's
latency (send to answer) at the median and the 95th percentile, as a Markdown table.

    .venv/bin/python scripts/bench/serve_batching.py [--clients 8] [--requests 30] [--max-batch 8]

The policy is the tiny LeRobot π0 of tests/fixtures/lerobot/pi0 (two cameras, 10 Euler steps),
or `--policy DIR --tokenizer FILE --vision-heads N` for another LeRobot checkpoint directory.
zerojax's own venv runs it; this checkout goes first on sys.path.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import websockets.sync.client  # noqa: E402

from zerojax.serve import loaders  # noqa: E402
from zerojax.serve import server, wire  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "lerobot"


def observation(meta: dict, rng) -> dict:
    obs = {"prompt": "pick up the cube"}
    for key, spec in meta["observation"].items():
        if key != "prompt":
            obs[key] = (rng.integers(0, 256, spec["shape"], dtype=np.uint8) if spec["dtype"] == "uint8"
                        else rng.standard_normal(spec["shape"]).astype(np.float32))
    return obs


def fleet(port: int, clients: int, requests: int) -> tuple[float, list[float]]:
    """(requests/s, every request's latency in ms) of `clients` robots asking at once."""
    latencies, barrier = [], threading.Barrier(clients + 1)

    def robot(i):
        with websockets.sync.client.connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None) as ws:
            meta = wire.unpack(ws.recv())
            rng = np.random.default_rng(i)
            barrier.wait()
            for _ in range(requests):
                message = wire.pack(observation(meta, rng))
                start = time.perf_counter()
                ws.send(message)
                reply = ws.recv()
                latencies.append((time.perf_counter() - start) * 1e3)
                assert not isinstance(reply, str), reply

    threads = [threading.Thread(target=robot, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return clients * requests / (time.perf_counter() - start), latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--policy", default=str(FIXTURE / "pi0"))
    parser.add_argument("--tokenizer", default=str(FIXTURE / "pi0_tokenizer.json"))
    parser.add_argument("--vision-heads", type=int, default=2)
    args = parser.parse_args()
    print(f"{args.clients} clients x {args.requests} requests, {args.policy}\n")
    print("| server | requests/s | latency p50 (ms) | latency p95 (ms) | compile at start (s) |")
    print("|---|---|---|---|---|")
    for max_batch in (1, args.max_batch):
        served = loaders.load(Path(args.policy), num_steps=10, tokenizer=args.tokenizer,
                                 vision_heads=args.vision_heads, max_batch=max_batch)
        srv = server.PolicyServer(served, port=0)
        port = srv.start()
        try:
            fleet(port, 2, 2)  # the connection path warm
            rate, latencies = fleet(port, args.clients, args.requests)
        finally:
            srv.stop()
        p95 = float(np.percentile(latencies, 95))
        name = "one at a time (default)" if max_batch == 1 else f"`--max-batch {max_batch}`"
        print(f"| {name} | {rate:.1f} | {statistics.median(latencies):.1f} | {p95:.1f} | {served.compile_s:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
