"""The `zerojax` command line (DESIGN §4).

Bad input (a ValueError/TypeError from config loading or run preparation, or an argparse
error) prints one `zerojax: error: ...` line on stderr and exits 2 before anything is written;
any other failure exits 1 with its traceback.
"""

from __future__ import annotations

import argparse
import sys


class UsageError(Exception):
    """Bad input: reported as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + error; the contract wants one line
        raise UsageError(message)


def build_parser() -> Parser:
    parser = Parser(prog="zerojax", description="ZeRO / FSDP training in JAX")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    train = sub.add_parser("train", help="train a model (default: the tiny GPT on the stdlib corpus)")
    train.add_argument("--config", help="YAML config file (see configs/)")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                       help="override a config field by dotted name, e.g. zero.stage=1 train.steps=50")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def cmd_train(args) -> int:
    from zerojax import config, train

    try:
        cfg = config.load(args.config, args.overrides)
        setup = train.prepare(cfg)
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from None
    print(f"zerojax: training {cfg.name}: {setup.mesh.devices.size} {setup.mesh.devices.flat[0].platform} "
          f"devices, mesh {dict(setup.mesh.shape)}, stage {cfg.zero.stage}, compute {setup.policy.compute.name}")
    result = train.run(cfg, show_progress=not args.no_progress, setup=setup)
    last = result["history"][-1] if result["history"] else {}
    summary = ", ".join(f"{k} {last[k]:.4f}" for k in ("loss", "eval_loss") if k in last)
    print(f"zerojax: done: {summary}; run directory {result['run_dir']}")
    print("sample:\n" + result["sample"])
    return 0


COMMANDS = {"train": cmd_train}


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except UsageError as err:
        print(f"zerojax: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("zerojax: interrupted", file=sys.stderr)
        return 130
