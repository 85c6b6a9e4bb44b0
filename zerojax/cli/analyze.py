"""`zerojax analyze`: each ZeRO stage's train step compiled; its measured bytes beside the
formulas' (and, with --budget-gb, the largest scaling of the model that fits)."""

from __future__ import annotations

from zerojax import config, report
from zerojax.cli.args import Parser, add_xla_preset, parse_count, stage_list, xla_preset
from zerojax.config import rules

HELP = "compile each stage's train step; measured bytes vs the formulas"


def arguments(analyze: Parser) -> None:
    analyze.add_argument("--config", help="YAML config file (see configs/)")
    analyze.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    analyze.add_argument("--stages", type=stage_list, help="e.g. 0,3 (default 0,1,2,3; with precision.gather=int8 "
                         "or float8_e4m3fn 1,2,3)")
    analyze.add_argument("--schedule", choices=rules.SCHEDULES, help="same as zero.schedule=...")
    analyze.add_argument("--budget-gb", type=parse_count, help="also find the largest depth x width scaling "
                         "of the model whose compiled peak fits this many GB per device")
    add_xla_preset(analyze)
    analyze.add_argument("--json", action="store_true", help="print one JSON document")


def run(args) -> int:
    from zerojax.analysis import measure

    xla_preset(args)
    overrides = args.overrides + ([f"zero.schedule={args.schedule}"] if args.schedule else [])
    cfg = config.load(args.config, overrides)  # bad input surfaces here and in make_engine, before compiling
    report.emit(measure.analyze(cfg, args.stages, args.budget_gb), args.json, report.analyze_table)
    return 0
