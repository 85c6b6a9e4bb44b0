"""Terminal output: `--json` documents or rich tables for memory, analyze and formats."""

from __future__ import annotations

import json
import math
from rich.console import Console
from rich.table import Table
from rich.text import Text
from zerojax import formats
from zerojax.analysis import formulas


BAR_WIDTH = 24


def emit(doc: dict, as_json: bool, render) -> None:
    """Exactly one JSON document on stdout with --json; otherwise the rich rendering."""
    if as_json:
        print(json.dumps(doc, allow_nan=False))
    else:
        console = Console()
        if not console.is_terminal:
            console.width = 120  # piped or captured: no terminal width to fit, keep rows whole
        for item in render(doc):
            # A line of text is never broken by rich (the terminal wraps it): `plan`'s command stays
            # one line that runs as printed when pasted or piped.
            console.print(item, soft_wrap=isinstance(item, Text))


def human_bytes(n: float) -> str:
    """Decimal units as in the ZeRO paper: 120 GB, 31.4 GB, 1.9 GB."""
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if n >= 100 or unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


def memory_table(doc: dict):
    stages = {int(s): b for s, b in doc["stages"].items()}
    top = max(stages.values()) or 1
    frozen = (f" ({doc['trainable']:,} trained, the rest frozen at {doc['frozen_bytes_per_param']:g} B)"
              if "trainable" in doc else "")
    host = doc.get("host_stages")
    offload = (f", zero.offload={doc['offload']} (moved to host: " +
               ("m and v, (K - 4)·Ψ" if doc["offload"] == "optimizer" else "master, m and v, K·Ψ") + ", /N at stages 1-3)"
               if host else "")
    table = Table(title=f"Model states per device: Ψ = {doc['params']:,} parameters{frozen}, "
                        f"N = {doc['devices']} devices, K = {doc['k']:g}{offload}")
    columns = ("stage", "FSDP name", "formula", "per device") + (("host, per device",) if host else ()) + ("",)
    for column in columns:
        table.add_column(column, justify="right" if column in ("per device", "host, per device") else "left",
                         no_wrap=True)
    for stage, nbytes in stages.items():
        bar = "█" * max(1, round(BAR_WIDTH * nbytes / top)) if nbytes else ""
        formula = formulas.FORMULAS[stage]
        if "trainable" in doc:  # Ψ_t pays the formula; the frozen rest is stored once
            formula = formula.replace("Ψ", "Ψt") + (" + b·Ψf/N" if stage == 3 else " + b·Ψf")
        if host:
            formula += " - host"
        table.add_row(str(stage), formulas.ALIASES[stage], formula, human_bytes(nbytes),
                      *((human_bytes(host[str(stage)]),) if host else ()), Text(bar, style="cyan"))
    yield table


FIELD_STYLES = ("bold white on grey35", "bold black on dark_orange", "bold cyan")  # sign, exponent, mantissa
STATUS_STYLES = {"ok": "green", "overflow": "bold red", "nan": "bold magenta", "underflow": "bold yellow"}


def _bits(bits: str) -> Text:
    text = Text()
    for field, style in zip(bits.split(" "), FIELD_STYLES):
        text.append(field, style=style)
        text.append(" ")
    return text


def _number(x) -> str:
    if x is None:
        return "-"
    return x if isinstance(x, str) else f"{x:.10g}"


def formats_tables(doc: dict):
    for value in doc.get("values", []):
        table = Table(title=f"{value['input']}  (sign | exponent | mantissa)")
        for column in ("format", "bits", "stored", "rel. error", "status"):
            table.add_column(column, no_wrap=True)
        for name, cell in value["formats"].items():
            err = cell["rel_error"]
            table.add_row(formats.LABELS[name], _bits(cell["bits"]), _number(cell["stored"]),
                          "-" if err is None else f"{err:.2e}",
                          Text(cell["status"], style=STATUS_STYLES[cell["status"]]))
        yield table
    if "formats" in doc:
        table = Table(title="Number formats")
        for column in ("format", "bits s/e/m", "max finite", "min normal", "min subnormal",
                       "gap after 1.0", "overflow"):
            table.add_column(column, no_wrap=True)
        for name, f in doc["formats"].items():
            table.add_row(formats.LABELS[name], f["bits"], f"{f['max']:.6g}", f"{f['smallest_normal']:.3g}",
                          f"{f['smallest_subnormal']:.3g}", f"2^{round(math.log2(f['eps']))}",
                          "inf" if f["has_inf"] else "NaN")
        yield table


def plan_table(doc: dict):
    n = doc["devices"]
    table = Table(title=f"Sharding plan (master weights and Adam moments over data = {n})")
    for column in ("parameter", "shape", "stored", "spec", "master bytes / device"):
        table.add_column(column, justify="right" if column.startswith("master") else "left", no_wrap=True)
    for row in doc["plan"]:
        padded = row["stored"] != row["shape"]
        table.add_row(row["path"], str(row["shape"]), str(row["stored"]) + (" (padded)" if padded else ""),
                      row["spec"], human_bytes(row["master_bytes_per_device"]))
    return table


def _table(title: str, columns: tuple[str, ...]) -> Table:
    """A table whose first column (the stage) is left-aligned and the rest right-aligned."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="left" if column == "stage" else "right", no_wrap=True)
    return table


def analyze_table(doc: dict):
    """`zerojax analyze`'s tables and notes, in order (each part shown only where it applies)."""
    yield plan_table(doc)
    yield _memory_table(doc)
    for part in (_frozen_table(doc), _offload_table(doc)):
        if part is not None:
            yield part
    yield _comm_table(doc)
    yield from _notes(doc)


