"""Charts for the HTML report, as SVG text to inline: a run's curves and `zerojax analyze`'s bars.

matplotlib draws them with its own SVG backend, through `Figure` (no pyplot, no global backend,
nothing left open). Text stays text (`svg.fonttype: none`): the page's fonts render it and the
files stay small. Every line keeps all its logged points (`path.simplify: False`): the tests
count them, and a reader can trust a kink in the curve.
"""

from __future__ import annotations

import io
import matplotlib as mpl
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator


STYLE = {
    "svg.fonttype": "none", "path.simplify": False, "font.size": 9, "axes.titlesize": 10,
    "axes.titleweight": "bold", "axes.titlelocation": "left", "axes.spines.top": False,
    "axes.spines.right": False, "axes.grid": True, "grid.color": "#e3e6ea", "grid.linewidth": 0.8,
    "axes.edgecolor": "#9aa3ad", "axes.labelcolor": "#39424e", "xtick.color": "#5b6570",
    "ytick.color": "#5b6570", "legend.frameon": False, "legend.fontsize": 8,
}
COLORS = ("#2563eb", "#d97706", "#059669", "#dc2626", "#7c3aed", "#0891b2", "#be185d", "#4b5563")
MEASURED, FORMULA = "#2563eb", "#cbd2da"

# (metrics key, panel title, y label); the loss panel adds eval_loss, the loss-scale panel the
# skipped steps
CURVES = (
    ("loss", "Loss", "nats per token"),
    ("lr", "Learning rate", "lr"),
    ("grad_norm", "Gradient norm", "global L2 norm"),
    ("loss_scale", "Loss scale", "scale (log2 axis)"),
    ("tokens_per_sec", "Throughput", "tokens / s"),
)


def to_svg(fig: Figure, name: str) -> str:
    """The figure as one <svg> element. `name` salts matplotlib's element ids, so that several
    figures inlined in one page never share an id, and the same figure always gets the same."""
    buffer = io.StringIO()
    with mpl.rc_context({"svg.hashsalt": f"zerojax-{name}"}):
        fig.savefig(buffer, format="svg", metadata={"Date": None}, bbox_inches="tight")
    text = buffer.getvalue()
    return text[text.index("<svg"):]


def curves(runs: list[tuple[str, list[dict]]]) -> dict[str, str]:
    """One SVG per metric in CURVES, every run overlaid in its own colour; the lines carry ids
    `<key>-<run index>` (eval loss: `eval_loss-<i>`, skipped steps: `skipped-<i>`)."""
    runs = [(label.replace("$", r"\$"), lines) for label, lines in runs]  # a label is text, not mathtext
    out = {}
    with mpl.rc_context(STYLE):
        for key, title, ylabel in CURVES:
            fig = Figure(figsize=(6.0, 2.9))
            ax = fig.add_subplot()
            for i, (label, lines) in enumerate(runs):
                _plot_metric(ax, key, i, label, lines)
            ax.set_title(title)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            if key == "loss_scale":
                ax.set_yscale("log", base=2)
            _legend(ax, key, runs)
            out[key] = to_svg(fig, key)
    return out


def _plot_metric(ax, key: str, i: int, label: str, lines: list[dict]) -> None:
    color = COLORS[i % len(COLORS)]
    points = [(x["step"], x[key]) for x in lines if x.get(key) is not None]
    if points:
        ax.plot(*zip(*points), color=color, linewidth=1.6, label=label, gid=f"{key}-{i}")
    if key == "loss":
        evals = [(x["step"], x["eval_loss"]) for x in lines if x.get("eval_loss") is not None]
        if evals:
            ax.plot(*zip(*evals), color=color, linewidth=1.2, linestyle="--", marker="o", markersize=4,
                    gid=f"eval_loss-{i}")
    if key == "loss_scale":
        skipped = [(x["step"], x["loss_scale"]) for x in lines if x.get("skipped")]
        if skipped:
            ax.plot(*zip(*skipped), linestyle="none", marker="x", markersize=7, markeredgewidth=1.8,
                    color="#dc2626", gid=f"skipped-{i}")


def _legend(ax, key: str, runs) -> None:
    handles = [Line2D([], [], color=COLORS[i % len(COLORS)], linewidth=1.6, label=label)
               for i, (label, _) in enumerate(runs)] if len(runs) > 1 else []
    if key == "loss":
        handles += [Line2D([], [], color="#5b6570", linewidth=1.6, label="train loss"),
                    Line2D([], [], color="#5b6570", linewidth=1.2, linestyle="--", marker="o", markersize=4,
                           label="eval loss")]
    if key == "loss_scale":
        skipped = sum(bool(x.get("skipped")) for _, lines in runs for x in lines)
        handles.append(Line2D([], [], linestyle="none", marker="x", color="#dc2626", markeredgewidth=1.8,
                              label=f"skipped step ({skipped} among the logged)"))
    if handles:
        ax.legend(handles=handles, loc="best")


def _unit(top: float) -> tuple[float, str]:
    """A decimal unit for an axis whose largest value is `top` bytes (as the paper: 1 GB = 1e9 B)."""
    for scale, name in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
        if top >= scale:
            return scale, name
    return 1.0, "B"


def analyze_bars(doc: dict, name: str) -> str:
    """Per stage, what XLA measured for the compiled step next to docs/design.md §2's formula:
    the persistent state (arguments) and the bytes each device sends per step; and the
    transient bytes (temporaries), which have no closed formula. One SVG of three panels."""
    stages = sorted(doc["stages"], key=int)
    panels = (
        ("Persistent state per device", "argument_bytes", "formula_bytes"),
        ("Transient (temporaries) per device", "temp_bytes", None),
        ("Bytes sent per device per step", "comm_bytes", "comm_theory_bytes"),
    )
    with mpl.rc_context(STYLE):
        fig = Figure(figsize=(12.4, 3.0))
        for k, (title, measured, formula) in enumerate(panels):
            ax = fig.add_subplot(1, 3, k + 1)
            keys = (measured,) + ((formula,) if formula else ())
            scale, unit = _unit(max(doc["stages"][s][key] for s in stages for key in keys))
            width = 0.38 if formula else 0.55
            for j, key in enumerate(keys):
                offset = (j - (len(keys) - 1) / 2) * width
                values = [doc["stages"][s][key] / scale for s in stages]
                bars = ax.bar([int(s) + offset for s in stages], values, width,
                              color=MEASURED if key == measured else FORMULA)
                for bar, stage in zip(bars, stages):
                    bar.set_gid(f"{name}-{key}-{stage}")  # e.g. analyze-0-argument_bytes-3
                ax.bar_label(bars, fmt="%.3g", fontsize=7, padding=2, color="#39424e")
            ax.set_title(title)
            ax.set_xticks([int(s) for s in stages], [f"stage {s}" for s in stages])
            ax.set_ylabel(unit)
            ax.margins(y=0.15)
            ax.grid(axis="x", visible=False)
        fig.legend(handles=[Patch(color=MEASURED, label="measured: XLA's compiled step"),
                            Patch(color=FORMULA, label="formula: docs/design.md §2")],
                   loc="upper right", ncols=2)
        fig.tight_layout(rect=(0, 0, 1, 0.93))
        return to_svg(fig, name)
