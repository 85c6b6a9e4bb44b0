"""The largest buffers of a compiled step's temp allocation, from XLA's dump files.

    XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text" zerojax analyze --config ... --json
    python scripts/bench/peak_buffers.py /tmp/dump module_0000.jit_train_step [N]

reads <module>.cpu_after_optimizations-buffer-assignment.txt (each value's size and offset in
the temp allocation), -live-range.txt (each value's first and last instruction in the
schedule) and the optimized HLO (each instruction's op_name), and prints the N largest values
live where the allocation's extent (offset + size) is highest, with the jax operation that made
them. The live ranges of values inside loop bodies are numbered in their own computation's
place in the sequence, so the list shows what is live around the peak, not an exact sum; the
allocation's size is `temp_bytes` of `zerojax analyze --json`. Used for issue 34 (BENCHMARKS.md,
"Long sequences")."""

from __future__ import annotations

import re
import sys


def read(d: str, module: str):
    stem = f"{d}/{module}.cpu_after_optimizations"
    assignment, live, hlo = (open(f"{stem}{suffix}").read() for suffix in
                             ("-buffer-assignment.txt", "-live-range.txt", ".txt"))
    values = {}  # name -> (size, offset, shape) of the temp allocation's values
    for block in re.split(r"\nallocation ", assignment):
        head = block.split("\n", 1)[0]
        if "parameter" in head or "constant" in head:
            continue
        for m in re.finditer(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (\S+)", block):
            values[m.group(1)] = (int(m.group(2)), int(m.group(3)), m.group(4))
    ranges = {m.group(1): (int(m.group(3)), int(m.group(4)))
              for m in re.finditer(r"^\s+(\S+?)(\{\})?:(\d+)-(\d+)$", live, re.M) if m.group(1) in values}
    ops = {m.group(1): m.group(2) for m in re.finditer(r"^\s*(?:ROOT )?%?(\S+) = .*?op_name=\"([^\"]+)\"", hlo, re.M)}
    return values, ranges, ops


def main(argv) -> int:
    d, module, n = argv[0], argv[1], int(argv[2]) if len(argv) > 2 else 20
    values, ranges, ops = read(d, module)
    extent = {}
    for name, (start, end) in ranges.items():
        top = values[name][1] + values[name][0]
        for t in range(start, end + 1):
            extent[t] = max(extent.get(t, 0), top)
    t = max(extent, key=extent.get)
    live = sorted(((values[k][0], k) for k, (s, e) in ranges.items() if s <= t <= e), reverse=True)
    print(f"temp allocation's highest extent {extent[t] / 1e9:.2f} GB at instruction {t}; live there "
          f"{sum(s for s, _ in live) / 1e9:.2f} GB in {len(live)} values, the largest:")
    for size, name in live[:n]:
        print(f"{size / 1e9:8.3f} GB  {values[name][2]:32s} {name:40s} {ops.get(name, '')[-100:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
