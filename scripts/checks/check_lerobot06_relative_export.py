#!/usr/bin/env python3
"""Check that a fine-tune of LeRobot 0.6.1's π0.5 with relative actions exports back to LeRobot
0.6.1 (issue 42): the start is tests/fixtures/lerobot06/pi05_relative, made by LeRobot's own code
with use_relative_actions=True and a2 excluded (scripts/fixtures/make_lerobot06_relative_fixture.py);
`zerojax train` takes the relative actions from its config.json. The halves are those of
check_lerobot06_pi05_export.py, with what relative actions add to the LeRobot half:

- `PI05Policy.from_pretrained(EXPORT, strict=True)` holds every tensor as saved and no other;
- the preprocessor `make_pre_post_processors(config, pretrained_path=EXPORT)` loads has its
  `RelativeActionsProcessorStep` on, with the exclusion and the action's joint names, and the mask
  [a0, a1 relative, a2 absolute]; the postprocessor's `AbsoluteActionsProcessorStep` is on and reads
  that step's state;
- the normalizer and unnormalizer hold the statistics the run normalized with: the dataset's on
  the state, zerojax's statistics of the relative actions on the action (a0 and a1 relative, a2
  absolute: tests/test_lerobot06_relative.py computes them from the Parquet), not LeRobot's
  absolute ones;
- the dataset's frames through the preprocessor (the state cached, the normalizer, the state in the
  prompt, the tokenizer), `predict_action_chunk(noise=...)` (10 Euler steps) and the postprocessor
  (unnormalized, then the state added back on a0 and a1) give zerojax's sampled actions, normalized
  and absolute, within 1e-4 (exit 1 above).

Two halves, in two venvs, from the repository root (the fixture's processors name the tokenizer
from there):

    zerojax train model.init_from=tests/fixtures/lerobot06/pi05_relative \\
        data.source=lerobot:tests/fixtures/lerobot06/dataset model.vision.n_heads=2 zero.stage=3 \\
        train.steps=2 train.out_dir=RUN
    zerojax export RUN --format lerobot --out EXPORT
    python scripts/checks/check_lerobot06_relative_export.py --zerojax RUN EXPORT OUT.safetensors    # zerojax's venv
    /work/lr06venv/bin/python scripts/checks/check_lerobot06_relative_export.py EXPORT OUT.safetensors

(model.vision.n_heads: the tiny tower's head count, which LeRobot's config.json has no field for.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_lerobot06_pi05_export as pi05  # noqa: E402  the halves' shared pieces

EXCLUDE, NAMES, MASK = ["a2"], ["a0", "a1", "a2"], [True, True, False]


def check_relative_steps(pre, post) -> None:
    """The relative step on, as the fixture saved it; the absolute step on, reading its state."""
    from lerobot.processor import AbsoluteActionsProcessorStep, RelativeActionsProcessorStep

    relative = next(s for s in pre.steps if isinstance(s, RelativeActionsProcessorStep))
    absolute = next(s for s in post.steps if isinstance(s, AbsoluteActionsProcessorStep))
    assert relative.get_config() == {"enabled": True, "exclude_joints": EXCLUDE, "action_names": NAMES}, \
        relative.get_config()
    assert relative._build_mask(len(NAMES)) == MASK  # noqa: SLF001 - LeRobot's own mask of the names
    assert absolute.enabled and absolute.relative_step is relative
    print(f"relative step: on, exclude_joints {EXCLUDE}, action_names {NAMES}, mask {MASK}; absolute step: on")


def run_statistics(meta: dict) -> dict:
    """{feature: {stat: values}} the run normalized with, as the zerojax half recorded them."""
    return {k: {s: v for s, v in d.items() if s != "mode"} for k, d in json.loads(meta["norms"]).items()}


def lerobot_half(export: str, out: str) -> int:
    import torch

    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    ref, meta = pi05.read_out(out)
    policy = pi05.check_load(export)
    said = run_statistics(meta)
    dataset = LeRobotDataset("zerojax/pi05_tiny", root=pi05.DATASET).meta.stats
    for stat in ("q01", "q99"):  # the state's are the dataset's; the action's a0 and a1 are not
        assert torch.equal(torch.as_tensor(said[pi05.STATE][stat], dtype=torch.float32),
                           torch.as_tensor(dataset[pi05.STATE][stat], dtype=torch.float32)), stat
        assert not torch.allclose(torch.as_tensor(said[pi05.ACTION][stat][:2], dtype=torch.float32),
                                  torch.as_tensor(dataset[pi05.ACTION][stat][:2], dtype=torch.float32)), stat
    pre, post = pi05.check_processors(policy, export, said, "the run's (its lerobot.json: the action's relative)")
    check_relative_steps(pre, post)
    diffs = pi05.compare(policy, pre, post, ref, meta)
    offset = (ref["raw_state"][:, :2].abs().max()).item()
    print(f"(the state added back on a0, a1 is up to {offset:.3g} in magnitude); tolerance {pi05.TOLERANCE:g}")
    return 0 if max(diffs.values()) <= pi05.TOLERANCE else 1


if __name__ == "__main__":
    if sys.argv[1] == "--zerojax":
        sys.exit(pi05.zerojax_half(*sys.argv[2:]))
    sys.exit(lerobot_half(*sys.argv[1:]))
