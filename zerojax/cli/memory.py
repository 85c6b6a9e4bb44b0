"""`zerojax memory`: the ZeRO memory calculator. With --params it is arithmetic and imports no
jax (tests/test_memory.py checks); with --config it takes Ψ from the config's abstract model."""

from __future__ import annotations

import math

from zerojax import config, formats, report
from zerojax.analysis import formulas
from zerojax.cli.args import Parser, UsageError, parse_count, positive_int
from zerojax.config import rules

HELP = "the ZeRO memory calculator: model-state bytes per device"


def arguments(memory: Parser) -> None:
    memory.add_argument("--params", type=parse_count, help="parameters Ψ (7.5e9, 124M, 3B)")
    memory.add_argument("--config", help="take Ψ from this config's model (abstract shapes)")
    memory.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides (with --config)")
    memory.add_argument("--devices", type=positive_int, help="devices N on the data axis")
    memory.add_argument("--k", type=float, default=12, help="optimizer bytes per parameter (Adam: 12)")
    memory.add_argument("--trainable", type=parse_count,
                        help="parameters trained (LoRA adapters, unfrozen leaves); the rest are frozen")
    memory.add_argument("--frozen-bytes", type=float, default=2,
                        help="bytes per frozen parameter (precision.frozen: bfloat16 2, float32 4)")
    memory.add_argument("--offload", choices=rules.OFFLOADS, default=None,
                        help="zero.offload: the bill with m and v (optimizer), or the master too, in host memory "
                             "(default: the config's, else none)")
    memory.add_argument("--json", action="store_true", help="print one JSON document")


def run(args) -> int:
    params, devices = args.params, args.devices
    if args.config is None and args.overrides:
        raise UsageError("KEY=VALUE overrides need --config")
    if (params is None) == (args.config is None):
        raise UsageError("give exactly one of --params P or --config PATH")
    if not 0 <= args.k < math.inf:
        raise UsageError(f"--k {args.k} must be a finite number >= 0 (Adam with fp32 master: 12)")
    trained, frozen_bytes, offload, ema = args.trainable, args.frozen_bytes, args.offload or "none", False
    if args.config is not None:
        from zerojax.analysis import measure  # jax: Ψ from the abstract model

        cfg = config.load(args.config, args.overrides)
        offload = args.offload or cfg.zero.offload
        params, trained = measure.param_counts(cfg)
        frozen_bytes = formats.dtype(cfg.precision.frozen).itemsize
        ema = cfg.optim.ema > 0
        devices = devices or (cfg.mesh.data if cfg.mesh.data > 0 else None)
    if devices is None:
        raise UsageError("give --devices N (the devices on the data axis)")
    if trained is not None and not 0 < trained <= params:
        raise UsageError(f"--trainable {trained:g} must be in (0, --params {params:g}]")
    if not 0 < frozen_bytes < math.inf:
        raise UsageError(f"--frozen-bytes {frozen_bytes:g} must be a finite number > 0")
    params = int(params) if float(params).is_integer() else params
    doc = formulas.memory_report(params, devices, args.k, trained, frozen_bytes, offload, ema)
    report.emit(doc, args.json, report.memory_table)
    return 0
