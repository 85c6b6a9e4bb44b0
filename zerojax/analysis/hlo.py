"""Reading the optimized HLO text of a compiled step: the bytes each collective sends and the
FLOPs of its dots (loops multiplied by their trip counts), and the memory space of each
argument and result."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field


HOST_MEMORY_SPACE = 5  # XLA's memory space of pinned host memory: `S(5)` in a layout
_ARGUMENT = re.compile(r"(\w+)\[([\d,]*)\](?:\{([^}]*)\})?")


def argument_bytes_by_memory(hlo_text: str, outputs: bool = False) -> dict:
    """Per-device bytes of the compiled program's parameters (or results), by the memory space
    their layout names in the module's entry_computation_layout (`{1,0:S(5)}`: host; none: device)."""
    start = hlo_text.find("entry_computation_layout={")
    if start < 0:
        raise ValueError("no entry_computation_layout in the compiled HLO module")
    depth, at = 0, start + len("entry_computation_layout=")
    for end in range(at, len(hlo_text)):  # to the brace that closes the layout
        depth += {"{": 1, "}": -1}.get(hlo_text[end], 0)
        if depth == 0:
            break
    params, _, results = hlo_text[at + 1 : end].partition(")->")
    out = {"device": 0, "host": 0}
    for element, dims, layout in _ARGUMENT.findall(results if outputs else params):
        if element not in DTYPE_BYTES:
            continue
        space = re.search(r"S\((\d+)\)", layout or "")
        where = "host" if space and int(space.group(1)) == HOST_MEMORY_SPACE else "device"
        out[where] += DTYPE_BYTES[element] * math.prod(int(d) for d in dims.split(",") if d)
    return out


# ---------------------------------------------------------------------------------------------
# Communication: bytes each device sends per step, read from the optimized HLO.

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2,
               "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP = re.compile(r"=\s*(\(.*?\)|[\w]+\[[\d,]*\](?:\{[^}]*\})?)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP = re.compile(r'known_trip_count"?\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


def _shape_bytes(text: str) -> tuple[int, str]:
    """Bytes of an HLO shape (tuples summed) and its (first) element type."""
    total, dtype = 0, None
    for element, dims in _SHAPE.findall(text):
        if element in DTYPE_BYTES:
            total += DTYPE_BYTES[element] * math.prod(int(d) for d in dims.split(",") if d)
            dtype = dtype or element
    return total, dtype


def _group_size(line: str, n_devices: int) -> int:
    """Devices per replica group, in each syntax XLA prints."""
    if m := re.search(r"replica_groups=\{\{([\d,]*)\}", line):
        return len(m.group(1).split(","))
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line):
        return int(m.group(2))
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line):
        sizes = dict(re.findall(r"'?(\w+)'?=(\d+)", m.group(1)))
        return math.prod(int(sizes[a.strip(" '")]) for a in m.group(2).split(",") if a.strip(" '"))
    return n_devices  # replica_groups={} or absent: every device


def _sent_bytes(kind: str, result_bytes: int, group: int) -> float:
    """Ring algorithms: what one device sends (docs/design.md §2)."""
    g = (group - 1) / group
    if kind == "all-gather":
        return g * result_bytes
    if kind == "reduce-scatter":
        return (group - 1) * result_bytes  # the operand is `group` times the result
    if kind == "all-reduce":
        return 2 * g * result_bytes
    if kind == "all-to-all":
        return g * result_bytes
    return result_bytes  # collective-permute: the whole buffer


@dataclass
class Hlo:
    """The parts of an optimized HLO module that accounting needs."""

    entry: str = ""
    ops: dict = field(default_factory=dict)  # computation -> [(kind, bytes sent, dtype)]
    calls: dict = field(default_factory=dict)  # computation -> [(callee, times, is_loop_body)]
    loop_results: list = field(default_factory=list)  # result shape text of every while loop
    dot_flops: dict = field(default_factory=dict)  # computation -> FLOPs of its dot instructions


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|\w+\[[\d,]*\])")
_DOT = re.compile(r"=\s*(\w+\[[\d,]*\])(?:\{[^}]*\})?\s+dot\(%?([\w.\-]+),.*?lhs_contracting_dims=\{([\d,]*)\}")


def _dims(shape: str) -> list[int]:
    return [int(d) for d in shape[shape.index("[") + 1 : -1].split(",") if d]