def _memory_table(doc: dict) -> Table:
    mem = _table(f"Compiled train step, per device: Ψ = {doc['params']:,}, mesh {doc['mesh']} "
                 f"(N = {doc['devices']} on data), schedule {doc['schedule']}",
                 ("stage", "arguments", "formula", "args/formula", "temp", "output", "replicated leaves"))
    for stage, m in doc["stages"].items():
        mem.add_row(stage, human_bytes(m["argument_bytes"]), human_bytes(m["formula_bytes"]),
                    f"{m['argument_bytes'] / m['formula_bytes']:.2f}", human_bytes(m["temp_bytes"]),
                    human_bytes(m["output_bytes"]), human_bytes(m["unsharded_bytes"]))
    return mem


def _frozen_table(doc: dict) -> Table | None:
    frozen = {stage: m for stage, m in doc["stages"].items() if "trainable" in m}
    if not frozen:
        return None
    bill = _table("Frozen leaves (optim.freeze, a LoRA base): the state the step keeps, per device "
                  "(formula terms /N where the stage shards them)",
                  ("stage", "trained Ψt", "frozen Ψf", "arguments", "b_f·Ψf + 12·Ψt", "plan", "args/formula"))
    for stage, m in frozen.items():
        bill.add_row(stage, f"{m['trainable']:,}", f"{doc['params'] - m['trainable']:,}",
                     human_bytes(m["argument_bytes"]), human_bytes(m["state_formula_bytes"]),
                     human_bytes(m["state_bytes"]), f"{m['argument_bytes'] / m['state_formula_bytes']:.3f}")
    return bill


def _offload_table(doc: dict) -> Table | None:
    offloaded = {stage: m for stage, m in doc["stages"].items() if m.get("offload", "none") != "none"}
    if not offloaded:
        return None
    mode = next(iter(offloaded.values()))["offload"]
    place = _table(f"zero.offload={mode}: the compiled step's arguments by memory space (host: S(5) in "
                   "their HLO layouts), per device", ("stage", "device", "host", "host formula", "host/formula", "temp"))
    for stage, m in offloaded.items():
        place.add_row(stage, human_bytes(m["device_argument_bytes"]), human_bytes(m["host_argument_bytes"]),
                      human_bytes(m["host_formula_bytes"]),
                      f"{m['host_argument_bytes'] / m['host_formula_bytes']:.3f}" if m["host_formula_bytes"] else "-",
                      human_bytes(m["temp_bytes"]))
    return place


def _comm_table(doc: dict) -> Table:
    comm = _table("Bytes each device sends per step (ring volumes, from the optimized HLO)",
                  ("stage", "all-gather", "reduce-scatter", "all-reduce", "total", "DESIGN §2", "measured/theory", ""))
    top = max(m["comm_bytes"] for m in doc["stages"].values()) or 1
    for stage, m in doc["stages"].items():
        c, dtypes = m["comm"], m["comm_dtypes"]
        cell = lambda kind: f"{human_bytes(c[kind])} {dtypes.get(kind, '')}".strip() if c[kind] else "-"
        comm.add_row(stage, cell("all-gather"), cell("reduce-scatter"), cell("all-reduce"),
                     human_bytes(m["comm_bytes"]), human_bytes(m["comm_theory_bytes"]),
                     f"{m['comm_bytes'] / m['comm_theory_bytes']:.3f}" if m["comm_theory_bytes"] else "-",
                     Text("█" * max(1, round(BAR_WIDTH * m["comm_bytes"] / top)), style="cyan"))
    return comm


def _fits_table(doc: dict) -> Table:
    fits = _table(f"Largest depth x width scaling whose compiled peak fits {human_bytes(doc['fits']['budget_bytes'])} "
                  "per device", ("stage", "scale", "d_model", "d_ff", "layers", "params", "peak"))
    for stage, f in doc["fits"]["stages"].items():
        fits.add_row(stage, *(("-",) * 6 if f is None else (
            f"{f['scale']:g}x", str(f["d_model"]), str(f["d_ff"]), str(f["n_layers"]),
            f"{f['params']:,}", human_bytes(f["peak_bytes"]))))
    return fits


def _notes(doc: dict):
    """The quantized gather's bytes, stage 3's temporaries, the fit search, the regime, the legend."""
    quantized = next((m for m in doc["stages"].values() if "gather_quantized" in m), None)
    if quantized:
        yield (f"quantized all-gathers: {quantized['gather_quantized']['note']}; DESIGN §2 with "
               f"b_g = 1 + scale bytes / block = {quantized['gather_bytes_per_element']:.4f} bytes per element")
    if "3" in doc["stages"] and "transient_estimate" in doc["stages"]["3"]:
        m3 = doc["stages"]["3"]
        est = m3["transient_estimate"]
        parts = ", ".join(f"{k.replace('_', ' ')} {human_bytes(v)}" for k, v in est.items())
        yield (f"stage 3 temporaries (model.remat={m3['remat']}, zero.prefetch={m3['prefetch']}): measured "
               f"{human_bytes(m3['temp_bytes'])}; "
               f"estimated from shapes: {parts} (sum {human_bytes(sum(est.values()))})")
    if "fits" in doc:
        yield _fits_table(doc)
    r = doc["regime"]
    yield f"regime: {r['regime']} ({r['tokens_per_device']} tokens per device). {r['advice']}"
    yield ("arguments: the persistent state the step reads (fp32 master + Adam m, v in the stage's layout, and "
           "the batch), from XLA's memory_analysis(); formula: DESIGN §2 with 2-byte params/grads, K = 12. "
           "Collective bytes are counted in the dtype XLA moves (the CPU backend moves bf16 as f32).")
