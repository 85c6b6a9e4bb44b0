#!/usr/bin/env python3
"""Check a `zerojax export --format hf` directory with transformers itself (the real client).

Needs torch and transformers in a venv of their own (never zerojax's; see make_hf_fixtures.py):

    zerojax export RUN_DIR --format hf --out DIR
    python scripts/hf_logits.py DIR ZEROJAX_LOGITS.safetensors        # zerojax's venv
    /work/hfvenv/bin/python scripts/check_hf_export.py DIR ZEROJAX_LOGITS.safetensors

Loads DIR with `AutoModelForCausalLM.from_pretrained` (it must report no missing, unexpected or
mismatched keys), computes fp32 logits for the tokens stored in ZEROJAX_LOGITS.safetensors
(tensors `tokens` [B, T] and `logits` [B, T, V], written by `zerojax.hf.load(DIR)`'s model),
and prints the largest difference; exits 1 above 1e-4.
"""

import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def main(directory: str, reference: str) -> int:
    model, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True,
                                                       attn_implementation="eager", dtype=torch.float32)
    problems = {k: v for k, v in info.items() if v}
    print(f"loaded {type(model).__name__}; loading info: {problems or 'no missing, unexpected or mismatched keys'}")
    ref = load_file(reference)
    with torch.no_grad():
        logits = model.eval()(ref["tokens"].long()).logits.float()
    diff = (logits - ref["logits"]).abs().max().item()
    print(f"max |transformers - zerojax| logits: {diff:.3g} over {tuple(logits.shape)}")
    return 0 if diff <= 1e-4 and not problems else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
