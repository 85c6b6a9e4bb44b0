"""`zerojax plan`: the settings (stage, offload, remat, accumulation, gather dtype, prefetch) that
fit N devices of a kind, chosen from compiled steps; exit 2 where nothing fits."""

from __future__ import annotations

import shlex
import sys
import time

from zerojax import config, report
from zerojax.cli.args import Parser, UsageError, positive_int
from zerojax.config import devices as devices_lib

HELP = ("choose stage, offload, remat, accumulation, gather dtype and prefetch for N devices of M GB, from compiled "
        "steps, for any family (GPT, Llama, Gemma, PaliGemma, π0, π0.5, SmolVLA)")
DEVICE_KINDS = tuple(devices_lib.DEVICES)


def arguments(plan: Parser) -> None:
    plan.add_argument("--config", help="YAML config file (see configs/)")
    plan.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides (kept fixed by the search)")
    plan.add_argument("--devices", type=positive_int, required=True, metavar="N", help="devices in the run")
    plan.add_argument("--device", default="h100", metavar="KIND",
                      help=f"the device kind the step time is estimated for: {', '.join(DEVICE_KINDS)} (default h100)")
    plan.add_argument("--device-memory", metavar="SIZE", help="memory per device, e.g. 24GB, 24GiB (default: the kind's)")
    plan.add_argument("--hosts", type=positive_int, default=1, metavar="H",
                      help="hosts the devices are spread over: collectives then cross the network")
    plan.add_argument("--margin", default="1GB", metavar="SIZE",
                      help="kept free of the budget for what the compiled train step does not count: the batches "
                           "in flight, the eval step, the allocator's fragmentation (default 1GB)")
    plan.add_argument("--max-compiles", type=positive_int, metavar="N",
                      help="compile at most N candidates, most memory-saving first (default 12); fewer: a quicker, "
                           "coarser answer")
    plan.add_argument("--json", action="store_true", help="print one JSON document")


def run(args) -> int:
    dev = devices_lib.device(args.device)
    memory = devices_lib.parse_size(args.device_memory) if args.device_memory else dev.memory_bytes
    margin = devices_lib.parse_size(args.margin, "--margin", zero=True)
    if args.devices % args.hosts:
        raise UsageError(f"--devices {args.devices} must be divisible by --hosts {args.hosts}")
    cfg = config.load(args.config, args.overrides)  # bad input surfaces here, before compiling
    from zerojax.data import sources

    sources.check_fits(cfg, sources.kind_of(cfg), compile_only=True)  # before the first candidate's line
    from zerojax.analysis import plan  # jax: the steps are compiled

    plan.simulate_on_cpu()
    target = plan.Target(dev, args.devices, devices_lib.budget_bytes(memory, margin), args.hosts)
    start = time.perf_counter()
    doc = plan.search(cfg, target, log=lambda message: print(f"zerojax: {message}", file=sys.stderr),
                      max_compiles=args.max_compiles or plan.MAX_COMPILES)
    doc["search_s"] = round(time.perf_counter() - start, 1)
    if doc["winner"]:
        doc["train_command"] = train_command(args, doc["winner"]["overrides"])
    report.emit(doc, args.json, report.plan_tables)
    return 0 if doc["winner"] else 2


def train_command(args, chosen: list[str]) -> str:
    """The `zerojax train` line that runs the winner, as the user can paste it: their config file
    and overrides (which the search kept fixed), then the chosen keys."""
    config_file = ["--config", args.config] if args.config else []
    return shlex.join(["zerojax", "train", *config_file, *args.overrides, *chosen])
