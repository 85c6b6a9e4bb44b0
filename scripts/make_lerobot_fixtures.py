#!/usr/bin/env python3
"""Reference fixtures for zerojax's π0 (`model.family=pi0`), written by LeRobot's own PyTorch π0.

LeRobot 0.4.x refuses to build π0 without a transformers fork that no registry serves; LeRobot
0.3.3 runs it with transformers 4.53 (its declared `<4.52` does not: 4.51.3 fails on
`embed_tokens`). So this script runs in a venv of its own, never zerojax's:

    python3 -m venv /work/pi0venv
    /work/pi0venv/bin/pip install torch 'transformers==4.53.3' safetensors einops 'draccus==0.10.0' \\
        huggingface-hub numpy pillow jsonlines packaging termcolor
    /work/pi0venv/bin/pip install --no-deps 'lerobot==0.3.3'
    /work/pi0venv/bin/python scripts/make_lerobot_fixtures.py

    /work/pi0venv/bin/pip install 'datasets==3.6.0' deepdiff 'imageio[ffmpeg]' 'gymnasium<1.0' av \
        pytest pyserial   # what `import lerobot.policies.pi0` imports on the way

(`--no-deps`: lerobot 0.3.3 pins torch<2.8 and pulls its robot and dataset stacks; π0's modeling
code needs only the packages above. This workplace's torch is 2.13 (CPU); torchvision, which
only LeRobot's dataset transforms use, is stood in for when absent (`Absent`).)

What it changes in LeRobot, and why (everything else is LeRobot's code as it runs):
- the sizes: `PaliGemmaWithExpertConfig` hard-codes gemma_2b / gemma_300m / So400m; its
  constructor is replaced by one that builds the same configs at tiny sizes (one KV head, the
  same depth, heads and head_dim in both experts);
- the dtype: π0 casts to bfloat16 in its forward (`to_bfloat16_like_physical_intelligence`,
  `.to(dtype=torch.bfloat16)`); the modules see a `torch` whose `bfloat16` is float32, so the
  reference is fp32 end to end and zerojax can be held to 1e-4;
- the tokenizer: `PI0Policy` downloads PaliGemma's from the hub; it is replaced by None, since
  token ids are fed to `PI0FlowMatching` directly.

Outputs, in tests/fixtures/lerobot/:

    pi0/                    PI0Policy.save_pretrained: config.json, model.safetensors (with the
                            normalization buffers), as LeRobot 0.3.3 writes them
    pi0.reference.safetensors   the inputs (images [B, C, 3, S, S], image_masks, tokens,
                            token_mask, state, actions, noise, time, sample_noise) and LeRobot's
                            outputs: `losses` (PI0FlowMatching.forward, unreduced [B, H, 32])
                            and `actions_sampled` (sample_actions, 10 Euler steps)
"""

from __future__ import annotations

import importlib.machinery
import json
import shutil
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file


