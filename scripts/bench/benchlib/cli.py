"""The command line of `python scripts/bench/bench.py` (its usage: scripts/bench/benchlib/__init__.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from zerojax.parallel import mesh as mesh_lib

import benchlib
from benchlib.measure import measure_main
from benchlib.peer import TRANSIENT_SHAPES, transient_main
from benchlib.plan import BY_NAME, plan_main
from benchlib.attention import attention_main
from benchlib.stages import stages_main
from benchlib.summary import markdown


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=benchlib.__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    plan, one = sub.add_parser("plan"), sub.add_parser("measure")
    stages, attention = sub.add_parser("stages"), sub.add_parser("attention")
    for p in (plan, one, stages, attention):
        p.add_argument("--steps", type=int, default=5)
        p.add_argument("--warmup", type=int, default=2)
        p.add_argument("--peak-tflops", type=float, help="the device's dense peak, for MFU (H200 bf16: 989)")
        p.add_argument("--xla-preset", help="e.g. gpu (zerojax.parallel.mesh.XLA_PRESETS)")
    for p in (plan, one):
        p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: the CI rehearsal")
        p.add_argument("--fit-budget-gb", type=float, help="the fit search's budget (default: the device's limit)")
        p.add_argument("--fit-max-steps", type=int, default=12, help="the fit search's most scalings (x2 parameters each)")
    plan.add_argument("--out", default="runs/bench_gpu/bench_gpu.json")
    plan.add_argument("--deadline-s", type=float, default=470, help="start nothing that cannot end by then")
    plan.add_argument("--only", help="comma-separated measurement names")
    one.add_argument("name", choices=list(BY_NAME))
    one.add_argument("--result", required=True)
    sub.add_parser("summary").add_argument("file")
    stages.add_argument("--config")
    stages.add_argument("--stages", default="0,1,2,3")
    stages.add_argument("--schedules", default="shard_map,gspmd")
    stages.add_argument("--out")
    stages.add_argument("overrides", nargs="*")
    attention.add_argument("--config")
    attention.add_argument("--seqs", default="512,2048", help="model.seq_len values")
    attention.add_argument("--impls", default="naive,auto", help="model.attention values, run in turn at each length")
    attention.add_argument("--out")
    attention.add_argument("overrides", nargs="*")
    transient = sub.add_parser("transient")
    transient.add_argument("--shapes", default=",".join(TRANSIENT_SHAPES), help="of " + ", ".join(TRANSIENT_SHAPES))
    transient.add_argument("--out")
    transient.add_argument("overrides", nargs="*")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.command == "summary":
        print(markdown(json.loads(Path(opts.file).read_text())))
        return 0
    if opts.command == "stages" and opts.xla_preset:
        mesh_lib.apply_xla_preset(opts.xla_preset)
    return {"plan": plan_main, "measure": measure_main, "stages": stages_main, "attention": attention_main,
            "transient": transient_main}[opts.command](opts)
