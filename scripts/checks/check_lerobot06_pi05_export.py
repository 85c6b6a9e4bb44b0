#!/usr/bin/env python3
"""Check a π0.5 fine-tune's `zerojax export --format lerobot` with LeRobot 0.6.1 itself, end to
end: frames of a LeRobot v3.0 dataset LeRobot 0.6.1 wrote (tests/fixtures/lerobot06/dataset,
scripts/fixtures/make_lerobot06_dataset.py) through LeRobot's processors and `PI05Policy` loaded
from the export give zerojax's actions for the same noise.

What the LeRobot half checks:
- `PI05Policy.from_pretrained(EXPORT, strict=True)` holds every tensor of model.safetensors as
  saved and no other (LeRobot's own strict load only prints a warning when it fails);
- `make_pre_post_processors(config, pretrained_path=EXPORT)` loads the processor files (the
  tokenizer step pointed at EXPORT/tokenizer, which it names relatively to the export); the
  normalizer's and unnormalizer's q01/q99 equal the dataset's meta/stats.json (as LeRobot reads it);
- LeRobot's own `LeRobotDataset` items at INDICES equal the frames zerojax read (state, image, task);
- the preprocessor (normalizer, the state-as-text step, the tokenizer the processor file names)
  makes zerojax's prompt tokens;
- `predict_action_chunk(batch, noise=...)` (10 Euler steps) equals zerojax's sampled actions, and
  the postprocessor's unnormalized actions zerojax's, within 1e-4 (exit 1 above).

Two halves, in two venvs (torch and LeRobot are never zerojax's dependencies), from the
repository root (the processor files name the tokenizer from there):

    zerojax train model.init_from=tests/fixtures/lerobot06/pi05 model.vision.n_heads=2 \\
        data.source=lerobot:tests/fixtures/lerobot06/dataset ... train.out_dir=RUN   # docs/models/pi0.md "π0.5 exports back"
    zerojax export RUN --format lerobot --out EXPORT
    python scripts/checks/check_lerobot06_pi05_export.py --zerojax RUN EXPORT OUT.safetensors     # zerojax's venv
    /work/lr06venv/bin/python scripts/checks/check_lerobot06_pi05_export.py EXPORT OUT.safetensors

The zerojax half reads the frames with zerojax's dataset reader, builds each row's batch as
`zerojax serve` does (`serve.observation`: the state normalized and put in the prompt), samples the
run's newest checkpoint and zerojax's load of EXPORT (`serve.loaders.load` of a LeRobot
directory) from the same noise, and writes the frames, noise, tokens, both actions (normalized, and
in the robot's units as `zerojax serve` answers: with the state added back where the run's actions
are relative) and the run's statistics to OUT. scripts/checks/check_lerobot06_relative_export.py
reuses both halves' pieces for a run on relative actions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATASET = ROOT / "tests" / "fixtures" / "lerobot06" / "dataset"
INDICES = (0, 3, 6, 11, 15)  # episode starts and ends, and frames between
STATE, ACTION, CAMERA = "observation.state", "action", "observation.images.cam0"
TOLERANCE = 1e-4


def zerojax_half(run_dir: str, export: str, out: str) -> int:
    import numpy as np
    from safetensors.numpy import save_file

    from zerojax.data import lerobot
    from zerojax.data.lerobot import frames as lerobot_frames, meta as lerobot_meta
    from zerojax.serve import loaders
    from zerojax.serve.policy import ROBOT_STATE

    info = lerobot.read_info(DATASET)
    ds = lerobot_meta.load(DATASET, info, [CAMERA], {STATE: "quantiles", ACTION: "quantiles"},
                           lerobot.VERSIONS[info["codebase_version"]])
    frames = [ds.numbers(i, 1) for i in INDICES]
    images = np.stack([ds.image(CAMERA, i, lerobot_frames.VideoReader()) for i in INDICES])
    obs = [{STATE: f[STATE], "prompt": f["task"], CAMERA: image} for f, image in zip(frames, images)]
    found, norms = {}, {}
    for name, target in (("run", run_dir), ("export", export)):  # the export carries tokenizer and head count
        served = loaders.load(Path(target), num_steps=10)
        rows = [served.batch(o) for o in obs]
        batch = {k: np.concatenate([r[k] for r in rows]) for k in rows[0] if not k.startswith("rtc_")}
        noise = np.random.default_rng(0).standard_normal((len(INDICES), *served.adapter.chunk(served.model_keys)))
        noise = noise.astype(np.float32)
        sampled = np.asarray(served.model.sample_actions(batch, noise, 10), np.float32)
        # unnormalized as `zerojax serve` answers, the state added back where the run's actions are relative
        raw = served.observations.robot_actions(sampled, batch.get(ROBOT_STATE))
        found[name] = {"actions": sampled, "raw_actions": raw, "tokens": batch["tokens"],
                       "token_mask": batch["token_mask"]}
        norms = served.observations.norms if name == "run" else norms  # what the run normalized with
    same = {k: float(np.abs(found["run"][k].astype(np.float32) - found["export"][k].astype(np.float32)).max())
            for k in found["run"]}
    save_file({"raw_state": np.stack([f[STATE] for f in frames]).astype(np.float32), "images": images,
               "noise": noise, **{f"{name}/{k}": v for name, d in found.items() for k, v in d.items()}}, out,
              metadata={"tasks": json.dumps([f["task"] for f in frames]), "indices": json.dumps(INDICES),
                        "norms": json.dumps({k: norms[k] for k in (STATE, ACTION)}, default=np.ndarray.tolist)})
    print(f"zerojax: {len(INDICES)} frames; max |the run - zerojax's load of its export|: {same}")
    return 0 if max(same.values()) <= TOLERANCE else 1


def check_load(export: str):
    """PI05Policy.from_pretrained, strict, every tensor as saved and no other."""
    import torch
    from safetensors.torch import load_file

    sys.path.insert(0, str(ROOT / "scripts" / "fixtures"))
    import make_lerobot06_fixtures as fixtures  # LeRobot 0.6.1, patched to the fixture's tiny sizes

    fixtures.tiny_lerobot()
    policy = fixtures.modeling_pi05.PI05Policy.from_pretrained(export, strict=True).float().eval()
    saved, loaded = load_file(Path(export) / "model.safetensors"), policy.state_dict()
    assert set(saved) == set(loaded), (sorted(set(saved) - set(loaded)), sorted(set(loaded) - set(saved)))
    assert all(torch.equal(loaded[k], saved[k]) for k in saved), [k for k in saved if not torch.equal(loaded[k], saved[k])]
    print(f"loaded PI05Policy from {export}: its {len(saved)} tensors, each as saved, and no other")
    return policy


def check_processors(policy, export: str, stats: dict | None = None, whose: str = ""):
    """The processors from the export; their normalizers hold `stats`' q01/q99 ({feature: {stat:
    values}}, `whose` saying whose), by default the dataset's meta/stats.json as LeRobot reads it."""
    import torch

    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from lerobot.policies.factory import make_pre_post_processors

    # the export's tokenizer step names its own copy relatively to the export, and LeRobot's
    # AutoTokenizer.from_pretrained reads a relative name from the working directory: LeRobot's override
    tokenizer_dir = {"tokenizer_name": str(Path(export) / "tokenizer")}
    pre, post = make_pre_post_processors(policy.config, pretrained_path=export,
                                         preprocessor_overrides={"tokenizer_processor": tokenizer_dir})
    said = f"the dataset's q01/q99 ({DATASET.name}/meta/stats.json)" if stats is None else f"{whose} q01/q99"
    stats = LeRobotDataset("zerojax/pi05_tiny", root=DATASET).meta.stats if stats is None else stats
    for pipeline, step_name in ((pre, "NormalizerProcessorStep"), (post, "UnnormalizerProcessorStep")):
        step = next(s for s in pipeline.steps if type(s).__name__ == step_name)
        for feature in (STATE, ACTION) if step_name.startswith("Normalizer") else (ACTION,):
            for stat in ("q01", "q99"):
                want = torch.as_tensor(stats[feature][stat], dtype=torch.float32)
                assert torch.equal(step._tensor_stats[feature][stat], want), (step_name, feature, stat)  # noqa: SLF001
    tokenizer = next(s for s in pre.steps if type(s).__name__ == "TokenizerProcessorStep").tokenizer_name
    print(f"processors: loaded; the normalizer and unnormalizer hold {said}; the tokenizer "
          f"step names {tokenizer}")
    return pre, post


