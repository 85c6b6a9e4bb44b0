"""The benchmarks' command line: `python scripts/bench/bench.py plan|measure|summary|stages|transient ...`
(the code and its usage: scripts/bench/benchlib/)."""

import sys

from benchlib.cli import main  # scripts/bench/benchlib/, beside this file

if __name__ == "__main__":
    sys.exit(main())
