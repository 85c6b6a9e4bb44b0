"""π0's memory story, compiled: the table a lab reads before renting GPUs (README "π0",
BENCHMARKS.md "π0's compiled peaks").

For configs/pi0.yaml (Ψ = 3.24B; batch 32, one 224² camera, H = 50, remat full) it runs
`zerojax analyze --json` (the step compiled on simulated CPU devices, nothing run) for

- full fine-tuning and LoRA (`optim.lora.rank=16`), stages 0 and 3, on 1, 2, 4 and 8 devices;
- full fine-tuning at stage 3 with `zero.offload=optimizer` and `optimizer+master`, on 1-8;

then, for 24, 48 and 80 GB cards, the smallest of those device counts whose compiled peak fits
the card's budget, with and without offload. The budget is `zerojax plan`'s: what JAX may use
of the card (XLA_PYTHON_CLIENT_MEM_FRACTION, default 0.75) less a 1 GB margin; the table also
gives it at 0.95 (what users set to give JAX the card).

    python scripts/bench/pi0_memory.py --out runs/pi0_memory.json     # about 25 compiles, ~1 min each here
    python scripts/bench/pi0_memory.py --out runs/pi0_memory.json --markdown   # the tables from the JSON

The JSON is rewritten after each compile, and a rerun skips what it holds, so a cut-short run
resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from zerojax.config.devices import GB, budget_bytes  # noqa: E402 - after the checkout's path

CONFIG = "configs/pi0.yaml"
# The batch's keys only (π0 reads a LeRobot dataset's features; the tiny one names one camera).
DATA = ("data.source=lerobot:tests/fixtures/lerobot/tiny", "data.cameras=observation.images.front")
DEVICES = (1, 2, 4, 8)
CARDS_GB = (24, 48, 80)
MARGIN_GB = 1.0
RUNS = {  # name -> (overrides, stages)
    "full": ((), (0, 3)),
    "lora16": (("optim.lora.rank=16",), (0, 3)),
    "full+offload=optimizer": (("zero.offload=optimizer",), (3,)),
    "full+offload=optimizer+master": (("zero.offload=optimizer+master",), (3,)),
}


def key(name: str, devices: int) -> str:
    return f"{name}@{devices}"


def analyze(overrides, stages, devices: int) -> dict:
    """One `zerojax analyze --json` in its own process (a fresh backend for each device count)."""
    stages = stages[:1] if devices == 1 else stages  # one device shards nothing: stage 0 is stage 3
    cmd = [sys.executable, "-m", "zerojax", "analyze", "--config", CONFIG, "--json",
           "--stages", ",".join(map(str, stages)), f"mesh.cpu_devices={devices}", *DATA, *overrides]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"pi0_memory: {' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    doc = json.loads(done.stdout)
    rows = {}
    for stage, row in doc["stages"].items():
        rows[stage] = {"peak_bytes": row["peak_bytes"], "formula_bytes": row["formula_bytes"],
                       "host_argument_bytes": row.get("host_argument_bytes", 0)}
    return {"params": doc["params"], "stages": rows, "wall_s": round(time.perf_counter() - start, 1)}


def stage_row(entry: dict, stage: int) -> dict:
    """The row of `stage` (one device: its only compile, the first stage asked for)."""
    return entry["stages"].get(str(stage)) or next(iter(entry["stages"].values()))


def smallest(doc: dict, name: str, budget: float):
    for n in DEVICES:
        if stage_row(doc["runs"][key(name, n)], 3)["peak_bytes"] <= budget:
            return n
    return None


def gb(x: float) -> str:
    return f"{x / GB:.1f}"


def markdown(doc: dict) -> str:
    """Two tables: per device, the model states (the formula) and the compiled peak; then the
    smallest device count per card, at JAX's default share of the card and at 0.95 of it."""
    runs = doc["runs"]
    out = ["| devices | full, stage 0: states / peak | full, stage 3 | LoRA r16, stage 0 | LoRA r16, stage 3 "
           "| full, stage 3, offload=optimizer: peak (+ host) | offload=optimizer+master |",
           "|---|---|---|---|---|---|---|"]
    for n in DEVICES:
        cells = []
        for name, stage in (("full", 0), ("full", 3), ("lora16", 0), ("lora16", 3)):
            row = stage_row(runs[key(name, n)], stage)
            cells.append(f"{gb(row['formula_bytes'])} / {gb(row['peak_bytes'])} GB")
        for name in ("full+offload=optimizer", "full+offload=optimizer+master"):
            row = stage_row(runs[key(name, n)], 3)
            cells.append(f"{gb(row['peak_bytes'])} GB (+ {gb(row['host_argument_bytes'])} GB)")
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    options = ("full", "full+offload=optimizer", "full+offload=optimizer+master")
    out += ["", "| card | budget | full, no offload | offload=optimizer | offload=optimizer+master |",
            "|---|---|---|---|---|"]
    for card in CARDS_GB:
        for fraction in (doc.get("mem_fraction", 0.75), 0.95):
            budget = budget_bytes(card * GB, MARGIN_GB * GB, fraction)
            cells = []
            for name in options:
                n = smallest(doc, name, budget)
                cells.append(f"{n} device{'s' * (n != 1)}" if n else f"more than {DEVICES[-1]}")
            out.append(f"| {card} GB | {gb(budget)} GB ({fraction:g} x card - {MARGIN_GB:g} GB) | "
                       + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "pi0_memory.json")
    parser.add_argument("--markdown", action="store_true", help="print the tables of --out, compile nothing")
    opts = parser.parse_args(argv)
    doc = json.loads(opts.out.read_text()) if opts.out.is_file() else {"config": CONFIG, "runs": {}}
    if not opts.markdown:
        doc["mem_fraction"] = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
        for name, (overrides, stages) in RUNS.items():
            for n in DEVICES:
                if key(name, n) in doc["runs"]:
                    continue
                doc["runs"][key(name, n)] = entry = analyze(overrides, stages, n)
                print(f"{key(name, n)}: " + ", ".join(f"stage {s} peak {gb(r['peak_bytes'])} GB"
                                                      for s, r in entry["stages"].items())
                      + f" ({entry['wall_s']} s)", file=sys.stderr, flush=True)
                opts.out.parent.mkdir(parents=True, exist_ok=True)
                tmp = opts.out.with_suffix(".tmp")
                tmp.write_text(json.dumps(doc, indent=1))
                tmp.replace(opts.out)
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
