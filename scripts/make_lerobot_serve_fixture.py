#!/usr/bin/env python3
"""What LeRobot 0.3.3's own `PI0Policy.select_action` answers for robot observations, from the
tiny π0 checkpoint of tests/fixtures/lerobot/pi0 (scripts/make_lerobot_fixtures.py): the
reference `zerojax serve DIR` of a LeRobot checkpoint is held to (tests/test_serve.py).

Runs in LeRobot 0.3.3's venv (see make_lerobot_fixtures.py), never zerojax's:

    /work/pi0venv/bin/python scripts/make_lerobot_serve_fixture.py

`PI0Policy.from_pretrained` loads the directory (strict), with a tokenizer of its own in place of
PaliGemma's from the hub: OUT/pi0_tokenizer.json, a word-level `tokenizers` file over the fixture's
words (a BOS first, as PaliGemma's), through transformers' `PreTrainedTokenizerFast` as LeRobot
calls it. The observations are in the robot's units: the state unnormalized, each camera uint8
HWC (cam0 20 x 28, resized with LeRobot 0.3.3's padding; cam1 28 x 28, as the model reads it) fed
to LeRobot as its datasets give frames (float [0, 1], CHW), a task per row. `select_action` with
fixed noise returns the chunk's first action and queues the rest: the whole chunk, unnormalized,
is what a policy server answers.

Writes OUT/pi0_tokenizer.json and OUT/pi0.serve_reference.safetensors (state, cam0, cam1, noise,
actions; the tasks in its metadata).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_lerobot_fixtures as fixtures  # noqa: E402 - LeRobot imported as that script patches it

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

OUT = fixtures.OUT
TASKS = ("red cube", "pick")  # 5 and 3 tokens of the 6: LeRobot 0.3.3 does not truncate a longer one
WORDS = ("<pad>", "<eos>", "<bos>", "<unk>", " ", "\n", "pick", "up", "the", "red", "cube", "open", "drawer")


def tokenizer_file(path: Path) -> None:
    """A word-level tokenizer: words and single spaces/newlines as tokens, a BOS first."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[ \n]"), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tok.save(str(path))


def main() -> None:
    torch.manual_seed(0)
    fp32 = fixtures.Float32Torch("torch")
    fixtures.pwe.torch = fixtures.modeling_pi0.torch = fp32
    fixtures.pwe.PaliGemmaWithExpertConfig.__init__ = fixtures.tiny_configs
    fixtures.modeling_pi0.AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda *a, **k: None)
    tokenizer_file(OUT / "pi0_tokenizer.json")
    policy = fixtures.modeling_pi0.PI0Policy.from_pretrained(OUT / "pi0", strict=True).float().eval()
    policy.language_tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(OUT / "pi0_tokenizer.json"),
                                                        pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")

    g = torch.Generator().manual_seed(7)
    B, H, S = 2, fixtures.H, fixtures.IMAGE
    state = torch.randn(B, fixtures.STATE, generator=g) * 2 + 0.5  # robot units, not normalized
    cam0 = (torch.rand(B, 20, S, 3, generator=g) * 255).to(torch.uint8)  # HWC, 20 x 28: padded
    cam1 = (torch.rand(B, S, S, 3, generator=g) * 255).to(torch.uint8)
    noise = torch.randn(B, H, 32, generator=g)
    chw = lambda x: x.permute(0, 3, 1, 2).float() / 255  # LeRobot's frames: float [0, 1], CHW
    batch = {"observation.state": state.clone(), "observation.images.cam0": chw(cam0),
             "observation.images.cam1": chw(cam1), "task": list(TASKS)}
    policy.reset()
    with torch.no_grad():
        first = policy.select_action(batch, noise=noise.clone())  # [B, D_a]; the rest are queued
        chunk = torch.stack([first, *policy._action_queue], dim=1)  # [B, H, D_a]
    save_file({"state": state, "cam0": cam0, "cam1": cam1, "noise": noise, "actions": chunk.float().contiguous()},
              OUT / "pi0.serve_reference.safetensors", metadata={"tasks": json.dumps(TASKS)})
    print(json.dumps({"actions": chunk.shape, "abs_mean": float(chunk.abs().mean())}, default=list))


if __name__ == "__main__":
    main()
