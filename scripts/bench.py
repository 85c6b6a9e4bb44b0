"""The benchmarks' command line: `python scripts/bench.py plan|measure|summary|stages|transient ...`
(the code and its usage: scripts/bench/)."""

import sys

from bench.cli import main  # scripts/bench/, beside this file

if __name__ == "__main__":
    sys.exit(main())
