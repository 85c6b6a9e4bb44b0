#!/usr/bin/env python3
"""Generate Hugging Face reference fixtures for zerojax's checkpoint converters.

This script runs the *real* reference implementation (PyTorch + transformers) to
produce tiny random checkpoints and the logits that transformers computes for
them.  zerojax's tests then load those checkpoints with zerojax's own converter
and compare its logits with the saved ones, without needing torch at test time.

It needs torch and transformers, which are deliberately NOT dependencies of
zerojax.  Install them in a separate virtual environment, never zerojax's:

    python3 -m venv /work/hfvenv
    /work/hfvenv/bin/pip install torch transformers safetensors numpy

and run it from anywhere (outputs go under the repo root found from this file):

    /work/hfvenv/bin/python scripts/make_hf_fixtures.py [--only gemma]

(`--only NAME` writes that fixture alone and leaves the others' committed bytes as they are, for
when the installed torch/transformers differ from the versions that made them.)

Outputs (committed, a few hundred KB in all) in tests/fixtures/hf/:

    llama-gqa/              LlamaForCausalLM, GQA (4 q heads / 2 kv heads),
                            untied lm_head, saved SHARDED with an index json
    llama-tied/             LlamaForCausalLM, MHA, tied embeddings,
                            rope_theta=500000, single model.safetensors
    gpt2/                   GPT2LMHeadModel (tied), single model.safetensors
    gemma/                  GemmaForCausalLM, MQA (4 q heads / 1 kv head),
                            head_dim 16 != hidden 32 / 4 heads, tied,
                            single model.safetensors
    <name>.logits.safetensors   tensors "tokens" int32 [2,12] and
                                "logits" float32 [2,12,256]
    paligemma/              PaliGemmaForConditionalGeneration: SigLIP (16x16 images, 4x4
                            patches: 16 image tokens, width 32, 2 layers) and the tiny
                            Gemma above; image token 255; single model.safetensors
    paligemma.logits.safetensors  "tokens" int32 [2,24] (16 image tokens, then text),
                            "pixel_values" float32 [2,3,16,16], "token_type_ids" int32
                            [2,24] (0: image and prompt, 1: answer), "logits" (with
                            token_type_ids: prefix-LM) and "logits_causal" (without)

Optional larger random checkpoints for memory benchmarks (NOT committed):

    --gpt2-small DIR    GPT-2-small shapes (default GPT2Config(), ~124M params)
    --llama-small DIR   Llama, hidden 768, 12 layers, 12 heads / 4 kv heads,
                        intermediate 2048, vocab 32000, sharded at 200MB

Everything is fp32, eager attention, and seeded, so re-running the script
reproduces the same files given the same torch/transformers versions.
"""

from __future__ import annotations

import argparse
import inspect
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import (GemmaConfig, GemmaForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          PaliGemmaConfig, PaliGemmaForConditionalGeneration)
from transformers.utils import logging as hf_logging

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURE_DIR = REPO_ROOT / "tests" / "fixtures" / "hf"

VOCAB = 256
# Fixed token ids shared by every fixture.  Their own generator, so they do not
# depend on how many random numbers model construction consumed.
TOKENS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))

# Std of the random weight matrices in the tiny fixtures.  HF's default (0.02)
# is too small for a width-32 model: attention scores come out ~1e-3, so the
# softmax is almost uniform, and activations sit in the linear part of GELU/SiLU.
# A converter with wrong RoPE, a wrong GELU variant or a wrong attention scale
# would then still match the logits to ~1e-6.  With 0.2 (about 1/sqrt(32)) the
# scores and activations are O(1) and every such mistake is visible.
TINY_WEIGHT_STD = 0.2


def perturb_(model: torch.nn.Module, weight_std: float) -> None:
    """Re-draw every parameter so that none is trivially 0 or 1.

    HF initialises norm scales to 1 and biases to 0; a converter that swapped
    two norms, dropped a bias or forgot a transpose could then pass by accident.
    model.parameters() yields a tied embedding/lm_head only once.
    """
    norm_types = (torch.nn.LayerNorm,)
    with torch.no_grad():
        for mod_name, module in model.named_modules():
            # LlamaRMSNorm is not an nn.LayerNorm subclass; match it by name.
            is_norm = isinstance(module, norm_types) or "Norm" in type(module).__name__
            for p_name, p in module.named_parameters(recurse=False):
                if is_norm and p_name == "weight":
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                elif p_name == "bias":
                    p.copy_(0.1 * torch.randn_like(p))
                else:
                    p.normal_(0.0, weight_std)


