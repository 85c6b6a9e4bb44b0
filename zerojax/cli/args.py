"""What every command of the `zerojax` CLI shares: the one-line parser, the usage error and the
argument types (counts such as 124M, stage lists, ports), and the `--xla-preset` hook."""

from __future__ import annotations

import argparse
import math
import sys

from zerojax.config import rules


class UsageError(Exception):
    """Bad input: reported as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + error; the contract wants one line
        raise UsageError(message)


SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """7.5e9, 7500000000, 124M, 3B, 1.5T (and sizes: 5GB, 500MB)."""
    text = text[:-1] if text[-2:].lower() in ("kb", "mb", "gb", "tb") else text
    scale = SUFFIXES.get(text[-1:].lower(), 1)
    try:
        value = float(text[:-1] if scale != 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count; use e.g. 7.5e9, 124M or 3B") from None
    if not 0 < value < math.inf:  # NaN fails too
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def stage_list(text: str) -> tuple[int, ...]:
    try:
        stages = tuple(int(s) for s in text.split(","))
    except ValueError:
        stages = ()
    if not stages or any(s not in rules.STAGES for s in stages):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of stages; use e.g. 0,1,2,3 or 3")
    return stages


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def port_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port; use 0-65535 (0: any free port)")
    return value


def add_xla_preset(parser: Parser) -> None:
    parser.add_argument("--xla-preset", choices=rules.XLA_PRESETS,
                        help="XLA flags that overlap collectives with compute")


def xla_preset(args) -> None:
    """Set the preset's XLA flags before jax starts (they are read once, at its first use)."""
    if getattr(args, "xla_preset", None):
        from zerojax.parallel.mesh import apply_xla_preset

        print(f"zerojax: XLA preset {args.xla_preset}: {apply_xla_preset(args.xla_preset)}", file=sys.stderr)