class Absent(types.ModuleType):
    """A module that is imported but never used on π0's path (torchvision: LeRobot's dataset
    transforms; its PyPI wheels do not match this torch), so that LeRobot imports without it."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        child = absent(f"{self.__name__}.{name}")
        setattr(self, name, child)
        return child

    def __call__(self, *args, **kwargs):
        return self

    def __mro_entries__(self, bases):
        return (object,)


def absent(name: str) -> Absent:
    module = Absent(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    sys.modules[name] = module
    return module


if importlib.util.find_spec("torchvision") is None:
    absent("torchvision").transforms.v2.functional  # noqa: B018 - registers the submodules LeRobot imports

import lerobot.policies.pi0.modeling_pi0 as modeling_pi0
import lerobot.policies.pi0.paligemma_with_expert as pwe
from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
from lerobot.policies.pi0.configuration_pi0 import PI0Config
from transformers import PretrainedConfig
from transformers.models.auto import CONFIG_MAPPING

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "lerobot"
B, CAMERAS, IMAGE, PATCH, L, H, STATE, ACTION = 2, 2, 28, 14, 6, 4, 5, 3
VOCAB, WIDTH, EXPERT, HEADS, HEAD_DIM, LAYERS = 64, 32, 16, 2, 8, 2


class Float32Torch(types.ModuleType):
    """torch, with bfloat16 meaning float32 (the reference in fp32)."""

    def __getattr__(self, name):
        return torch.float32 if name == "bfloat16" else getattr(torch, name)


def tiny_configs(self, paligemma_config=None, gemma_expert_config=None, freeze_vision_encoder=True,
                 train_expert_only=True, attention_implementation="eager", **kwargs):
    """PaliGemmaWithExpertConfig.__init__ with its hard-coded configs at tiny sizes."""
    self.freeze_vision_encoder, self.train_expert_only = freeze_vision_encoder, train_expert_only
    self.attention_implementation = attention_implementation
    self.paligemma_config = CONFIG_MAPPING["paligemma"](
        bos_token_id=2, eos_token_id=1, hidden_size=WIDTH, image_token_index=VOCAB, pad_token_id=0,
        projection_dim=WIDTH,
        text_config={"hidden_activation": "gelu_pytorch_tanh", "hidden_size": WIDTH, "intermediate_size": 64,
                     "model_type": "gemma", "num_attention_heads": HEADS, "num_hidden_layers": LAYERS,
                     "num_key_value_heads": 1, "head_dim": HEAD_DIM, "vocab_size": VOCAB,
                     "num_image_tokens": (IMAGE // PATCH) ** 2},
        vision_config={"hidden_size": 24, "intermediate_size": 48, "model_type": "siglip_vision_model",
                       "num_attention_heads": 2, "num_hidden_layers": 2, "patch_size": PATCH, "image_size": IMAGE,
                       "projection_dim": WIDTH, "projector_hidden_act": "gelu_fast", "vision_use_head": False,
                       "num_image_tokens": (IMAGE // PATCH) ** 2})
    self.gemma_expert_config = CONFIG_MAPPING["gemma"](
        attention_bias=False, head_dim=HEAD_DIM, hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
        hidden_size=EXPERT, intermediate_size=48, num_attention_heads=HEADS, num_hidden_layers=LAYERS,
        num_key_value_heads=1, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=VOCAB)
    PretrainedConfig.__init__(self, **kwargs)


def policy_config() -> PI0Config:
    cfg = PI0Config(chunk_size=H, n_action_steps=H, tokenizer_max_length=L, proj_width=EXPERT,
                    resize_imgs_with_padding=(IMAGE, IMAGE), empty_cameras=0, freeze_vision_encoder=False,
                    train_expert_only=False)
    cfg.input_features = {
        "observation.state": PolicyFeature(type=FeatureType.STATE, shape=(STATE,)),
        **{f"observation.images.cam{k}": PolicyFeature(type=FeatureType.VISUAL, shape=(3, IMAGE, IMAGE))
           for k in range(CAMERAS)},
    }
    cfg.output_features = {"action": PolicyFeature(type=FeatureType.ACTION, shape=(ACTION,))}
    cfg.normalization_mapping = {"VISUAL": NormalizationMode.IDENTITY, "STATE": NormalizationMode.MEAN_STD,
                                 "ACTION": NormalizationMode.MEAN_STD}
    return cfg


def main() -> None:
    torch.manual_seed(0)
    fp32 = Float32Torch("torch")
    pwe.torch = modeling_pi0.torch = fp32
    pwe.PaliGemmaWithExpertConfig.__init__ = tiny_configs
    modeling_pi0.AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda *a, **k: None)
    stats = {"observation.state": {"mean": torch.linspace(-1, 1, STATE), "std": torch.linspace(0.5, 2, STATE)},
             "action": {"mean": torch.linspace(0, 1, ACTION), "std": torch.linspace(1, 3, ACTION)}}
    policy = modeling_pi0.PI0Policy(policy_config(), dataset_stats=stats).float().eval()
    model = policy.model

    g = torch.Generator().manual_seed(1)
    images = torch.rand(B, CAMERAS, 3, IMAGE, IMAGE, generator=g) * 2 - 1
    image_masks = torch.tensor([[True, True], [True, False]])
    images[1, 1] = -1.0  # a missing camera: all -1, as prepare_images makes it
    tokens = torch.randint(0, VOCAB, (B, L), generator=g)
    token_mask = torch.tensor([[True] * L, [True] * (L - 2) + [False] * 2])
    state = torch.zeros(B, 32)
    state[:, :STATE] = torch.randn(B, STATE, generator=g)
    actions = torch.zeros(B, H, 32)
    actions[:, :, :ACTION] = torch.randn(B, H, ACTION, generator=g)
    noise = torch.randn(B, H, 32, generator=g)
    time = torch.tensor([0.3, 0.85])
    sample_noise = torch.randn(B, H, 32, generator=g)

    as_list = lambda: ([images[:, c] for c in range(CAMERAS)], [image_masks[:, c] for c in range(CAMERAS)])
    with torch.no_grad():
        imgs, masks = as_list()
        losses = model.forward(imgs, masks, tokens, token_mask, state, actions, noise.clone(), time.clone())
        imgs, masks = as_list()
        sampled = model.sample_actions(imgs, masks, tokens, token_mask, state, noise=sample_noise.clone())

    target = OUT / "pi0"
    if target.exists():
        shutil.rmtree(target)
    policy.save_pretrained(target)
    save_file({"images": images, "image_masks": image_masks, "tokens": tokens.to(torch.int32),
               "token_mask": token_mask, "state": state, "actions": actions, "noise": noise, "time": time,
               "sample_noise": sample_noise, "losses": losses.float().contiguous(),
               "actions_sampled": sampled.float().contiguous()}, OUT / "pi0.reference.safetensors")
    print(json.dumps({"dir": str(target), "files": sorted(p.name for p in target.iterdir()),
                      "losses_mean": float(losses.mean()), "sampled_abs_mean": float(sampled.abs().mean())}))


if __name__ == "__main__":
    main()
