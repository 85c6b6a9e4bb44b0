#!/usr/bin/env python3
"""Write a tiny PEFT LoRA adapter, and the logits PEFT computes with it, as zerojax's reference.

Runs the real reference implementation (torch + transformers + peft), which are NOT zerojax
dependencies: use the fixture venv of scripts/make_hf_fixtures.py plus peft,

    /work/hfvenv/bin/pip install peft
    /work/hfvenv/bin/python scripts/make_peft_fixture.py

Reads tests/fixtures/hf/llama-gqa (written by make_hf_fixtures.py) and writes, committed:

    tests/fixtures/hf/llama-gqa-lora/          adapter_config.json + adapter_model.safetensors
                                               (r 4, lora_alpha 8, every projection of every layer)
    tests/fixtures/hf/llama-gqa-lora.logits.safetensors
                                               "tokens" int32 [2, 12], "logits" float32 [2, 12, 256]
                                               of the base with the adapter applied

and with --mixed the same as llama-gqa-lora-mixed/ and llama-gqa-lora-mixed.logits.safetensors,
with PEFT's per-module ranks and alphas (MIXED: rank_pattern q_proj 2, down_proj 8; alpha_pattern
down_proj 4; r 4 and lora_alpha 8 for the rest).

PEFT initialises lora_B to zeros, which would make the adapter a no-op and every naming or
scaling mistake invisible; both matrices are redrawn at random (seeded) before saving.

With --check DIR (a directory that `zerojax export --format peft` wrote from a run started
from llama-gqa) it instead loads that adapter into the base with
`peft.PeftModel.from_pretrained` and prints the logits' largest difference from DIR's
`logits.safetensors` (written by the test or by hand with zerojax), after checking that
every tensor was loaded (no missing or unexpected adapter keys).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
BASE = FIXTURES / "llama-gqa"
TOKENS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))  # as make_hf_fixtures.py
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=TOKENS).logits.contiguous()


# --mixed: PEFT's per-module ranks and alphas (rank_pattern, alpha_pattern) in one adapter
MIXED = {"rank_pattern": {"q_proj": 2, "down_proj": 8}, "alpha_pattern": {"down_proj": 4}}


def make(mixed: bool = False) -> None:
    torch.manual_seed(0)
    base = LlamaForCausalLM.from_pretrained(str(BASE), torch_dtype=torch.float32, attn_implementation="eager")
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0,
                                            **(MIXED if mixed else {})))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)
    name = "llama-gqa-lora-mixed" if mixed else "llama-gqa-lora"
    out = FIXTURES / name
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(str(out))
    (out / "README.md").unlink(missing_ok=True)  # PEFT's model-card template
    config = json.loads((out / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "tests/fixtures/hf/llama-gqa"  # not this machine's absolute path
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    save_file({"tokens": TOKENS.to(torch.int32).contiguous(), "logits": logits(model)},
              str(FIXTURES / f"{name}.logits.safetensors"))
    print(f"wrote {out}: {sorted(p.name for p in out.iterdir())}")


def check(adapter: Path) -> None:
    base = LlamaForCausalLM.from_pretrained(str(BASE), torch_dtype=torch.float32, attn_implementation="eager")
    want = {k for k in load_file(str(adapter / "adapter_model.safetensors"))}
    model = PeftModel.from_pretrained(base, str(adapter))
    loaded = {n for n, _ in model.named_parameters() if "lora_" in n}
    # PEFT names a loaded parameter ...lora_A.default.weight; the file has ...lora_A.weight
    missing = {k for k in want if k.replace(".weight", ".default.weight") not in loaded}
    assert not missing and len(loaded) == len(want), (missing, len(loaded), len(want))
    ref = load_file(str(adapter / "logits.safetensors"))
    got = model(input_ids=ref["tokens"].long()).logits
    print(f"peft loaded {len(want)} adapter tensors from {adapter}; "
          f"max |logits - zerojax's| = {(got - ref['logits']).abs().max().item():.3g}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", type=Path, metavar="DIR", help="load a zerojax PEFT export into the base")
    parser.add_argument("--mixed", action="store_true", help="write llama-gqa-lora-mixed (rank_pattern, alpha_pattern)")
    args = parser.parse_args()
    check(args.check) if args.check else make(args.mixed)
