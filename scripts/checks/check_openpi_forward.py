#!/usr/bin/env python3
"""Check zerojax's π0.5 and π0 VALUES against openpi's own forward pass: openpi's JAX `Pi0`
(`models/pi0.py`, run from its repository) loads `zerojax export --format openpi` of a tiny run
and computes `compute_loss` and `sample_actions` on the same observation, noise and time as
zerojax's `flow_loss` and `sample_actions`.

    /work/main/.venv/bin/python scripts/checks/check_openpi_forward.py WORK [--pi0venv /work/pi0venv/bin/python]
                                                                        [--openpi-src /tmp/openpi_src/src]

The driver (zerojax's venv), per family (pi05, pi0): trains a tiny model one step at openpi's
gemma "dummy" sizes (width 64, depth 4, 8 heads of 16, one KV head, MLP 128; the expert the same;
PaliGemma's 257,152-token vocabulary) two steps with a large learning rate (0.05, Adam), so that
every tensor, the adaRMS norms' `Dense_0` and the time MLP included, holds values of its own (two:
π0.5's adaRMS gates start at zero, so the first step's gradient reaches no prefix parameter; the
VLM's final norm alone stays zero, its output used by neither model); exports it as openpi; computes zerojax's losses and actions on a random observation
(3 cameras at 224x224, the second row's second camera masked, a prompt of 48 with 40 real
tokens) and hands everything over in WORK/<family>/io.npz. The openpi half (this script with
--openpi, in the venv of openpi's pins: scripts/fixtures/make_openpi_shapes.py) restores the
tree with openpi's `restore_params`, builds the model with `Pi0Config(...).load(params)` and runs
its own `compute_loss` and `sample_actions(num_steps=10, noise=...)`.

What the openpi half changes, and why (everything else is openpi's code as it is):
- the tower's size: openpi hard-codes SigLIP So400m/14 (`siglip.Module(variant="So400m/14")`);
  `siglip.decode_variant` answers the tiny sizes for "So400m" here (width 32, depth 2, MLP 64,
  2 heads; patch 14 kept), so both towers are the same small one;
- the noise and the time of `compute_loss`: it draws them inside from its rng
  (`jax.random.normal`, `jax.random.beta(.., 1.5, 1) * 0.999 + 0.001`); during that call
  `jax.random.normal` answers the given noise and `jax.random.beta` (t - 0.001) / 0.999, so
  its own code computes x_t, u_t and the loss at the given noise and time.
openpi's `compute_loss` is the mean over all max_action_dim (32) dimensions; zerojax's `flow_loss`
is unreduced [B, H, 32], compared after its mean over the last axis.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
B, H, A, T, CAMS, IMG = 2, 10, 32, 48, 3, 224
VISION = {"width": 32, "depth": 2, "mlp_dim": 64, "num_heads": 2}
SIZES = ["model.norm_eps=1e-6", "model.vision.norm_eps=1e-6", "model.vocab_size=257152", "model.d_model=64",
         "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=1", "model.head_dim=16", "model.d_ff=128",
         "model.expert.d_model=64", "model.expert.d_ff=128", f"model.vision.image_size={IMG}",
         "model.vision.patch_size=14", f"model.vision.d_model={VISION['width']}",
         f"model.vision.n_layers={VISION['depth']}", f"model.vision.n_heads={VISION['num_heads']}",
         f"model.vision.d_ff={VISION['mlp_dim']}", f"model.action.horizon={H}", f"model.action.prompt_len={T}",
         f"model.action.max_state_dim={A}", f"model.action.max_action_dim={A}", "model.action.action_dim=2",
         "model.action.cameras=2", f"data.image_size={IMG}", f"data.action_horizon={H}", f"data.prompt_len={T}",
         f"data.source=lerobot:{ROOT / 'tests' / 'fixtures' / 'lerobot' / 'tiny'}", "train.global_batch=8",
         "zero.min_shard_size=64", "train.steps=2", "train.eval_every=0", "train.sample_tokens=0",
         "optim.warmup_steps=0", "optim.lr=0.05", "optim.schedule=constant", "model.remat=none"]
UNUSED = "PaliGemma/llm/final_norm/scale"  # the VLM's final norm: its output is used by neither model
NORM = {"pi05": ["data.norm_state=quantiles", "data.norm_action=quantiles"], "pi0": []}


def zerojax(*args: str) -> None:
    print("$ zerojax " + " ".join(args[:3]) + (" ..." if len(args) > 3 else ""), flush=True)
    subprocess.run([sys.executable, "-m", "zerojax", *args], cwd=ROOT, check=True)


def inputs(seed: int = 0) -> dict:
    """The observation, actions, noise and time both sides are given (numpy)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return {"images": rng.uniform(-1, 1, (B, CAMS, 3, IMG, IMG)).astype(np.float32),
            "image_masks": np.array([[True, True, True], [True, False, True]]),
            "tokens": rng.integers(0, 257152, (B, T)).astype(np.int32),
            "token_mask": np.broadcast_to(np.arange(T) < 40, (B, T)).copy(),
            "state": rng.uniform(-1, 1, (B, A)).astype(np.float32),
            "actions": rng.standard_normal((B, H, A)).astype(np.float32),
            "noise": rng.standard_normal((B, H, A)).astype(np.float32),
            "time": np.array([0.3, 0.8], np.float32)}


