"""metrics.jsonl: one JSON object per logged step, continued after a resume (the lines of the
steps that will run again dropped) and written by process 0 only."""

from __future__ import annotations

import contextlib
import json
import math
import os

import jax

from zerojax.errors import ConfigError


def write_line(log, line: dict) -> None:
    """One line, flushed (a kill loses at most the line being written: `kept_metrics` drops it).
    Strict JSON: a non-finite value (a loss of inf or NaN) is written as null."""
    log.write(json.dumps(finite(line), allow_nan=False) + "\n")
    log.flush()


def finite(line: dict) -> dict:
    """`line` with each non-finite float as None (JSON's null: NaN and Infinity are not JSON)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in line.items()}


@contextlib.contextmanager
def open_metrics(path, resume_step: int, lead: bool = True):
    """metrics.jsonl, continued after `resume_step` (later lines from an unfinished run dropped);
    only process 0 writes it."""
    if not lead:
        with open(os.devnull, "w") as f:
            yield f
        return
    kept = kept_metrics(path, resume_step) if resume_step else []
    path.write_text("".join(line + "\n" for line in kept))
    with path.open("a") as f:
        yield f


def kept_metrics(path, resume_step: int) -> list[str]:
    """The lines of metrics.jsonl up to `resume_step` (later ones belong to the steps that will be
    run again). A last line without its newline is a write cut short by a kill: dropped."""
    text = path.read_text() if path.is_file() else ""
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        lines.pop()
    kept = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            step = json.loads(line)["step"]
        except (json.JSONDecodeError, TypeError, KeyError):
            step = None
        if not isinstance(step, int):
            raise ConfigError(f"{path}, line {number}: {line[:60]!r} is not a metrics line (JSON with a step); "
                              "repair or delete that line to resume")
        if step <= resume_step:
            kept.append(line)
    return kept


def metrics_line(step: int, metrics: dict, tokens_per_sec: float) -> dict:
    """The metrics.jsonl object of one step (docs/design.md §6)."""
    m = jax.device_get(metrics)
    return {"step": step, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
            "lr": float(m["lr"]), "loss_scale": float(m["loss_scale"]), "skipped": bool(m["skipped"]),
            "tokens_per_sec": round(tokens_per_sec, 1)}
