#!/usr/bin/env python3
"""Check a `zerojax export --format hf` directory with transformers itself (the real client).

Needs torch and transformers in a venv of their own (never zerojax's; see scripts/fixtures/make_hf_fixtures.py):

    zerojax export RUN_DIR --format hf --out DIR
    python scripts/checks/hf_logits.py DIR ZEROJAX_LOGITS.safetensors        # zerojax's venv
    /work/hfvenv/bin/python scripts/checks/check_hf_export.py DIR ZEROJAX_LOGITS.safetensors

Loads DIR with `AutoModelForCausalLM.from_pretrained` (`AutoModelForImageTextToText` when the
reference holds `pixel_values`: PaliGemma; it must report no missing, unexpected or mismatched
keys), computes fp32 logits for the tokens stored in ZEROJAX_LOGITS.safetensors (tensors
`tokens` [B, T] and `logits` [B, T, V], and `pixel_values`, `token_type_ids` for an image model,
written by `zerojax.interop.hf.load(DIR)`'s model), and prints the largest difference; exits 1 above 1e-4.
"""

import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText


def main(directory: str, reference: str) -> int:
    ref = load_file(reference)
    auto = AutoModelForImageTextToText if "pixel_values" in ref else AutoModelForCausalLM
    model, info = auto.from_pretrained(directory, output_loading_info=True, attn_implementation="eager",
                                       dtype=torch.float32)
    problems = {k: v for k, v in info.items() if v}
    print(f"loaded {type(model).__name__}; loading info: {problems or 'no missing, unexpected or mismatched keys'}")
    images = {k: ref[k].long() if k == "token_type_ids" else ref[k] for k in ("pixel_values", "token_type_ids") if k in ref}
    with torch.no_grad():
        logits = model.eval()(ref["tokens"].long(), **images).logits.float()
    diff = (logits - ref["logits"]).abs().max().item()
    print(f"max |transformers - zerojax| logits: {diff:.3g} over {tuple(logits.shape)}")
    return 0 if diff <= 1e-4 and not problems else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