def zerojax_side(family: str, work: Path) -> None:
    """Train, export, and write WORK/io.npz: the inputs and zerojax's loss and actions."""
    import shutil

    import jax.numpy as jnp
    import numpy as np

    from zerojax.train.export import load_model

    shutil.rmtree(work, ignore_errors=True)
    zerojax("train", f"model.family={family}", *SIZES, *NORM[family], f"train.out_dir={work / 'run'}")
    zerojax("export", str(work / "run"), "--format", "openpi", "--out", str(work / "openpi"))
    _, _, model = load_model(work / "run")
    x = inputs()
    batch = {k: jnp.asarray(x[k]) for k in ("images", "image_masks", "tokens", "token_mask", "actions")}
    if family == "pi0":
        batch["state"] = jnp.asarray(x["state"])
    loss = np.asarray(model.flow_loss(batch, jnp.asarray(x["noise"]), jnp.asarray(x["time"]))).mean(-1)
    actions = np.asarray(model.sample_actions(batch, jnp.asarray(x["noise"]), num_steps=10))
    np.savez(work / "io.npz", **x, loss=loss, sampled=actions)


def openpi_side(family: str, work: str, src: str) -> int:
    """openpi's Pi0 on WORK/openpi/params and WORK/io.npz's inputs; prints the differences."""
    import types

    sys.path.insert(0, src)
    sys.modules["openpi.models_pytorch.pi0_pytorch"] = types.ModuleType("openpi.models_pytorch.pi0_pytorch")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from openpi.models import model as _model
    from openpi.models import pi0_config, siglip

    decode = siglip.decode_variant
    siglip.decode_variant = lambda v: {**decode(v), **(VISION if v and v.startswith("So400m") else {})}
    io = dict(np.load(Path(work) / "io.npz"))
    params = _model.restore_params(Path(work) / "openpi" / "params", restore_type=np.ndarray)
    zeros = ["/".join(str(p.key) for p in k) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]
             if not np.any(v)]
    print(f"{family}: {len(jax.tree.leaves(params))} leaves in the export, all-zero ones: {zeros or 'none'}")
    cfg = pi0_config.Pi0Config(pi05=family == "pi05", dtype="float32", paligemma_variant="dummy",
                               action_expert_variant="dummy", action_dim=A, action_horizon=H, max_token_len=T)
    model = cfg.load(params)
    names = _model.IMAGE_KEYS
    obs = _model.Observation(images={n: jnp.asarray(io["images"][:, i].transpose(0, 2, 3, 1)) for i, n in enumerate(names)},
                             image_masks={n: jnp.asarray(io["image_masks"][:, i]) for i, n in enumerate(names)},
                             state=jnp.asarray(io["state"]), tokenized_prompt=jnp.asarray(io["tokens"]),
                             tokenized_prompt_mask=jnp.asarray(io["token_mask"]))
    normal, beta = jax.random.normal, jax.random.beta
    # only the draws of the actions' shape and of the batch's times are answered (flax's bridge
    # also calls its initializers, whose draws are discarded)
    jax.random.normal = lambda key, shape, *a, **k: (jnp.asarray(io["noise"]) if tuple(shape) == io["noise"].shape
                                                     else normal(key, shape, *a, **k))
    jax.random.beta = lambda key, a, b, shape=None, *r, **k: (
        (jnp.asarray(io["time"]) - 0.001) / 0.999 if (a, b) == (1.5, 1) else beta(key, a, b, shape, *r, **k))
    try:
        loss = np.asarray(model.compute_loss(jax.random.key(0), obs, jnp.asarray(io["actions"]), train=False))
    finally:
        jax.random.normal, jax.random.beta = normal, beta
    sampled = np.asarray(model.sample_actions(jax.random.key(0), obs, num_steps=10, noise=jnp.asarray(io["noise"])))
    d_loss = float(np.abs(loss - io["loss"]).max())
    d_act = float(np.abs(sampled - io["sampled"]).max())
    print(f"{family}: compute_loss [B, H] max |openpi - zerojax| = {d_loss:.3g} (max |loss| {np.abs(loss).max():.3g}); "
          f"sample_actions [B, H, 32] max |openpi - zerojax| = {d_act:.3g} (max |action| {np.abs(sampled).max():.3g})")
    return 0 if d_loss <= 1e-4 and d_act <= 1e-4 and set(zeros) <= {UNUSED} else 1


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--openpi":
        return openpi_side(*sys.argv[2:5])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--pi0venv", default="/work/pi0venv/bin/python")
    parser.add_argument("--openpi-src", default="/tmp/openpi_src/src")
    parser.add_argument("--family", choices=("pi05", "pi0"), nargs="*", default=["pi05", "pi0"])
    args = parser.parse_args()
    rc = 0
    for family in args.family:
        zerojax_side(family, args.work / family)
        rc |= subprocess.run([args.pi0venv, __file__, "--openpi", family, str(args.work / family), args.openpi_src],
                             cwd=ROOT).returncode
    return rc


if __name__ == "__main__":
    sys.exit(main())
