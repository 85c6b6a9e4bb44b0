"""`zerojax report`: one self-contained HTML page of runs. A run without its analysis yet is
compiled first (unless --no-analyze); every RUN_DIR is read before the page is written."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from zerojax import report
from zerojax.cli.args import Parser, UsageError
from zerojax.errors import ConfigError

HELP = "one self-contained HTML page: format explorer, memory calculator, the stages measured and the curves of runs"


def arguments(parser: Parser) -> None:
    parser.add_argument("run_dirs", nargs="*", metavar="RUN_DIR", help="run directories to show, overlaid")
    parser.add_argument("--out", default="report.html", help="the HTML file to write (default report.html)")
    parser.add_argument("--no-analyze", action="store_true", help="do not compile the stages of a run that has "
                        "no RUN_DIR/analyze.json yet (its measured bars are then left out)")


def run(args) -> int:
    out = Path(args.out)
    if not out.parent.is_dir():
        raise UsageError(f"--out {args.out!r}: directory {str(out.parent)!r} does not exist")
    runs = [report.read_run(Path(d)) for d in args.run_dirs]  # every RUN_DIR checked before anything is written
    if not args.no_analyze:
        runs = [_analyzed(run) if run.analysis is None else run for run in runs]
    size = report.write_page(runs, out)
    print(f"zerojax: wrote {out} ({size / 1e3:.0f} kB)")
    return 0


def _analyzed(run):
    """`run` with its stages measured (and kept in the run directory), or as it is where they
    cannot be: its curves still show."""
    print(f"zerojax: analyzing {run.path}: compiling the step of stages 0-3 (kept in "
          f"{run.path / report.ANALYSIS})", file=sys.stderr)
    start = time.perf_counter()
    try:
        analyzed = report.analyze_run(run)
    except ConfigError as err:  # e.g. its data file is not where the run found it
        print(f"zerojax: warning: no measured bars for {run.path}: {err}", file=sys.stderr)
        return run
    print(f"zerojax: analyzed {run.path} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return analyzed
