"""A policy's memory story, compiled: the table a lab reads before renting GPUs (docs/models/pi0.md and
pi05.md, BENCHMARKS.md "π0's compiled peaks" and "π0.5's compiled peaks").

For a config of real sizes (configs/pi0.yaml, Ψ = 3.24B; configs/pi05.yaml, Ψ = 3.35B; batch 32,
one 224² camera, H = 50, remat full) it runs `zerojax analyze --json` (the step compiled on
simulated CPU devices, nothing run) on 1, 2, 4 and 8 devices for each recipe asked for
(`RECIPES`: full fine-tuning, LoRA, the VLM frozen, optimizer offload; each at its stages), then,
for each card size, the smallest of those device counts whose compiled stage-3 peak fits the
card's budget. The budget is `zerojax plan`'s: what JAX may use of the card
(XLA_PYTHON_CLIENT_MEM_FRACTION, default 0.75) less a 1 GB margin; the table also gives it at
0.95 (what users set to give JAX the card).

    python scripts/bench/policy_memory.py --config configs/pi0.yaml --out runs/pi0_memory.json
    python scripts/bench/policy_memory.py --config configs/pi05.yaml --out runs/pi05_memory.json \\
        --recipes full,lora_openpi,freeze_vlm,offload_optimizer --cards 8,12,16,24,40,48,80
    python scripts/bench/policy_memory.py --out runs/pi05_memory.json --markdown   # the tables from the JSON

The JSON (which holds its config, recipes and cards) is rewritten after each compile, and a
rerun skips what it holds, so a cut-short run resumes; about a minute or two per compile here.
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

# The batch's keys only (a policy reads a LeRobot dataset's features; the tiny one names one camera).
DATA = ("data.source=lerobot:tests/fixtures/lerobot/tiny", "data.cameras=observation.images.front")
DEVICES = (1, 2, 4, 8)
MARGIN_GB = 1.0
# openpi's low-memory recipe: LoRA r16 on the VLM's Gemma, r32 on the expert's, only their bases frozen
OPENPI_LORA = ("optim.lora.rank=16", "optim.lora.rank_pattern=expert:32", "optim.lora.alpha_pattern=expert:32",
               "optim.lora.targets=language,expert", "optim.lora.base=targets")
RECIPES = {  # name -> (the tables' words, overrides, stages, offloaded: the host bytes shown)
    "full": ("full", (), (0, 3), False),
    "lora16": ("LoRA r16", ("optim.lora.rank=16",), (0, 3), False),
    "lora_openpi": ("LoRA r16/r32 (openpi's)", OPENPI_LORA, (0, 3), False),
    "freeze_vlm": ("VLM frozen", ("optim.freeze=vlm",), (3,), False),
    "offload_optimizer": ("full, offload=optimizer", ("zero.offload=optimizer",), (3,), True),
    "offload_optimizer_master": ("offload=optimizer+master", ("zero.offload=optimizer+master",), (3,), True),
}
PI0_RECIPES = ("full", "lora16", "offload_optimizer", "offload_optimizer_master")  # π0's table (2026-12-01)


def key(name: str, devices: int) -> str:
    return f"{name}@{devices}"


def analyze(config: str, overrides, stages, devices: int) -> dict:
    """One `zerojax analyze --json` in its own process (a fresh backend for each device count)."""
    stages = stages[:1] if devices == 1 else stages  # one device shards nothing: stage 0 is stage 3
    cmd = [sys.executable, "-m", "zerojax", "analyze", "--config", config, "--json",
           "--stages", ",".join(map(str, stages)), f"mesh.cpu_devices={devices}", *DATA, *overrides]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"policy_memory: {' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
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
    """The fewest devices whose compiled stage-3 peak of recipe `name` is within `budget` (None: none)."""
    for n in DEVICES:
        if stage_row(doc["runs"][key(name, n)], 3)["peak_bytes"] <= budget:
            return n
    return None


def gb(x: float) -> str:
    return f"{x / GB:.1f}"


def peaks_table(doc: dict) -> list[str]:
    """Per device count, each recipe at each of its stages: the formula's model states and the
    compiled peak, or (offloaded) the device peak and the host's bytes."""
    columns = [(name, stage) for name in doc["recipes"] for stage in RECIPES[name][2]]
    head = [f"{RECIPES[name][0]}, stage {stage}" + (": peak (+ host)" if RECIPES[name][3] else ": states / peak")
            for name, stage in columns]
    out = ["| devices | " + " | ".join(head) + " |", "|---" * (len(columns) + 1) + "|"]
    for n in DEVICES:
        cells = []
        for name, stage in columns:
            row = stage_row(doc["runs"][key(name, n)], stage)
            cells.append(f"{gb(row['peak_bytes'])} GB (+ {gb(row['host_argument_bytes'])} GB)" if RECIPES[name][3]
                         else f"{gb(row['formula_bytes'])} / {gb(row['peak_bytes'])} GB")
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    return out


