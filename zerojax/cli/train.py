"""`zerojax train`: a config (and KEY=VALUE overrides) trained to its run directory, alone or as
one process of a multi-process run."""

from __future__ import annotations

import os
import sys

from zerojax import config, report
from zerojax.config import policy_keys
from zerojax.cli.args import Parser, add_xla_preset, positive_int, xla_preset

HELP = "train a model (default: the tiny GPT on the stdlib corpus)"


def arguments(train: Parser) -> None:
    train.add_argument("--config", help="YAML config file (see configs/)")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                       help="override a config field by dotted name, e.g. zero.stage=1 train.steps=50")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_xla_preset(train)
    train.add_argument("--coordinator", metavar="HOST:PORT", help="multi-process run: process 0's address")
    train.add_argument("--num-processes", type=positive_int, metavar="P", help="processes in the run")
    train.add_argument("--process-id", type=int, metavar="I", help="this process, 0..P-1")


def jax_process_index() -> int:
    import jax

    return jax.process_index()


def run(args) -> int:
    from zerojax import train
    from zerojax.data import idle
    from zerojax.parallel import mesh

    xla_preset(args)
    cfg, origins = config.load_with_origins(args.config, args.overrides)
    mesh.init_distributed(cfg.mesh, args.coordinator, args.num_processes, args.process_id)
    setup = train.prepare(cfg)
    if jax_process_index() != 0:  # process 0 speaks for the run
        sys.stdout = open(os.devnull, "w")
    print(f"zerojax: training {cfg.name} ({cfg.model.family}): {setup.mesh.devices.size} "
          f"{setup.mesh.devices.flat[0].platform} devices, mesh {dict(setup.mesh.shape)}{mesh.shape_note(cfg.mesh)}, "
          f"stage {cfg.zero.stage}, compute {setup.engine.policy.compute.name}{idle.start_note(setup.source)}")
    if origins:  # a policy's: where its shapes, normalization, tokenizer and schedule came from
        print(f"zerojax: {policy_keys.describe(origins, cfg)}")
    if setup.resume_step:
        print(f"zerojax: resuming from the checkpoint at step {setup.resume_step} in {cfg.run_dir}/checkpoints")
    result = train.run(cfg, show_progress=not args.no_progress, setup=setup)
    if cfg.train.report and jax_process_index() == 0:
        report.write_page([report.read_run(cfg.run_dir)], cfg.run_dir / "report.html")
        print(f"zerojax: report {cfg.run_dir / 'report.html'}")
    return _summary(cfg, result)


def _summary(cfg, result) -> int:
    stopped = result.stopped
    if stopped:
        print(f"zerojax: stopped by {stopped.signal} after step {stopped.step}; "
              f"checkpoint saved in {cfg.run_dir}/checkpoints/{stopped.step}; rerun the same command "
              "to continue")
        return 0
    last = result.history[-1] if result.history else {}
    summary = ", ".join(f"{k} {last[k]:.4f}" for k in ("loss", "eval_loss") if k in last)
    print(f"zerojax: done: {summary}; run directory {result.run_dir}")
    if result.sample:
        print("sample:\n" + result.sample)
    return 0
