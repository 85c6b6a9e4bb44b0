"""A run directory as the report reads it: its config, metrics and (compiled when missing)
`analyze.json`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
import yaml
from zerojax import config as config_lib
from zerojax.errors import ConfigError


ANALYSIS = "analyze.json"  # in a run directory: `zerojax analyze --json` of the run's config


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
    from zerojax.analysis import measure  # jax: only a run without its analyze.json pays for it

    doc = measure.analyze(config_lib.load(run.path / "config.yaml"))
    (run.path / ANALYSIS).write_text(json.dumps(doc, allow_nan=False))
    return dataclasses.replace(run, analysis=doc)
