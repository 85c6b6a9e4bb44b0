"""Human-readable renderings of the JSON documents the CLI prints with --json: rich tables for
the terminal, and the self-contained HTML report page (`zerojax report`, and report.html at the
end of `zerojax train`).
"""

from __future__ import annotations

import dataclasses
import datetime
import html
import importlib.resources
import json
import math
import re
import statistics
from pathlib import Path

import jax
import yaml
from rich.console import Console
from rich.table import Table
from rich.text import Text

from zerojax import __version__, accounting, formats
from zerojax import config as config_lib
from zerojax.config import ConfigError

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
            console.print(item)


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
        formula = accounting.FORMULAS[stage]
        if "trainable" in doc:  # Ψ_t pays the formula; the frozen rest is stored once
            formula = formula.replace("Ψ", "Ψt") + (" + b·Ψf/N" if stage == 3 else " + b·Ψf")
        if host:
            formula += " - host"
        table.add_row(str(stage), accounting.ALIASES[stage], formula, human_bytes(nbytes),
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


def analyze_table(doc: dict):
    yield plan_table(doc)
    mem = Table(title=f"Compiled train step, per device: Ψ = {doc['params']:,}, mesh {doc['mesh']} "
                      f"(N = {doc['devices']} on data), schedule {doc['schedule']}")
    for column in ("stage", "arguments", "formula", "args/formula", "temp", "output", "replicated leaves"):
        mem.add_column(column, justify="left" if column == "stage" else "right", no_wrap=True)
    for stage, m in doc["stages"].items():
        mem.add_row(stage, human_bytes(m["argument_bytes"]), human_bytes(m["formula_bytes"]),
                    f"{m['argument_bytes'] / m['formula_bytes']:.2f}", human_bytes(m["temp_bytes"]),
                    human_bytes(m["output_bytes"]), human_bytes(m["unsharded_bytes"]))
    yield mem
    frozen = {stage: m for stage, m in doc["stages"].items() if "trainable" in m}
    if frozen:
        bill = Table(title="Frozen leaves (optim.freeze, a LoRA base): the state the step keeps, per device "
                           "(formula terms /N where the stage shards them)")
        for column in ("stage", "trained Ψt", "frozen Ψf", "arguments", "b_f·Ψf + 12·Ψt", "plan", "args/formula"):
            bill.add_column(column, justify="left" if column == "stage" else "right", no_wrap=True)
        for stage, m in frozen.items():
            bill.add_row(stage, f"{m['trainable']:,}", f"{doc['params'] - m['trainable']:,}",
                         human_bytes(m["argument_bytes"]), human_bytes(m["state_formula_bytes"]),
                         human_bytes(m["state_bytes"]), f"{m['argument_bytes'] / m['state_formula_bytes']:.3f}")
        yield bill
    offloaded = {stage: m for stage, m in doc["stages"].items() if m.get("offload", "none") != "none"}
    if offloaded:
        mode = next(iter(offloaded.values()))["offload"]
        place = Table(title=f"zero.offload={mode}: the compiled step's arguments by memory space (host: S(5) in "
                            "their HLO layouts), per device")
        for column in ("stage", "device", "host", "host formula", "host/formula", "temp"):
            place.add_column(column, justify="left" if column == "stage" else "right", no_wrap=True)
        for stage, m in offloaded.items():
            place.add_row(stage, human_bytes(m["device_argument_bytes"]), human_bytes(m["host_argument_bytes"]),
                          human_bytes(m["host_formula_bytes"]),
                          f"{m['host_argument_bytes'] / m['host_formula_bytes']:.3f}" if m["host_formula_bytes"] else "-",
                          human_bytes(m["temp_bytes"]))
        yield place
    comm = Table(title="Bytes each device sends per step (ring volumes, from the optimized HLO)")
    for column in ("stage", "all-gather", "reduce-scatter", "all-reduce", "total", "DESIGN §2", "measured/theory", ""):
        comm.add_column(column, justify="left" if column == "stage" else "right", no_wrap=True)
    top = max(m["comm_bytes"] for m in doc["stages"].values()) or 1
    for stage, m in doc["stages"].items():
        c, dtypes = m["comm"], m["comm_dtypes"]
        cell = lambda kind: f"{human_bytes(c[kind])} {dtypes.get(kind, '')}".strip() if c[kind] else "-"
        comm.add_row(stage, cell("all-gather"), cell("reduce-scatter"), cell("all-reduce"),
                     human_bytes(m["comm_bytes"]), human_bytes(m["comm_theory_bytes"]),
                     f"{m['comm_bytes'] / m['comm_theory_bytes']:.3f}" if m["comm_theory_bytes"] else "-",
                     Text("█" * max(1, round(BAR_WIDTH * m["comm_bytes"] / top)), style="cyan"))
    yield comm
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
        fits = Table(title=f"Largest depth x width scaling whose compiled peak fits "
                           f"{human_bytes(doc['fits']['budget_bytes'])} per device")
        for column in ("stage", "scale", "d_model", "d_ff", "layers", "params", "peak"):
            fits.add_column(column, justify="left" if column == "stage" else "right", no_wrap=True)
        for stage, f in doc["fits"]["stages"].items():
            fits.add_row(stage, *(("-",) * 6 if f is None else (
                f"{f['scale']:g}x", str(f["d_model"]), str(f["d_ff"]), str(f["n_layers"]),
                f"{f['params']:,}", human_bytes(f["peak_bytes"]))))
        yield fits
    r = doc["regime"]
    yield f"regime: {r['regime']} ({r['tokens_per_device']} tokens per device). {r['advice']}"
    yield ("arguments: the persistent state the step reads (fp32 master + Adam m, v in the stage's layout, and "
           "the batch), from XLA's memory_analysis(); formula: DESIGN §2 with 2-byte params/grads, K = 12. "
           "Collective bytes are counted in the dtype XLA moves (the CPU backend moves bf16 as f32).")


# ---------------------------------------------------------------------------------------------
# The HTML page: one file with its CSS, script, data and charts inline (no network, no CDN).

PAGE = importlib.resources.files("zerojax") / "page"
ANALYSIS = "analyze.json"  # in a run directory: `zerojax analyze --json` of the run's config
EXAMPLES = ("0.1", "70000", "0.000001", "3.14159", "65504", "448", "1.0001")
PAPER = {"psi": "7.5B", "devices": 64, "k": 12}  # the ZeRO paper's example: 120 GB down to 1.9 GB


@dataclasses.dataclass(frozen=True)
class Run:
    """What the page shows of one run directory."""

    path: Path
    metrics: list  # the lines of metrics.jsonl
    config: dict  # config.yaml as the run wrote it ({} if absent)
    analysis: dict | None  # the `zerojax analyze --json` document of its config, when known


def read_run(path: Path) -> Run:
    """A run directory: its metrics, its config and its analyze.json if there is one. A path
    that is not a run directory is bad input (ConfigError)."""
    metrics_file = path / "metrics.jsonl"
    if not path.is_dir():
        raise ConfigError(f"RUN_DIR {str(path)!r} does not exist; give a directory `zerojax train` wrote "
                          "(its train.out_dir, e.g. runs/tiny)")
    if not metrics_file.is_file():
        raise ConfigError(f"RUN_DIR {str(path)!r} holds no metrics.jsonl; give a directory `zerojax train` wrote "
                          "(its train.out_dir, e.g. runs/tiny)")
    metrics = []
    for number, line in enumerate(metrics_file.read_text().splitlines(), 1):
        try:
            metrics += [json.loads(line)] if line.strip() else []
        except json.JSONDecodeError as err:
            raise ConfigError(f"{metrics_file} line {number} is not JSON ({err})") from None
    config_file, analysis_file = path / "config.yaml", path / ANALYSIS
    config = yaml.safe_load(config_file.read_text()) if config_file.is_file() else {}
    analysis = json.loads(analysis_file.read_text()) if analysis_file.is_file() else None
    return Run(path, metrics, config or {}, analysis)


def analyze_run(run: Run) -> Run:
    """`run` with its analysis: every stage's step compiled from its config.yaml (tens of seconds
    on a CPU), kept in RUN_DIR/analyze.json for the next page."""
    doc = accounting.analyze(config_lib.load(run.path / "config.yaml"))
    (run.path / ANALYSIS).write_text(json.dumps(doc, allow_nan=False))
    return dataclasses.replace(run, analysis=doc)


def write_page(runs: list[Run], out: Path) -> int:
    """Write the page to `out` (whole or not at all: written beside it, then renamed); its size."""
    text = page(runs)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(out)
    return len(text.encode("utf-8"))


def page(runs: list[Run]) -> str:
    """The HTML page: the format explorer and the memory calculator, and for runs, the bars
    `zerojax analyze` measured for their configs and their curves."""
    labels = run_labels(runs)
    data = {"formats": [{"name": n, "label": formats.LABELS[n], **format_layout(n)} for n in formats.FORMATS],
            "paper": PAPER}
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    about = f"runs: {', '.join(labels)}" if runs else "no run: the explorer and the calculator only"
    parts = {
        "title": html.escape("zerojax report" + (f": {', '.join(labels)}" if runs else "")),
        "subtitle": html.escape(f"Made {now} by zerojax {__version__} (jax {jax.__version__}); {about}"),
        "css": (PAGE / "report.css").read_text(),
        "js": (PAGE / "report.js").read_text(),
        "data": json.dumps(data).replace("</", "<\\/"),  # never ends the <script> it sits in
        "examples": "".join(f'<button type="button" data-value="{v}">{v}</button>' for v in EXAMPLES),
        "psi": PAPER["psi"], "devices": str(PAPER["devices"]), "k": str(PAPER["k"]),
        "stages": "\n".join(stage_row(s) for s in accounting.STAGES),
        "measured": measured_section(runs, labels),
        "runs": runs_section(runs, labels) if runs else "",
        "footer": "Everything on this page is in this one file: it opens from disk, offline. Charts: matplotlib "
                  "(SVG). Source of the numbers: metrics.jsonl, config.yaml and analyze.json of each run directory.",
    }
    return re.sub(r"\{\{(\w+)\}\}", lambda m: parts[m.group(1)], (PAGE / "report.html").read_text())


def format_layout(name: str) -> dict:
    """What the page's script needs to round into format `name` as ml_dtypes does."""
    f = formats.info(name)
    return {"exponent_bits": f.exponent_bits, "mantissa_bits": f.mantissa_bits, "max": f.max,
            "has_inf": f.has_inf, "via_float32": formats.rounds_via_float32(name)}


def stage_row(stage: int) -> str:
    return (f'<div class="stage-row"><div class="stage-name">stage {stage}<small>{accounting.ALIASES[stage]}</small>'
            f'</div><div class="formula">{accounting.FORMULAS[stage]}</div>'
            f'<div class="bar" data-stage="{stage}"><span class="fill"></span><span class="gb"></span></div></div>')


def run_labels(runs: list[Run]) -> list[str]:
    """Each run's directory name, or its whole path where two names are the same."""
    names = [run.path.resolve().name for run in runs]
    return names if len(set(names)) == len(names) else [str(run.path) for run in runs]


def measured_section(runs: list[Run], labels: list[str]) -> str:
    if not runs:
        return ""
    from zerojax import plots  # matplotlib, imported only to draw: it would add ~0.6 s to every command
    out = ['<h3>Measured: the compiled step of each stage, next to the formula</h3>']
    for i, (run, label) in enumerate(zip(runs, labels)):
        doc = run.analysis
        if doc is None:
            out.append(f'<p class="note"><b>{html.escape(label)}</b>: no {ANALYSIS} in {html.escape(str(run.path))} '
                       f'yet. <code>zerojax report {html.escape(str(run.path))}</code> compiles every stage of its '
                       'config and keeps the result there.</p>')
            continue
        caption = (f"<b>{html.escape(label)}</b>: Ψ = {doc['params']:,} parameters, N = {doc['devices']} devices on "
                   f"the data axis, schedule {html.escape(str(doc.get('schedule')))}; XLA's memory_analysis() and the "
                   f"collectives of the optimized HLO, from {html.escape(str(run.path / ANALYSIS))}")
        out.append(f'<figure class="measured" data-run="{i}"><figcaption>{caption}</figcaption>'
                   f'{plots.analyze_bars(doc, f"analyze-{i}")}</figure>')
    return "\n".join(out)


def runs_section(runs: list[Run], labels: list[str]) -> str:
    from zerojax import plots

    rows = "\n".join(run_row(run, label, plots.COLORS[i % len(plots.COLORS)])
                     for i, (run, label) in enumerate(zip(runs, labels)))
    svgs = plots.curves([(label, run.metrics) for run, label in zip(runs, labels)])
    figures = "\n".join(f'<figure data-plot="{key}">{svg}</figure>' for key, svg in svgs.items())
    head = "".join(f"<th>{h}</th>" for h in ("run", "model", "stage · schedule", "precision", "steps",
                                              "final loss", "final eval loss", "tokens/s (median)"))
    return (f'<section id="runs">\n<h2>Runs</h2>\n<p class="lead">What each run logged in its metrics.jsonl; '
            f'several runs are overlaid, one colour each.</p>\n<table class="runs"><thead><tr>{head}</tr></thead>'
            f'<tbody>\n{rows}\n</tbody></table>\n<div class="plots">\n{figures}\n</div>\n</section>')


def run_row(run: Run, label: str, color: str) -> str:
    cfg, lines = run.config, run.metrics
    model, zero, precision = cfg.get("model", {}), cfg.get("zero", {}), cfg.get("precision", {})
    last = lines[-1] if lines else {}
    evals = [x["eval_loss"] for x in lines if "eval_loss" in x]
    speeds = [x["tokens_per_sec"] for x in lines if "tokens_per_sec" in x]
    offload = zero.get("offload", "none")
    cells = [
        f'<span class="swatch" style="background:{color}"></span>{html.escape(label)}',
        html.escape(f"{model.get('family', '?')}, d_model {model.get('d_model', '?')}, {model.get('n_layers', '?')} "
                    f"layers" + (f", Ψ = {run.analysis['params']:,}" if run.analysis else "")),
        html.escape(f"{zero.get('stage', '?')} · {zero.get('schedule', '?')}"
                    + (f" · offload {offload}" if offload != "none" else "")),
        html.escape(f"compute {precision.get('compute', '?')}, gather {precision.get('gather', '?')}"),
    ]
    numbers = [str(last.get("step", "–")), _fixed(last.get("loss")), _fixed(evals[-1] if evals else None),
               f"{statistics.median(speeds):,.0f}" if speeds else "–"]
    return "<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "".join(f'<td class="num">{n}</td>' for n in numbers) + "</tr>"


def _fixed(x) -> str:
    return "–" if x is None else f"{x:.4f}"
