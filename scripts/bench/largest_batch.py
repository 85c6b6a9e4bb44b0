"""The largest global batch whose compiled peak fits each card, per recipe, on one config
(BENCHMARKS.md "SmolVLA on one card").

    python scripts/bench/largest_batch.py --config configs/smolvla.yaml --cards 8,12,24 \
        --recipe full= --recipe vlm=optim.freeze=vlm --out DIR [KEY=VALUE ...]

Each point is one `zerojax analyze --config CONFIG --stages S --json KEY=VALUE... RECIPE
train.global_batch=B`, its JSON kept as DIR/mem_<recipe>_<B>.json (a point already there is not
compiled again). For each card of N GB and each --fractions f, the budget is `zerojax plan`'s,
f x N·10⁹ − 1 GB (its default margin): the search takes secant steps between the compiled
points around it until the largest batch that fits and the smallest that does not are adjacent.
Prints one JSON line per cell, then the compiled points.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class Points:
    """The compiled peaks of one recipe, batch -> bytes, compiling a batch on first use."""

    def __init__(self, opts, name: str, overrides: list[str]):
        self.opts, self.name, self.overrides = opts, name, overrides

    def path(self, batch: int) -> Path:
        return Path(self.opts.out) / f"mem_{self.name}_{batch}.json"

    def known(self) -> dict[int, int]:
        out = {}
        for p in Path(self.opts.out).glob(f"mem_{self.name}_*.json"):
            if p.stat().st_size:
                out[int(p.stem.rsplit("_", 1)[1])] = json.loads(p.read_text())["stages"][self.opts.stages]["peak_bytes"]
        return out

    def peak(self, batch: int) -> int:
        if not self.path(batch).is_file():
            cmd = [sys.executable, "-m", "zerojax", "analyze", "--config", self.opts.config, "--stages",
                   self.opts.stages, "--json", *self.opts.overrides, *self.overrides, f"train.global_batch={batch}"]
            start = time.time()
            out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"largest_batch: {' '.join(cmd)} exited {out.returncode}:\n{out.stderr[-2000:]}")
            self.path(batch).write_text(out.stdout)
            print(f"compiled {self.name} batch {batch} in {time.time() - start:.0f} s", file=sys.stderr, flush=True)
        return self.known()[batch]


def largest(points: Points, budget: float) -> int:
    """The largest batch whose peak is within `budget` (0: not even one row)."""
    while True:
        pts = points.known() or {1: points.peak(1)}
        fit = max([b for b, p in pts.items() if p <= budget], default=0)
        over = min([b for b, p in pts.items() if p > budget and b > fit], default=None)
        if fit == 0 and 1 in pts:
            return 0
        if over is not None and over - fit <= 1:
            return fit
        lo = fit or 1
        hi = over if over is not None else 2 * max(pts)
        plo, phi = points.peak(lo), points.peak(hi)
        guess = lo + int((budget - plo) / max(phi - plo, 1) * (hi - lo))  # the secant's batch
        guess = min(max(guess, lo + 1), hi - 1) if hi - lo > 1 else hi
        points.peak(guess)
        if guess + 1 < hi:
            points.peak(guess + 1)  # usually brackets it at once


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--cards", default="8,12,24", help="card sizes in GB")
    parser.add_argument("--fractions", default="0.75,0.95", help="JAX's share of the card")
    parser.add_argument("--margin-gb", type=float, default=1.0, help="kept free, as zerojax plan's --margin")
    parser.add_argument("--stages", default="3")
    parser.add_argument("--recipe", action="append", required=True, metavar="NAME=KEY=VALUE,...",
                        help="a recipe's name and its overrides, comma-separated (NAME= for none)")
    parser.add_argument("--out", required=True, help="where each compiled point's JSON is kept")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    opts = parser.parse_args(argv)
    Path(opts.out).mkdir(parents=True, exist_ok=True)
    recipes = {}
    for spec in opts.recipe:
        name, _, keys = spec.partition("=")
        recipes[name] = [k for k in keys.split(",") if k]
    for name, keys in recipes.items():
        points = Points(opts, name, keys)
        for card in map(float, opts.cards.split(",")):
            for fraction in map(float, opts.fractions.split(",")):
                budget = fraction * card * 1e9 - opts.margin_gb * 1e9
                b = largest(points, budget)
                pts = points.known()
                print(json.dumps({"recipe": name, "card_gb": card, "fraction": fraction, "budget_bytes": budget,
                                  "largest_batch": b, "peak_bytes": pts.get(b), "next_peak_bytes": pts.get(b + 1)}),
                      flush=True)
        print(json.dumps({"recipe": name, "points": dict(sorted(points.known().items()))}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
