#!/usr/bin/env python3
"""Check a `zerojax export --format lerobot` directory in LeRobot 0.6's layout with LeRobot 0.6.1
itself: `PI0Policy.from_pretrained` loads it with every tensor it has and no other (checked
tensor by tensor: LeRobot's own strict load only prints a warning when it fails),
`PolicyProcessorPipeline.from_pretrained` loads its processor files, whose normalizer holds the
run's statistics and makes the fixture's normalized state and prompt tokens from the raw ones,
and its `sample_actions` and flow losses equal zerojax's for the same inputs and noise.

Two halves, in two venvs (torch and LeRobot are never zerojax's dependencies), from the
repository root (the fixture's processor files name their tokenizer from there):

    zerojax train model.init_from=tests/fixtures/lerobot06/pi0 model.vision.n_heads=2 \\
        data.source=pi0_source:build ... train.steps=2 train.out_dir=RUN      # PYTHONPATH=tests
    zerojax export RUN --format lerobot --out EXPORT
    python scripts/checks/check_lerobot06_export.py --zerojax RUN OUT.safetensors      # zerojax's venv
    /work/lr06venv/bin/python scripts/checks/check_lerobot06_export.py EXPORT OUT.safetensors RUN

The first half runs the run's newest checkpoint (`zerojax.train.export.load_model`, one device,
fp32) on the inputs of tests/fixtures/lerobot06/pi0.reference.safetensors and writes them with
its `actions` (10 Euler steps from `sample_noise`) and `losses`. The second builds LeRobot 0.6.1's
π0 at the fixture's tiny sizes (scripts/fixtures/make_lerobot06_fixtures.py's `tiny_lerobot`),
loads EXPORT, checks as above, prints the largest differences and exits 1 above 1e-4.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "tests" / "fixtures" / "lerobot06" / "pi0.reference.safetensors"
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


def check_processors(export: str, run_dir: str) -> None:
    """The processors load; the normalizer holds the run's statistics; the preprocessor makes the
    fixture's normalized state and tokens from its raw state and tasks."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    from lerobot.processor import PolicyProcessorPipeline

    pre = PolicyProcessorPipeline.from_pretrained(export, config_filename="policy_preprocessor.json")
    PolicyProcessorPipeline.from_pretrained(export, config_filename="policy_postprocessor.json")
    norm = next(s for s in pre.steps if type(s).__name__ == "NormalizerProcessorStep")
    kept = load_file(Path(run_dir) / "lerobot_init" / "stats.safetensors")
    for key, value in kept.items():
        feature, stat = key.rsplit(".", 1)
        assert torch.equal(torch.as_tensor(norm.stats[feature][stat]).float(), value), key
    with safe_open(REFERENCE, "pt") as f:
        ref, tasks = {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["tasks"])
    batch = pre({"observation.state": ref["raw_state"].clone(), "action": ref["raw_actions"].clone(), "task": tasks,
                 **{f"observation.images.cam{c}": (ref["images"][:, c] + 1) / 2 for c in range(ref["images"].shape[1])}})
    width = ref["raw_state"].shape[1]
    assert torch.allclose(batch["observation.state"], ref["state"][:, :width], atol=1e-6)
    assert torch.equal(batch["observation.language.tokens"].int(), ref["tokens"])
    print(f"processors: loaded; the normalizer holds the run's {len(kept)} statistics; the fixture's state and tokens")


def lerobot_half(export: str, out: str, run_dir: str) -> int:
    import torch
    from safetensors.torch import load_file

    sys.path.insert(0, str(ROOT / "scripts" / "fixtures"))
    import make_lerobot06_fixtures as fixtures  # LeRobot 0.6.1

    fixtures.tiny_lerobot()
    policy = fixtures.modeling_pi0.PI0Policy.from_pretrained(export, strict=True).float().eval()
    saved, loaded = load_file(Path(export) / "model.safetensors"), policy.state_dict()
    assert set(saved) == set(loaded), (sorted(set(saved) - set(loaded)), sorted(set(loaded) - set(saved)))
    assert all(torch.equal(loaded[k], saved[k]) for k in saved), [k for k in saved if not torch.equal(loaded[k], saved[k])]
    print(f"loaded PI0Policy from {export}: its {len(saved)} tensors, each as saved, and no other")
    check_processors(export, run_dir)
    ref = load_file(out)
    cameras = ref["images"].shape[1]
    images, masks = [ref["images"][:, c] for c in range(cameras)], [ref["image_masks"][:, c] for c in range(cameras)]
    with torch.no_grad():
        sampled = policy.model.sample_actions(images, masks, ref["tokens"].long(), ref["token_mask"], ref["state"],
                                              noise=ref["sample_noise"].clone(), num_steps=10)
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
