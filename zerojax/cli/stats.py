"""`zerojax stats DIR`: a LeRobot v3.0 dataset's statistics (min, max, mean, std, count, q01, q10,
q50, q90, q99 of every feature), as LeRobot 0.6.1 computes them (`zerojax.data.lerobot.stats`), written to
DIR/meta/stats.json where the dataset has none (or to --out), alone or split over the processes of
a multi-process run (process 0 writes): the flags, or the launch the environment describes, as for
`zerojax train` (mesh.detect_launch). It imports jax for that alone; the statistics are numpy.

`--relative-actions` takes the action's statistics of relative actions, as openpi computes them
after its DeltaActions transform (`zerojax.data.lerobot.stats.Relative`): chunks of --horizon actions (or a
run's data.action_horizon, --run RUN_DIR) minus the frame's state, the joints --exclude (or the run's
model.action.relative_exclude) names kept absolute; written to DIR/meta/stats_relative.json by
default, so the absolute ones stay in place."""

from __future__ import annotations

import time
from pathlib import Path

from zerojax.cli.args import Parser, positive_int
from zerojax.errors import ConfigError

HELP = ("compute a LeRobot dataset's statistics, quantiles included (meta/stats.json), which a π0, π0.5 or SmolVLA "
        "run normalizes by")


def arguments(stats: Parser) -> None:
    stats.add_argument("dir", metavar="DIR", help="a LeRobot v3.0 dataset directory (meta/info.json)")
    stats.add_argument("--out", metavar="PATH", help="write here (default DIR/meta/stats.json, if it is absent)")
    stats.add_argument("--overwrite", action="store_true", help="replace DIR/meta/stats.json (or stats_relative.json) "
                                                                "if it is there")
    stats.add_argument("--relative-actions", action="store_true",
                       help="the action's statistics of relative actions, as openpi computes them after DeltaActions: "
                            "each frame's chunk of H actions minus the frame's state (default out: "
                            "DIR/meta/stats_relative.json)")
    stats.add_argument("--exclude", nargs="+", metavar="JOINT", default=[],
                       help="with --relative-actions: joints kept absolute, by the action's names in meta/info.json "
                            "(a name within a joint's excludes it, as LeRobot's relative_exclude_joints: gripper)")
    stats.add_argument("--horizon", type=positive_int, metavar="H", help="with --relative-actions: actions per chunk")
    stats.add_argument("--run", metavar="RUN_DIR", help="with --relative-actions: take H from a run's config.yaml "
                                                       "(data.action_horizon), and the joints kept absolute "
                                                       "(model.action.relative_exclude)")
    stats.add_argument("--coordinator", metavar="HOST:PORT", help="multi-process run: process 0's address")
    stats.add_argument("--num-processes", type=positive_int, metavar="P", help="processes in the run")
    stats.add_argument("--process-id", type=int, metavar="I", help="this process, 0..P-1")


def relative(args):
    """The --relative-actions flags as a `stats.Relative`, or None; ConfigError if they disagree."""
    from zerojax.data.lerobot.stats import Relative

    if not args.relative_actions:
        given = [f for f, v in (("--exclude", args.exclude), ("--horizon", args.horizon), ("--run", args.run)) if v]
        if given:
            raise ConfigError(f"{', '.join(given)}: only with --relative-actions (the action's statistics of "
                              "relative actions)")
        return None
    horizons, exclude = ({"--horizon": args.horizon} if args.horizon else {}), tuple(args.exclude)
    if args.run:
        horizons[f"--run {args.run}"] = run_horizon(Path(args.run))
        excluded = run_exclude(Path(args.run))
        if args.exclude and excluded and tuple(args.exclude) != excluded:
            raise ConfigError(f"the joints kept absolute: --exclude says {' '.join(args.exclude)} but --run {args.run} "
                              f"says model.action.relative_exclude={','.join(excluded)}; give one")
        exclude = exclude or excluded
    if not horizons:
        raise ConfigError("--relative-actions needs the chunk's length: --horizon H, or --run RUN_DIR to take a run's "
                          "data.action_horizon")
    if len(set(horizons.values())) > 1:
        raise ConfigError(f"the chunk's length: {' but '.join(f'{k} says {v}' for k, v in horizons.items())}; give one")
    return Relative(horizon=next(iter(horizons.values())), exclude=exclude)


def run_horizon(run_dir: Path) -> int:
    """data.action_horizon of a run's config.yaml (read as YAML: the run's checkpoint need not be at hand)."""
    import yaml

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"--run {str(run_dir)!r} is not a zerojax run directory (no config.yaml)")
    try:
        horizon = yaml.safe_load(path.read_text())["data"]["action_horizon"]
    except (yaml.YAMLError, KeyError, TypeError) as err:
        raise ConfigError(f"{path} holds no data.action_horizon ({type(err).__name__}: {err})") from None
    if not isinstance(horizon, int) or horizon < 1:
        raise ConfigError(f"{path}: data.action_horizon={horizon!r} is not a positive integer")
    return horizon


def run_exclude(run_dir: Path) -> tuple[str, ...]:
    """model.action.relative_exclude of a run's config.yaml (none where it has no such key)."""
    import yaml

    model = yaml.safe_load((run_dir / "config.yaml").read_text()).get("model") or {}
    return tuple(str(j) for j in ((model.get("action") or {}).get("relative_exclude") or ()))


def target(args) -> Path:
    """Where the statistics go, checked before any frame is read."""
    root = Path(args.dir)
    if not (root / "meta" / "info.json").is_file():
        what = "no such directory" if not root.is_dir() else "no meta/info.json in it"
        raise ConfigError(f"{root}: {what}; zerojax stats reads a LeRobot v3.0 dataset directory")
    name = "stats_relative.json" if args.relative_actions else "stats.json"
    out = Path(args.out) if args.out else root / "meta" / name
    if not args.out and out.exists() and not args.overwrite:
        raise ConfigError(f"{out} exists; give --out PATH to write elsewhere, or --overwrite to replace it")
    if out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a directory; give a file path, such as {str(out / 'stats.json')!r}")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {str(out)!r}: no directory {str(out.parent)!r}")
    return out


def run(args) -> int:
    from zerojax.data.lerobot import stats

    out, chunks = target(args), relative(args)
    if chunks:  # the dataset's names and widths, checked before any frame is read
        from zerojax.data.lerobot import read_info

        chunks.mask(read_info(Path(args.dir)))
    index, count = 0, 1
    import jax

    from zerojax.config.sections import MeshConfig
    from zerojax.parallel import mesh

    # the flags, else the launch the environment describes (srun, Open MPI, a TPU slice), as `train`
    if mesh.init_distributed(MeshConfig(), args.coordinator, args.num_processes, args.process_id):
        index, count = jax.process_index(), jax.process_count()
    start = time.perf_counter()
    result = stats.compute(args.dir, index, count, chunks)
    if index == 0:
        stats.write(result, out)
        frames = int(next(iter(result.values()))["count"][0]) if result else 0
        how = (f"; {stats.ACTION} relative to {stats.STATE}, chunks of {chunks.horizon}, "
               f"{', '.join(chunks.exclude) or 'no joint'} kept absolute") if chunks else ""
        print(f"zerojax: statistics of {len(result)} features ({frames} frames{how}) in {out} "
              f"({time.perf_counter() - start:.2f} s, {count} process{'es' if count > 1 else ''})")
    return 0
