"""The `zerojax` command line (docs/design.md §4): the parser assembled from one module per
command (its arguments, `HELP` and `run`), and `main`, which turns errors into exit codes.

Bad input (a `ConfigError` from anywhere in zerojax, or an argparse error) prints one
`zerojax: error: ...` line on stderr and exits 2 before anything is written; a run that cannot
form its mesh or go on (`DistributedError`, `TrainingError`) prints one line and exits 1; any
other failure, including a bug in a user's model, exits 1 with its traceback.

The choices of the options are the config's enumerations (`config.rules`). Only the commands
that build a model import jax (train, analyze, export, generate, serve, report's analysis,
memory --config; stats, for jax.distributed alone), in their own bodies: `zerojax memory
--params` and `zerojax formats` answer without it; only `serve`, `client`, `collect` and `rollout` import their extras (websockets, msgpack; metaworld,
mujoco).
"""

from __future__ import annotations

import logging
import sys

from zerojax.cli import (analyze, client, collect, export, formats, generate, memory, plan, report, rollout, serve,
                         stats, tokenizer, train)
from zerojax.cli.args import Parser, UsageError, parse_count, stage_list
from zerojax.errors import ConfigError, DistributedError, TrainingError

__all__ = ["main", "build_parser", "UsageError", "parse_count", "stage_list"]

# In the order `zerojax --help` lists them.
COMMANDS = {"train": train, "memory": memory, "analyze": analyze, "plan": plan, "export": export,
            "generate": generate, "serve": serve, "client": client, "collect": collect, "rollout": rollout, "tokenizer": tokenizer, "report": report,
            "formats": formats, "stats": stats}


def build_parser() -> Parser:
    parser = Parser(prog="zerojax", description="ZeRO / FSDP training in JAX, of language models (GPT, Llama, Gemma, "
                                                 "PaliGemma) and robot policies (π0, π0.5, SmolVLA)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, command in COMMANDS.items():
        command.arguments(sub.add_parser(name, help=command.HELP, description=command.HELP))
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(format="zerojax: %(levelname)s: %(message)s", level=logging.WARNING)
    logging.addLevelName(logging.WARNING, "warning")
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command].run(args)
    except (UsageError, ConfigError) as err:
        print(f"zerojax: error: {err}", file=sys.stderr)
        return 2
    except (DistributedError, TrainingError) as err:
        print(f"zerojax: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("zerojax: interrupted", file=sys.stderr)
        return 130