def _dot_flops(line: str, shapes: dict) -> float:
    """2 x the result's elements x the contracted elements (a multiply and an add each); the
    CPU backend prints operands by name, so the left operand's shape comes from `shapes`."""
    m = _DOT.search(line)
    if not m or m.group(2) not in shapes:
        return 0.0
    lhs = _dims(shapes[m.group(2)])
    contracted = math.prod(lhs[int(d)] for d in m.group(3).split(",") if d)
    return 2.0 * math.prod(_dims(m.group(1))) * contracted


def parse_hlo(hlo: str, n_devices: int) -> Hlo:
    out, current, shapes = Hlo(), None, {}
    for line in hlo.splitlines():
        if not line.startswith(" ") and (m := _COMPUTATION.match(line.strip())):
            current, shapes = m.group(1), {}
            out.ops[current], out.calls[current], out.dot_flops[current] = [], [], 0.0
            out.entry = current if line.startswith("ENTRY") else out.entry
            continue
        if current is None:
            continue
        if m := _INSTRUCTION.match(line):
            shapes[m.group(1)] = m.group(2)
        if " dot(" in line:
            out.dot_flops[current] += _dot_flops(line, shapes)
        if m := _OP.search(line):
            nbytes, dtype = _shape_bytes(m.group(1))
            if m.group(3) and m.group(2) != "reduce-scatter":  # async start: (operand, result)
                nbytes //= 2
            out.ops[current].append((m.group(2), _sent_bytes(m.group(2), nbytes, _group_size(line, n_devices)), dtype))
        trip = int(t.group(1)) if (t := _TRIP.search(line)) else 1
        if " while(" in line:
            out.loop_results.append(line.split("=", 1)[1].split(" while(")[0])
        for callee in _CALLS.findall(line):
            body = bool(re.search(rf"body=%?{re.escape(callee)}\b", line))
            out.calls[current].append((callee, trip if body else 1, body))
        for group in _BRANCHES.findall(line):
            out.calls[current] += [(c.strip().lstrip("%"), 1, False) for c in group.split(",") if c.strip()]
    return out


def _walk(hlo: Hlo, name: str, times: int, visit, inside_loop: bool = False):
    for kind, sent, dtype in hlo.ops.get(name, []):
        visit(kind, sent, dtype, times, inside_loop)
    for callee, trip, body in hlo.calls.get(name, []):
        _walk(hlo, callee, times * trip, visit, inside_loop or body)


def dot_flops(hlo_text: str) -> float:
    """Per-device FLOPs of the module's dots in one run, loops multiplied by their known trip
    counts (XLA's own cost_analysis counts a while body once: a scan over 32 layers as one)."""
    hlo = parse_hlo(hlo_text, 1)

    def total(name: str) -> float:
        return hlo.dot_flops.get(name, 0.0) + sum(trip * total(callee) for callee, trip, _ in hlo.calls.get(name, []))

    return total(hlo.entry)


def collective_bytes(hlo_text: str, n_devices: int) -> dict:
    """Per-device bytes sent by each collective kind in one run of the module, with ops inside
    while loops multiplied by their known trip count; their counts (in and outside loops) and
    the dtypes they move."""
    hlo = parse_hlo(hlo_text, n_devices)
    totals = {kind: 0.0 for kind in COLLECTIVES}
    counts = {kind: 0 for kind in COLLECTIVES}
    outside = {kind: 0 for kind in COLLECTIVES}
    dtypes: dict[str, str] = {}

    def visit(kind, sent, dtype, times, inside_loop):
        totals[kind] += sent * times
        counts[kind] += times
        outside[kind] += 0 if inside_loop else times
        dtypes.setdefault(kind, dtype)

    _walk(hlo, hlo.entry, 1, visit)
    return {"bytes": totals, "counts": counts, "outside_loops": outside, "dtypes": dtypes}


def loop_collectives(hlo_text: str, n_devices: int) -> list[dict]:
    """For each while loop: its trip count and the collectives one iteration issues."""
    hlo = parse_hlo(hlo_text, n_devices)
    loops = []
    for caller, callees in hlo.calls.items():
        for callee, trip, body in callees:
            if body:
                per_iteration = {kind: 0 for kind in COLLECTIVES}
                _walk(hlo, callee, 1, lambda kind, sent, dtype, times, _: per_iteration.__setitem__(
                    kind, per_iteration[kind] + times))
                loops.append({"body": callee, "trip_count": trip, "per_iteration": per_iteration})
    return loops
