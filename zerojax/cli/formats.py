"""`zerojax formats`: how FP32, BF16, FP16 and FP8 store given numbers, or each format's range
and precision (no jax)."""

from __future__ import annotations

from zerojax import formats, report
from zerojax.cli.args import Parser, UsageError

HELP = "how FP32, BF16, FP16 and FP8 store a number"


def arguments(parser: Parser) -> None:
    parser.add_argument("values", nargs="*", metavar="VALUE", help="numbers to store, e.g. 0.1 70000 1e-8")
    parser.add_argument("--table", action="store_true", help="range and precision of each format")
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def run(args) -> int:
    if not args.values and not args.table:
        raise UsageError("give values to store (e.g. zerojax formats 0.1 70000 1e-8) or --table")
    doc = formats.explain(args.values)
    if args.table:
        doc = {**({"values": doc["values"]} if args.values else {}), "formats": formats.table()}
    report.emit(doc, args.json, report.formats_tables)
    return 0