def lerobot_half(export: str, out: str) -> int:
    policy = check_load(export)
    pre, post = check_processors(policy, export)
    return 0 if max(compare(policy, pre, post, *read_out(out)).values()) <= TOLERANCE else 1


def read_out(out: str) -> tuple[dict, dict]:
    """(tensors, metadata) the zerojax half wrote."""
    from safetensors import safe_open

    with safe_open(out, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def compare(policy, pre, post, ref: dict, meta: dict) -> dict:
    """LeRobot's dataset items at the zerojax half's indices through the preprocessor,
    `predict_action_chunk` from its noise and the postprocessor: {what: max |LeRobot - zerojax|},
    printed, for the run's and the export's actions, normalized and in the robot's units."""
    import torch

    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    dataset = LeRobotDataset("zerojax/pi05_tiny", root=DATASET)
    items = [dataset[i] for i in json.loads(meta["indices"])]
    state, images = torch.stack([it[STATE] for it in items]), torch.stack([it[CAMERA] for it in items])
    assert torch.equal(state, ref["raw_state"]) and [it["task"] for it in items] == json.loads(meta["tasks"])
    assert torch.allclose(images, ref["images"].permute(0, 3, 1, 2).float() / 255, atol=1e-6)
    batch = pre({STATE: state, CAMERA: images, "task": [it["task"] for it in items]})
    assert torch.equal(batch["observation.language.tokens"].int(), ref["run/tokens"].int())
    assert torch.equal(batch["observation.language.attention_mask"].bool(), ref["run/token_mask"].bool())
    with torch.no_grad():
        actions = policy.predict_action_chunk(batch, noise=ref["noise"].clone())
    raw = post(actions)
    width = actions.shape[-1]
    diffs = {f"{name} {what}": (got - ref[f"{name}/{key}"][..., :width]).abs().max().item()
             for name in ("run", "export") for what, got, key in (("actions", actions, "actions"),
                                                                   ("robot actions", raw, "raw_actions"))}
    print(f"the dataset's frames and tasks as zerojax read them; the preprocessor's tokens are zerojax's; "
          f"max |LeRobot - zerojax| over {tuple(actions.shape)}: " + ", ".join(f"{k} {v:.3g}" for k, v in diffs.items()))
    return diffs


if __name__ == "__main__":
    if sys.argv[1] == "--zerojax":
        sys.exit(zerojax_half(*sys.argv[2:]))
    sys.exit(lerobot_half(*sys.argv[1:]))
