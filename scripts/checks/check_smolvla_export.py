#!/usr/bin/env python3
"""Check a SmolVLA `zerojax export --format lerobot` directory with LeRobot 0.6.1 itself:
`SmolVLAPolicy.from_pretrained(strict=True)` loads it with every tensor it has and no other
(checked tensor by tensor), `PolicyProcessorPipeline.from_pretrained` loads its processor files,
and its `sample_actions` (config.num_steps Euler steps) and flow losses equal zerojax's for the
same inputs and noise.

Two halves, in two venvs (torch and LeRobot are never zerojax's dependencies), from the
repository root (the fixture's config.json names its SmolVLM directory from there):

    PYTHONPATH=tests zerojax train model.init_from=tests/fixtures/lerobot06/smolvla \\
        data.source=pi0_source:build train.global_batch=16 zero.stage=3 train.steps=2 \\
        train.ckpt_every=1 optim.lr=1e-3 optim.warmup_steps=0 train.out_dir=RUN
    zerojax export RUN --format lerobot --out EXPORT
    python scripts/checks/check_smolvla_export.py --zerojax RUN OUT.safetensors          # zerojax's venv
    /work/lr06venv/bin/python scripts/checks/check_smolvla_export.py EXPORT OUT.safetensors

The first half runs the run's newest checkpoint (`zerojax.train.export.load_model`, one device,
fp32) on the inputs of tests/fixtures/lerobot06/smolvla.reference.safetensors and writes them
with its `actions_sampled` and `losses`. The second loads EXPORT in LeRobot 0.6.1, checks as
above, prints the largest differences and exits 1 above 1e-4.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "tests" / "fixtures" / "lerobot06" / "smolvla.reference.safetensors"
INPUTS = ("images", "image_masks", "tokens", "token_mask", "state", "actions", "noise", "time", "sample_noise")


def zerojax_half(run_dir: str, out: str) -> int:
    import jax.numpy as jnp
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from zerojax.train.export import load_model

    ref = load_file(REFERENCE)
    _, step, model = load_model(Path(run_dir))
    batch = {k: jnp.asarray(ref[k]) for k in INPUTS[:6]}
    actions = np.asarray(model.sample_actions(batch, jnp.asarray(ref["sample_noise"])), np.float32)
    losses = np.asarray(model.flow_loss(batch, jnp.asarray(ref["noise"]), jnp.asarray(ref["time"])), np.float32)
    save_file({**{k: ref[k] for k in INPUTS}, "actions_sampled": actions, "losses": losses}, out)
    print(f"zerojax: the checkpoint of step {step}: actions {actions.shape}, mean |a| {float(np.abs(actions).mean()):.4f}")
    return 0


def lerobot_half(export: str, out: str) -> int:
    import torch
    from safetensors.torch import load_file

    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from lerobot.processor import PolicyProcessorPipeline

    policy = SmolVLAPolicy.from_pretrained(export, strict=True).float().eval()
    saved, loaded = load_file(Path(export) / "model.safetensors"), policy.state_dict()
    assert set(saved) == set(loaded), (sorted(set(saved) - set(loaded)), sorted(set(loaded) - set(saved)))
    assert all(torch.equal(loaded[k], saved[k]) for k in saved), [k for k in saved if not torch.equal(loaded[k], saved[k])]
    print(f"loaded SmolVLAPolicy from {export}: its {len(saved)} tensors, each as saved, and no other")
    for name in ("policy_preprocessor.json", "policy_postprocessor.json"):
        PolicyProcessorPipeline.from_pretrained(export, config_filename=name)
    print("processors: loaded")
    ref = load_file(out)
    cameras = ref["images"].shape[1]
    images, masks = [ref["images"][:, c] for c in range(cameras)], [ref["image_masks"][:, c] for c in range(cameras)]
    with torch.no_grad():
        sampled = policy.model.sample_actions(images, masks, ref["tokens"].long(), ref["token_mask"], ref["state"],
                                              noise=ref["sample_noise"].clone())
        losses = policy.model.forward(images, masks, ref["tokens"].long(), ref["token_mask"], ref["state"],
                                      ref["actions"], ref["noise"].clone(), ref["time"].clone())
    diff = (sampled - ref["actions_sampled"]).abs().max().item()
    loss_diff = (losses - ref["losses"]).abs().max().item()
    moved = (sampled - load_file(REFERENCE)["actions_sampled"]).abs().max().item()
    print(f"max |LeRobot - zerojax|: sampled actions {diff:.3g}, flow losses {loss_diff:.3g} over "
          f"{tuple(sampled.shape)}; max |this export - the fixture before training| {moved:.3g}")
    return 0 if max(diff, loss_diff) <= 1e-4 else 1


if __name__ == "__main__":
    if sys.argv[1] == "--zerojax":
        sys.exit(zerojax_half(*sys.argv[2:]))
    sys.exit(lerobot_half(*sys.argv[1:]))
