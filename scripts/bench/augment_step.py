"""What data.augment costs a policy's training step (BENCHMARKS.md, "Image augmentation's cost").

    python scripts/bench/augment_step.py [--batch 8] [--image-size 224] [--rounds 5] [--steps 3]
                                         [--dataset tests/fixtures/lerobot/tiny] [--json]

One process compiles three train steps of the same tiny π0 (`zerojax.analysis.measure.compile_step`,
the step `zerojax train` runs; one device, stage 0, fp32, no remat, three camera slots at
--image-size: the dataset's front and wrist cameras and an empty one), with data.augment=none,
openpi and lerobot, and the augmentation alone (`engine.augment` jitted on the batch). The rounds
alternate the three steps, --steps each, so that all see the same machine load; the table gives
each one's median seconds a step and the augmentation's share. XLA gets one compute thread
(`--xla_cpu_multi_thread_eigen=false`), as scripts/bench/policy_step.py's default: on this shared
2-core box more threads measure the load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("none", "openpi", "lerobot")


def overrides(kind: str, batch: int, size: int, dataset: str) -> list[str]:
    """A tiny π0 at `size` pixels (patches of 16: (size/16)^2 tokens a camera) on `dataset`."""
    return ["model.family=pi0", "model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=2",
            "model.n_kv_heads=1", "model.head_dim=32", "model.d_ff=128", "model.expert.d_model=32",
            "model.expert.d_ff=64", f"model.vision.image_size={size}", "model.vision.patch_size=16",
            "model.vision.d_model=64", "model.vision.n_layers=2", "model.vision.n_heads=2", "model.vision.d_ff=128",
            "model.action.horizon=10", "model.action.prompt_len=16", "model.action.max_state_dim=8",
            "model.action.max_action_dim=4", "model.action.cameras=3", f"data.image_size={size}",
            "data.action_horizon=10", "data.prompt_len=16", f"data.source=lerobot:{dataset}",
            f"train.global_batch={batch}", "mesh.data=1", "mesh.replica=1", "zero.stage=0", "precision.compute=float32",
            "model.remat=none", f"data.augment={kind}"]


def build(kind: str, args):
    """(run n steps -> seconds, run n augmentations -> seconds) for data.augment=kind."""
    import jax

    from zerojax import config as config_lib
    from zerojax.analysis import measure as measure_lib
    from zerojax.parallel import mesh as mesh_lib
    from zerojax.train import state as state_lib

    from benchlib.measure import random_batch  # the bench's batch of the config's shapes

    cfg = config_lib.load(None, overrides(kind, args.batch, args.image_size, args.dataset))
    engine, compiled = measure_lib.compile_step(cfg)
    batch = random_batch(cfg, jax.random.key(0), mesh_lib.batch_sharding(engine.mesh))
    box = {"state": state_lib.init_state(engine)}
    augment = jax.jit(engine.augment) if engine.augment is not None else None

    def steps(n: int) -> float:
        jax.block_until_ready(box["state"])
        start = time.perf_counter()
        for _ in range(n):
            box["state"], metrics = compiled(box["state"], batch)
        float(metrics["loss"])  # waits for the last step
        return time.perf_counter() - start

    def augments(n: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            out = augment(batch, i)
        jax.block_until_ready(out)
        return time.perf_counter() - start

    steps(1), augment and augments(1)  # warm up (compiled already; the first run allocates)
    return steps, augments if augment else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dataset", default=str(ROOT / "tests" / "fixtures" / "lerobot" / "tiny"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts" / "bench")]
    runs = {kind: build(kind, args) for kind in KINDS}
    step_s = {kind: [] for kind in KINDS}
    aug_s = {kind: [] for kind in KINDS[1:]}
    for _ in range(args.rounds):
        for kind, (steps, augments) in runs.items():
            step_s[kind].append(steps(args.steps) / args.steps)
            if augments is not None:
                aug_s[kind].append(augments(args.steps) / args.steps)
    median = {kind: statistics.median(v) for kind, v in step_s.items()}
    doc = {"batch": args.batch, "image_size": args.image_size, "cameras": 3, "rounds": args.rounds,
           "steps": args.steps, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "step_s": median, "augment_alone_s": {k: statistics.median(v) for k, v in aug_s.items()},
           "overhead": {k: median[k] / median["none"] - 1 for k in KINDS[1:]}}
    if args.json:
        print(json.dumps(doc))
        return
    print(f"batch {args.batch}, 3 camera slots of {args.image_size}x{args.image_size}, medians of {args.rounds} rounds")
    print("| data.augment | s a step | augmentation alone (s) | step vs none |")
    print("|---|---|---|---|")
    for kind in KINDS:
        alone = f"{doc['augment_alone_s'][kind]:.4f}" if kind != "none" else "-"
        vs = f"{doc['overhead'][kind]:+.1%}" if kind != "none" else "-"
        print(f"| {kind} | {median[kind]:.4f} | {alone} | {vs} |")


if __name__ == "__main__":
    main()
