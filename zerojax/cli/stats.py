"""`zerojax stats DIR`: a LeRobot v3.0 dataset's statistics (min, max, mean, std, count, q01, q10,
q50, q90, q99 of every feature), as LeRobot 0.6.1 computes them (`zerojax.data.lerobot.stats`), written to
DIR/meta/stats.json where the dataset has none (or to --out), alone or split over the processes of
a multi-process run (process 0 writes): the flags, or the launch the environment describes, as for
`zerojax train` (mesh.detect_launch). It imports jax for that alone; the statistics are numpy."""

from __future__ import annotations

import time
from pathlib import Path

from zerojax.cli.args import Parser, positive_int
from zerojax.errors import ConfigError

HELP = "compute a LeRobot dataset's statistics, quantiles included (meta/stats.json)"


def arguments(stats: Parser) -> None:
    stats.add_argument("dir", metavar="DIR", help="a LeRobot v3.0 dataset directory (meta/info.json)")
    stats.add_argument("--out", metavar="PATH", help="write here (default DIR/meta/stats.json, if it is absent)")
    stats.add_argument("--overwrite", action="store_true", help="replace DIR/meta/stats.json if it is there")
    stats.add_argument("--coordinator", metavar="HOST:PORT", help="multi-process run: process 0's address")
    stats.add_argument("--num-processes", type=positive_int, metavar="P", help="processes in the run")
    stats.add_argument("--process-id", type=int, metavar="I", help="this process, 0..P-1")


def target(args) -> Path:
    """Where the statistics go, checked before any frame is read."""
    root = Path(args.dir)
    if not (root / "meta" / "info.json").is_file():
        what = "no such directory" if not root.is_dir() else "no meta/info.json in it"
        raise ConfigError(f"{root}: {what}; zerojax stats reads a LeRobot v3.0 dataset directory")
    out = Path(args.out) if args.out else root / "meta" / "stats.json"
    if not args.out and out.exists() and not args.overwrite:
        raise ConfigError(f"{out} exists; give --out PATH to write elsewhere, or --overwrite to replace it")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {str(out)!r}: no directory {str(out.parent)!r}")
    return out


def run(args) -> int:
    from zerojax.data.lerobot import stats

    out = target(args)
    index, count = 0, 1
    import jax

    from zerojax.config.sections import MeshConfig
    from zerojax.parallel import mesh

    # the flags, else the launch the environment describes (srun, Open MPI, a TPU slice), as `train`
    if mesh.init_distributed(MeshConfig(), args.coordinator, args.num_processes, args.process_id):
        index, count = jax.process_index(), jax.process_count()
    start = time.perf_counter()
    result = stats.compute(args.dir, index, count)
    if index == 0:
        stats.write(result, out)
        frames = int(next(iter(result.values()))["count"][0]) if result else 0
        print(f"zerojax: statistics of {len(result)} features ({frames} frames) in {out} "
              f"({time.perf_counter() - start:.2f} s, {count} process{'es' if count > 1 else ''})")
    return 0
