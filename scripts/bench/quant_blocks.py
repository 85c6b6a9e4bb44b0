"""What a quantized gather's block size and scale dtype trade: bytes against error (BENCHMARKS.md).

    python scripts/bench/quant_blocks.py [--weights FILE.safetensors] [--blocks 256,2048] [KEY=VALUE ...]

For int8 at each `zero.quant_block` of `--blocks` with float32 and with bfloat16 scales, and for
float8_e4m3fn at 2048 with float32 scales: the bytes one gathered element costs (b_g = 1 + scale bytes / block), the relative RMS error of
the weights as stage 3's forward sees them (`explicit.gathered_weights`: each unit's per-device flat
buffer quantized in blocks and dequantized) against the master, and the eval loss of the model
at those weights next to the master's own. `--weights`: a `zerojax export` of a trained run
(default: the initialisation).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's zerojax
from zerojax import config, train
from zerojax.schedules import quant
from zerojax.schedules import explicit
from zerojax.train import step as step_lib


def measure(setup, master, exact_loss: float, fmt: str, block: int, scale: str) -> dict:
    step = setup.engine
    policy = dataclasses.replace(step.policy, gather=jnp.dtype(fmt), quant_block=block, quant_scale=jnp.dtype(scale),
                                 compute=jnp.dtype(jnp.float32))
    seen = explicit.gathered_weights(step.mesh, step.plan, policy, step.units)(master)
    sharded = [p.dim is not None for p in jax.tree.leaves(step.plan.leaves)]  # small leaves are not gathered
    pairs = [(np.asarray(w), np.asarray(s)) for w, s, on in
             zip(jax.tree.leaves(step.plan.unpad(master)), jax.tree.leaves(seen), sharded) if on]
    error = np.sqrt(sum(((w - s) ** 2).sum() for w, s in pairs) / sum((w ** 2).sum() for w, _ in pairs))
    loss = train.evaluate(setup, step_lib.make_eval_step(step), step.plan.pad(seen))
    return {"format": fmt, "quant_block": block, "scale": scale,
            "bytes_per_element": quant.bytes_per_element(block, jnp.dtype(scale)),
            "rel_rms_error": float(error), "eval_loss": loss, "eval_loss_change": loss / exact_loss - 1}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", help="a `zerojax export` safetensors file (default: the initialisation)")
    parser.add_argument("--blocks", default="128,512,2048,8192,32768")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("overrides", nargs="*")
    opts = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        overrides = [*opts.overrides, f"train.out_dir={out}", "zero.stage=3"]
        cfg = config.load(overrides=overrides + ([f"model.init_from={opts.weights}"] if opts.weights else []))
        setup = train.prepare(cfg)
        master = train.start_state(setup, None, None, None).params
    exact = train.evaluate(setup, step_lib.make_eval_step(setup.engine), master)
    blocks = [int(b) for b in opts.blocks.split(",")]
    runs = [("int8", b, "float32") for b in blocks] + [("int8", b, "bfloat16") for b in blocks]
    runs += [("float8_e4m3fn", 2048, "float32")]
    rows = [measure(setup, master, exact, *run) for run in runs]
    if opts.json:
        print(json.dumps({"weights": opts.weights, "exact_eval_loss": exact, "rows": rows}, indent=1))
        return 0
    print(f"weights: {opts.weights or 'initialisation'}; eval loss at the master: {exact:.5f}")
    print("| format | quant_block | scale | bytes / element | rel. RMS error | eval loss | change |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['format']} | {r['quant_block']} | {r['scale']} | {r['bytes_per_element']:.5f} | "
              f"{r['rel_rms_error']:.2e} | {r['eval_loss']:.5f} | {r['eval_loss_change']:+.3%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
