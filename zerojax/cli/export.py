"""`zerojax export`: a run's (sharded) checkpoint as one safetensors file, a Hugging Face or
peft directory, or a LeRobot policy directory."""

from __future__ import annotations

import json
from pathlib import Path

from zerojax.cli.args import Parser, UsageError, parse_count
from zerojax.checkpoints import format as checkpoints
from zerojax.config import rules

HELP = ("a run's (sharded) checkpoint as one safetensors file, a Hugging Face or PEFT directory, or a LeRobot "
        "(π0, π0.5, SmolVLA) or openpi (π0, π0.5) checkpoint")


def arguments(export: Parser) -> None:
    export.add_argument("run_dir", metavar="RUN_DIR")
    export.add_argument("--out", required=True,
                        help="FILE.safetensors (--format safetensors) or a new DIR (hf, peft, lerobot, openpi)")
    export.add_argument("--format", choices=checkpoints.writable(), default="safetensors",
                        help="safetensors: zerojax's parameter paths; hf: what transformers loads; "
                             "peft: a LoRA run's adapters, as peft.PeftModel.from_pretrained loads them; "
                             "lerobot: a pi0, pi05 or smolvla run as LeRobot's from_pretrained loads it (0.6's layout with "
                             "processor files; 0.3's for a run that started from a 0.3 checkpoint); openpi: a pi0 or pi05 run "
                             "as openpi's restore_params loads it (params/ orbax tree, assets/ norm_stats.json)")
    export.add_argument("--dataset", metavar="NAME",
                        help="lerobot, of a mixture run (data.source=mixture): the dataset whose policy to write (its "
                             "directory or that directory's name), with its statistics, cameras and widths")
    export.add_argument("--merge", action="store_true",
                        help="hf, lerobot or openpi, of a LoRA run: the adapters merged into the weights")
    export.add_argument("--max-shard-size", type=parse_count, default=5e9, metavar="SIZE",
                        help="hf: the largest safetensors shard, e.g. 5GB (default), 500M")
    export.add_argument("--dtype", choices=rules.EXPORT_DTYPES, default="float32")
    export.add_argument("--step", type=int, help="a checkpoint step (default: the newest)")
    export.add_argument("--weights", choices=rules.EXPORT_WEIGHTS,
                        help="ema: the optim.ema average of the trained weights, raw: the weights themselves "
                             "(default: ema when the checkpoint holds one)")
    export.add_argument("--json", action="store_true", help="print one JSON document")


def run(args) -> int:
    from zerojax.train import export as export_lib

    out = Path(args.out)
    if args.format == "safetensors" and out.suffix != ".safetensors":
        raise UsageError(f"--out {args.out!r} must end in .safetensors (or use --format hf for a directory)")
    if args.dataset is not None and args.format != "lerobot":
        raise UsageError(f"--dataset picks one dataset of a mixture run for --format lerobot, which holds one "
                         f"normalization; --format {args.format} carries every dataset's: drop --dataset")
    done = export_lib.export(Path(args.run_dir), out, args.dtype, args.step, args.format, int(args.max_shard_size),
                             merge=args.merge, weights=args.weights, dataset=args.dataset)
    print(json.dumps(done) if args.json else
          f"zerojax: wrote {done['out']} ({args.format}): {done['tensors']} tensors, {done['params']:,} parameters "
          f"({args.dtype}, {done['weights']} weights) from step {done['step']}")
    return 0