def save_checkpoint(model: torch.nn.Module, out_dir: Path, max_shard_size: str | None = None) -> None:
    """save_pretrained as safetensors, into a freshly emptied directory.

    The directory is wiped first so a stale shard or index from an earlier run
    (e.g. with another shard size) cannot linger next to the new files.
    """
    if out_dir.exists():
        shutil.rmtree(out_dir)
    kwargs = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    # transformers 4.x needs safe_serialization=True (it defaulted to .bin in
    # older releases); 5.x always writes safetensors and dropped the argument.
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True
    model.save_pretrained(str(out_dir), **kwargs)
    if not any(out_dir.glob("*.safetensors")):
        raise RuntimeError(f"save_pretrained wrote no .safetensors file in {out_dir}")


def reference_logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()  # no dropout
    with torch.no_grad():
        out = model(input_ids=TOKENS).logits
    assert out.dtype == torch.float32 and out.shape == (*TOKENS.shape, model.config.vocab_size)
    return out.contiguous()


def llama_config(**overrides) -> LlamaConfig:
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def gpt2_config(**overrides) -> GPT2Config:
    kw = dict(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        layer_norm_epsilon=1e-5,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        # GPT2Config defaults these to 50256, outside a 256-token vocab, and
        # transformers warns about it.  They do not affect logits.
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
        attn_implementation="eager",
    )
    kw.update(overrides)
    return GPT2Config(**kw)


def gemma_config(**overrides) -> GemmaConfig:
    # head_dim 16 with hidden 32 and 4 heads: a converter that derives the head dim from
    # hidden / heads (8) gets the wrong shapes. One kv head: multi-query attention.
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    kw.update(overrides)
    return GemmaConfig(**kw)


# name -> (model class, config factory, max_shard_size or None for one file)
TINY_FIXTURES = {
    # ~140 KB of fp32 weights; 40KB shards split it into several files, so the
    # index (model.safetensors.index.json) path of a loader is exercised.
    "llama-gqa": (LlamaForCausalLM, lambda: llama_config(), "40KB"),
    "llama-tied": (
        LlamaForCausalLM,
        lambda: llama_config(
            tie_word_embeddings=True, num_key_value_heads=4, rope_theta=500000.0, rms_norm_eps=1e-6
        ),
        None,
    ),
    "gpt2": (GPT2LMHeadModel, lambda: gpt2_config(), None),
    "gemma": (GemmaForCausalLM, lambda: gemma_config(), None),
}


PALIGEMMA_IMAGE_TOKEN = VOCAB - 1
PALIGEMMA_IMAGE, PALIGEMMA_PATCH = 16, 4  # 16 image tokens


def paligemma_config() -> PaliGemmaConfig:
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, image_size=PALIGEMMA_IMAGE, patch_size=PALIGEMMA_PATCH,
                  layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh", vision_use_head=False)
    text = {**gemma_config().to_dict(), "model_type": "gemma"}
    return PaliGemmaConfig(vision_config=vision, text_config=text, image_token_index=PALIGEMMA_IMAGE_TOKEN,
                           vocab_size=VOCAB, projection_dim=32, hidden_size=32, attn_implementation="eager")


