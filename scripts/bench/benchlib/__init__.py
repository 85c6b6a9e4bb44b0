"""Benchmarks of the train step: the plan run on the first GPU, and the per-stage table.

    python scripts/bench/bench.py plan [--dry-run] [--out FILE] [--deadline-s S] [--only NAME,...]
                                 [--steps 5] [--warmup 2] [--peak-tflops 989] [--xla-preset gpu]
                                 [--fit-budget-gb G] [--fit-max-steps K]
    python scripts/bench/bench.py measure NAME --result FILE [the same options]   (what `plan` runs)
    python scripts/bench/bench.py summary FILE                  (the Markdown summary of a plan's JSON)
    python scripts/bench/bench.py stages [--config PATH] [--steps 20] [--stages 0,1,2,3]
                                   [--schedules shard_map,gspmd] [--peak-tflops T] [KEY=VALUE ...]
    python scripts/bench/bench.py transient [--shapes 3.3M,25.5M] [--out FILE] [KEY=VALUE ...]

    plan.py      `plan`: the measurements of PLAN, each in a fresh process, under a deadline
    measure.py   `measure`: one measurement (throughput, a fit search, the quantized gathers' work)
    summary.py   `summary`: a plan's JSON as ratios and as Markdown for BENCHMARKS.md
    stages.py    `stages`: every stage and schedule in one process (BENCHMARKS.md's CPU table)
    peer.py      `transient`: stage 3's transient memory against JAX's usual FSDP (GSPMD + scalax)
    cli.py       the command line

`plan` is what scripts/bench/bench_gpu.sh runs: each measurement in a fresh process, because a
process's peak device memory (`memory_stats()["peak_bytes_in_use"]`) cannot be reset, and
because an out-of-memory error or a hung compile then costs one entry, not the run. After every
measurement the whole JSON document is rewritten atomically, so a run cut short by its time
limit keeps everything measured so far. A measurement whose feature has not landed in zerojax
(its config does not load, or preparing it says "not implemented") is skipped with that reason.
`--dry-run` runs the same plan on CPU with tiny shapes (CI).

`stages` is the per-stage table of BENCHMARKS.md's CPU section (one process; on CPU absolute
times are noise, compare the ratios).

`transient` is BENCHMARKS.md's like-for-like table of transient memory (XLA's `temp_size_in_bytes`
of the compiled step, nothing allocated) at stage 3, bf16 compute, `model.remat=full`: the
explicit schedule at `zero.prefetch=0` and `1`, zerojax's gspmd schedule, and the peer, JAX's
usual FSDP (peer.py). The peer needs scalax (`pip install scalax`), which is not a zerojax
dependency.

zerojax is reached only through the modules of its public API (listed in zerojax/__init__.py:
`zerojax.train.step.make_engine`, `zerojax.analysis.measure.compile_step`, ...).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # scripts/bench/benchlib/__init__.py
sys.path.insert(0, str(ROOT))  # this checkout's zerojax, installed or not (the GPU image has it not)
ENTRY = ROOT / "scripts" / "bench" / "bench.py"  # the command line, which `plan` runs for each measurement


def write_json(path: Path, doc) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)  # readers never see half a document
