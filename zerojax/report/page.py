"""The self-contained HTML report page (`zerojax report`, and report.html at the end of `zerojax
train`): the format explorer, the memory calculator, the stages measured and the curves of runs.
It imports no jax (the page names the installed jax from its package metadata), and matplotlib
only where it draws (`plots`)."""

from __future__ import annotations

import datetime
import html
import importlib.metadata
import importlib.resources
import json
import re
import statistics
from pathlib import Path
from zerojax import __version__, formats
from zerojax.analysis import formulas
from zerojax.report.runs import ANALYSIS, Run


# ---------------------------------------------------------------------------------------------
# The HTML page: one file with its CSS, script, data and charts inline (no network, no CDN).

PAGE = importlib.resources.files("zerojax") / "page"
EXAMPLES = ("0.1", "70000", "0.000001", "3.14159", "65504", "448", "1.0001")
PAPER = {"psi": "7.5B", "devices": 64, "k": 12}  # the ZeRO paper's example: 120 GB down to 1.9 GB


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
    jax_version = importlib.metadata.version("jax")  # what is installed, without importing it
    parts = {
        "title": html.escape("zerojax report" + (f": {', '.join(labels)}" if runs else "")),
        "subtitle": html.escape(f"Made {now} by zerojax {__version__} (jax {jax_version}); {about}"),
        "css": (PAGE / "report.css").read_text(),
        "js": (PAGE / "report.js").read_text(),
        "data": json.dumps(data).replace("</", "<\\/"),  # never ends the <script> it sits in
        "examples": "".join(f'<button type="button" data-value="{v}">{v}</button>' for v in EXAMPLES),
        "psi": PAPER["psi"], "devices": str(PAPER["devices"]), "k": str(PAPER["k"]),
        "stages": "\n".join(stage_row(s) for s in formulas.STAGES),
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
    return (f'<div class="stage-row"><div class="stage-name">stage {stage}<small>{formulas.ALIASES[stage]}</small>'
            f'</div><div class="formula">{formulas.FORMULAS[stage]}</div>'
            f'<div class="bar" data-stage="{stage}"><span class="fill"></span><span class="gb"></span></div></div>')


def run_labels(runs: list[Run]) -> list[str]:
    """Each run's directory name, or its whole path where two names are the same."""
    names = [run.path.resolve().name for run in runs]
    return names if len(set(names)) == len(names) else [str(run.path) for run in runs]


def measured_section(runs: list[Run], labels: list[str]) -> str:
    if not runs:
        return ""
    from zerojax.report import plots  # matplotlib: only when a page is drawn, not for `memory` or `formats`
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
    from zerojax.report import plots  # matplotlib: only when a page is drawn, not for `memory` or `formats`

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
