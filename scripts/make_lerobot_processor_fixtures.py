#!/usr/bin/env python3
"""LeRobot 0.4's processor files for the tiny π0 fixture (tests/fixtures/lerobot/pi0_processors/),
written by LeRobot 0.4's own `make_pi0_pre_post_processors` and `save_pretrained`, with the
normalization statistics of tests/fixtures/lerobot/pi0 (LeRobot 0.3.3's buffers): zerojax reads
the statistics from either layout (`zerojax.interop.lerobot.read_stats`).

Runs in LeRobot 0.4.x's venv (never zerojax's):

    /work/lerobotvenv/bin/python scripts/make_lerobot_processor_fixtures.py

What it changes in LeRobot: the pre-processor's TokenizerProcessorStep downloads PaliGemma's
tokenizer from the hub (and refuses to start where transformers is absent, as in this venv);
`AutoTokenizer.from_pretrained` is replaced by a stand-in, since only the files are wanted (the
tokenizer step saves its name, not the tokenizer).
"""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import torch
from safetensors.torch import load_file

import lerobot.processor.tokenizer_processor as tokenizer_processor
from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
from lerobot.policies.pi0.configuration_pi0 import PI0Config
from lerobot.policies.pi0.processor_pi0 import make_pi0_pre_post_processors

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "lerobot"


def main() -> None:
    config = json.loads((FIXTURE / "pi0" / "config.json").read_text())
    buffers = load_file(FIXTURE / "pi0" / "model.safetensors")
    stats = {feature: {s: buffers[f"{module}.buffer_{feature.replace('.', '_')}.{s}"] for s in ("mean", "std")}
             for feature, module in (("observation.state", "normalize_inputs"), ("action", "normalize_targets"))}
    cfg = PI0Config(chunk_size=config["chunk_size"], n_action_steps=config["n_action_steps"],
                    tokenizer_max_length=config["tokenizer_max_length"], device="cpu")
    cfg.input_features = {k: PolicyFeature(type=FeatureType(f["type"]), shape=tuple(f["shape"]))
                          for k, f in config["input_features"].items()}
    cfg.output_features = {k: PolicyFeature(type=FeatureType(f["type"]), shape=tuple(f["shape"]))
                           for k, f in config["output_features"].items()}
    cfg.normalization_mapping = {k: NormalizationMode(v) for k, v in config["normalization_mapping"].items()}
    tokenizer_processor.AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda *a, **k: object())
    tokenizer_processor._transformers_available = True
    pre, post = make_pi0_pre_post_processors(cfg, dataset_stats=stats)
    out = FIXTURE / "pi0_processors"
    if out.exists():
        shutil.rmtree(out)
    pre.save_pretrained(out)
    post.save_pretrained(out)
    print(json.dumps({"dir": str(out), "files": sorted(p.name for p in out.iterdir()),
                      "torch": torch.__version__}))


if __name__ == "__main__":
    main()
