#!/usr/bin/env python3
"""Check a `zerojax export --format lerobot` directory with LeRobot itself (the real client):
`PI0Policy.from_pretrained` loads it (strict: no missing or unexpected tensor) and its
`sample_actions` gives zerojax's actions for the same inputs and noise.

Two halves, in two venvs (torch and LeRobot are never zerojax's dependencies):

    zerojax train model.init_from=tests/fixtures/lerobot/pi0 model.vision.n_heads=2 \\
        data.source=pi0_source:build ... train.steps=2 train.out_dir=RUN      # PYTHONPATH=tests
    zerojax export RUN --format lerobot --out EXPORT
    python scripts/checks/check_lerobot_export.py --zerojax RUN ACTIONS.safetensors           # zerojax's venv
    /work/pi0venv/bin/python scripts/checks/check_lerobot_export.py EXPORT ACTIONS.safetensors

The first half samples the run's newest checkpoint (`zerojax.train.export.load_model`, one
device, fp32) on the inputs of tests/fixtures/lerobot/pi0.reference.safetensors (two cameras,
one missing; a padded prompt) with its `sample_noise`, and writes the inputs and `actions`. The
second builds LeRobot 0.3.3's π0 at the fixture's tiny sizes in fp32 (the same changes as
scripts/fixtures/make_lerobot_fixtures.py: its `tiny_configs` and `Float32Torch`), loads EXPORT, samples the same
inputs and noise, compares the normalization buffers with the statistics the run kept
(RUN/lerobot_init, passed as the export's own: they must be the fixture's), prints the largest
difference and exits 1 above 1e-4.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "tests" / "fixtures" / "lerobot" / "pi0.reference.safetensors"
INPUTS = ("images", "image_masks", "tokens", "token_mask", "state", "sample_noise")


def zerojax_half(run_dir: str, out: str) -> int:
    import jax.numpy as jnp
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from zerojax.train.export import load_model

    ref = load_file(REFERENCE)
    _, step, model = load_model(Path(run_dir))
    batch = {k: jnp.asarray(ref[k]) for k in INPUTS if k != "sample_noise"}
    actions = np.asarray(model.sample_actions(batch, jnp.asarray(ref["sample_noise"])), np.float32)
    save_file({**{k: ref[k] for k in INPUTS}, "actions": actions}, out)
    print(f"zerojax: sampled the checkpoint of step {step}: actions {actions.shape}, mean |a| "
          f"{float(np.abs(actions).mean()):.4f}")
    return 0


def lerobot_half(export: str, actions_file: str) -> int:
    import types

    import torch
    from safetensors.torch import load_file

    sys.path.insert(0, str(ROOT / "scripts" / "fixtures"))
    import make_lerobot_fixtures as fixtures  # LeRobot 0.3.3 imported, torchvision stood in for

    fp32 = fixtures.Float32Torch("torch")
    fixtures.pwe.torch = fixtures.modeling_pi0.torch = fp32
    fixtures.pwe.PaliGemmaWithExpertConfig.__init__ = fixtures.tiny_configs
    fixtures.modeling_pi0.AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda *a, **k: None)
    policy = fixtures.modeling_pi0.PI0Policy.from_pretrained(export, strict=True).float().eval()
    print(f"loaded {type(policy).__name__} from {export} (strict: no missing or unexpected tensors)")
    saved = load_file(Path(export) / "model.safetensors")
    fixture = load_file(ROOT / "tests" / "fixtures" / "lerobot" / "pi0" / "model.safetensors")
    for name in sorted(k for k in saved if "normalize" in k):
        buffer = dict(policy.named_buffers())[name] if name in dict(policy.named_buffers()) else \
            dict(policy.named_parameters())[name]
        assert torch.equal(buffer, saved[name]) and torch.equal(saved[name], fixture[name]), name
    print(f"normalization statistics: {sum('normalize' in k for k in saved)} buffers, the fixture's, as loaded")

    ref = load_file(actions_file)
    cameras = ref["images"].shape[1]
    with torch.no_grad():
        sampled = policy.model.sample_actions([ref["images"][:, c] for c in range(cameras)],
                                              [ref["image_masks"][:, c] for c in range(cameras)],
                                              ref["tokens"].long(), ref["token_mask"], ref["state"],
                                              noise=ref["sample_noise"].clone())
    diff = (sampled.float() - ref["actions"]).abs().max().item()
    moved = (sampled.float() - load_file(REFERENCE)["actions_sampled"]).abs().max().item()
    print(f"max |LeRobot - zerojax| sampled actions: {diff:.3g} over {tuple(sampled.shape)}; "
          f"max |this export - the fixture before training|: {moved:.3g}")
    return 0 if diff <= 1e-4 else 1


if __name__ == "__main__":
    if sys.argv[1] == "--zerojax":
        sys.exit(zerojax_half(*sys.argv[2:]))
    sys.exit(lerobot_half(*sys.argv[1:]))