def paligemma_inputs() -> dict:
    """Fixed inputs of their own generator: per row 16 image tokens, then 8 text tokens (never the
    image token), the first 3 (row 0) or 5 (row 1) of them the prompt (token_type_ids 0)."""
    g = torch.Generator().manual_seed(2)
    n_image = (PALIGEMMA_IMAGE // PALIGEMMA_PATCH) ** 2
    text = torch.randint(0, PALIGEMMA_IMAGE_TOKEN, (2, 8), generator=g)
    tokens = torch.cat([torch.full((2, n_image), PALIGEMMA_IMAGE_TOKEN), text], dim=1)
    token_type_ids = torch.ones_like(tokens)
    for row, prompt in enumerate((3, 5)):
        token_type_ids[row, : n_image + prompt] = 0
    pixel_values = torch.randn(2, 3, PALIGEMMA_IMAGE, PALIGEMMA_IMAGE, generator=g)
    return {"tokens": tokens, "pixel_values": pixel_values, "token_type_ids": token_type_ids}


def make_paligemma_fixture() -> None:
    model = build(PaliGemmaForConditionalGeneration, paligemma_config(), TINY_WEIGHT_STD)
    save_checkpoint(model, FIXTURE_DIR / "paligemma")
    inputs = paligemma_inputs()
    with torch.no_grad():
        logits = model(input_ids=inputs["tokens"], pixel_values=inputs["pixel_values"],
                       token_type_ids=inputs["token_type_ids"]).logits.contiguous()
        causal = model(input_ids=inputs["tokens"], pixel_values=inputs["pixel_values"]).logits.contiguous()
    assert logits.dtype == torch.float32 and logits.shape == (*inputs["tokens"].shape, VOCAB)
    save_file({"tokens": inputs["tokens"].to(torch.int32).contiguous(), "pixel_values": inputs["pixel_values"],
               "token_type_ids": inputs["token_type_ids"].to(torch.int32).contiguous(), "logits": logits,
               "logits_causal": causal}, str(FIXTURE_DIR / "paligemma.logits.safetensors"))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"paligemma: {n_params} params, logits std {logits.std():.3f}, prefix-LM vs causal differ by "
          f"{(logits - causal).abs().max():.3f} -> {FIXTURE_DIR / 'paligemma'}")


# name -> a function that writes the fixture (inputs beyond tokens)
MULTIMODAL_FIXTURES = {"paligemma": make_paligemma_fixture}


def build(model_cls, config, weight_std: float) -> torch.nn.Module:
    # Seed per model, so each fixture is reproducible on its own and adding a
    # fixture never changes the others.
    torch.manual_seed(0)
    model = model_cls(config).to(torch.float32)
    perturb_(model, weight_std)
    return model.eval()


def make_tiny_fixtures(only: list[str] | None = None) -> None:
    FIXTURE_DIR.mkdir(parents=True, exist_ok=True)
    for name, (model_cls, make_config, shard) in TINY_FIXTURES.items():
        if only and name not in only:
            continue
        model = build(model_cls, make_config(), TINY_WEIGHT_STD)
        save_checkpoint(model, FIXTURE_DIR / name, max_shard_size=shard)
        logits = reference_logits(model)
        save_file(
            {"tokens": TOKENS.to(torch.int32).contiguous(), "logits": logits},
            str(FIXTURE_DIR / f"{name}.logits.safetensors"),
        )
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{name}: {n_params} params, logits std {logits.std():.3f} -> {FIXTURE_DIR / name}")
    for name, make in MULTIMODAL_FIXTURES.items():
        if not only or name in only:
            make()


def make_benchmark_checkpoint(model_cls, config, out_dir: Path, max_shard_size: str | None) -> None:
    # HF's own initializer_range std (0.02) keeps activations sane at width 768;
    # these are for memory benchmarks, not numerical comparison.
    model = build(model_cls, config, config.initializer_range)
    save_checkpoint(model, out_dir, max_shard_size=max_shard_size)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{model_cls.__name__}: {n_params / 1e6:.1f}M params -> {out_dir}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpt2-small", type=Path, metavar="DIR",
                        help="also write a random GPT-2-small checkpoint (124M, fp32) into DIR")
    parser.add_argument("--llama-small", type=Path, metavar="DIR",
                        help="also write a random ~125M Llama (GQA) checkpoint, sharded at 200MB, into DIR")
    parser.add_argument("--skip-tiny", action="store_true",
                        help="do not (re)write tests/fixtures/hf")
    parser.add_argument("--only", action="append", choices=sorted(TINY_FIXTURES | MULTIMODAL_FIXTURES), metavar="NAME",
                        help="(re)write only this tiny fixture (repeatable); default: all of them")
    args = parser.parse_args()

    hf_logging.disable_progress_bar()  # "Writing model shards" bars are noise here
    torch.manual_seed(0)
    if not args.skip_tiny:
        make_tiny_fixtures(args.only)
    if args.gpt2_small:
        make_benchmark_checkpoint(
            GPT2LMHeadModel, GPT2Config(attn_implementation="eager"), args.gpt2_small, None
        )
    if args.llama_small:
        config = LlamaConfig(
            vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
            num_attention_heads=12, num_key_value_heads=4, attn_implementation="eager",
        )
        make_benchmark_checkpoint(LlamaForCausalLM, config, args.llama_small, "200MB")


if __name__ == "__main__":
    main()