def cards_table(doc: dict) -> list[str]:
    """Per card and share of it, the smallest device count of each recipe at stage 3."""
    names = doc["recipes"]
    out = ["| card | budget | " + " | ".join(f"{RECIPES[n][0]}, stage 3" for n in names) + " |",
           "|---|---" + "|---" * len(names) + "|"]
    for card in doc["cards_gb"]:
        for fraction in (doc.get("mem_fraction", 0.75), 0.95):
            budget = budget_bytes(card * GB, MARGIN_GB * GB, fraction)
            cells = []
            for name in names:
                n = smallest(doc, name, budget)
                cells.append(f"{n} device{'s' * (n != 1)}" if n else f"more than {DEVICES[-1]}")
            out.append(f"| {card:g} GB | {gb(budget)} GB ({fraction:g} x card - {MARGIN_GB:g} GB) | "
                       + " | ".join(cells) + " |")
    return out


def markdown(doc: dict) -> str:
    """The two tables: per device, states and peaks; per card, the smallest device count."""
    return "\n".join([*peaks_table(doc), "", *cards_table(doc)])


def measure(doc: dict, out: Path) -> None:
    """Every (recipe, device count) of `doc` not yet in it, the JSON rewritten after each."""
    for name in doc["recipes"]:
        _, overrides, stages, _ = RECIPES[name]
        for n in DEVICES:
            if key(name, n) in doc["runs"]:
                continue
            doc["runs"][key(name, n)] = entry = analyze(doc["config"], overrides, stages, n)
            print(f"{key(name, n)}: " + ", ".join(f"stage {s} peak {gb(r['peak_bytes'])} GB"
                                                  for s, r in entry["stages"].items())
                  + f" ({entry['wall_s']} s)", file=sys.stderr, flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_suffix(".tmp")
            tmp.write_text(json.dumps(doc, indent=1))
            tmp.replace(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/pi0.yaml", help="a policy's config (relative to the checkout)")
    parser.add_argument("--recipes", default=",".join(PI0_RECIPES), help="of " + ", ".join(RECIPES))
    parser.add_argument("--cards", default="24,48,80", help="card sizes in GB, for the smallest device counts")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "pi0_memory.json")
    parser.add_argument("--markdown", action="store_true", help="print the tables of --out, compile nothing")
    opts = parser.parse_args(argv)
    if opts.out.is_file():
        doc = json.loads(opts.out.read_text())  # its own config, recipes and cards: a rerun resumes it
    else:
        recipes = opts.recipes.split(",")
        unknown = sorted(set(recipes) - set(RECIPES))
        if unknown:
            parser.error(f"--recipes {','.join(unknown)}: not a recipe; choose of {', '.join(RECIPES)}")
        doc = {"config": opts.config, "recipes": recipes, "cards_gb": [float(c) for c in opts.cards.split(",")],
               "runs": {}}
    if not opts.markdown:
        doc["mem_fraction"] = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
        measure(doc, opts.out)
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
