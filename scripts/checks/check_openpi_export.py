#!/usr/bin/env python3
"""Check `zerojax export --format openpi` of a π0 run with running code that reads openpi trees:
LeRobot 0.3.3's own converter (`lerobot/policies/pi0/conversion_scripts/convert_pi0_to_hf_lerobot.py`,
which reads openpi's `params/` with orbax and writes a LeRobot π0). Its LeRobot checkpoint must
equal zerojax's own `--format lerobot` export of the same run, tensor for tensor.

    /work/main/.venv/bin/python scripts/checks/check_openpi_export.py WORK [--pi0venv /work/pi0venv/bin/python]
    /work/pi0venv/bin/python scripts/checks/check_openpi_export.py --converter WORK/pi0_base/params OUT --as-shipped

The driver (zerojax's venv) trains a tiny π0 two steps on tests/fixtures/lerobot/tiny, exports it
as openpi (WORK/pi0_base: the converter picks its PI0Config by that name) and as LeRobot
(WORK/lerobot), runs the converter in the LeRobot 0.3.3 venv (this script with --converter; its
venv: scripts/fixtures/make_lerobot_fixtures.py's, plus openpi's pins `jax==0.5.3
orbax-checkpoint==0.11.13`: the converter's `checkpointer.metadata(...)["params"]` is older
orbax's API), and compares the two model.safetensors.

What the converter half changes in LeRobot, and why (everything else runs as shipped):
- the sizes: the converter hard-codes gemma_2b / gemma_300m / So400m (`get_paligemma_config`,
  `get_gemma_config`) and PI0Config's proj_width=1024; they are replaced by
  make_lerobot_fixtures.py's tiny configs (with 4 VLM heads of 8 and a vocabulary of 256: the
  converter reshapes the VLM's attn_vec_einsum [N, H, D] by transpose(2, 0, 1).reshape(N·H, D),
  which is right only where N·H == D, as in gemma_2b) and proj_width=16;
- the dtype: π0 casts its modules to bfloat16 when built; the modules see a `torch` whose bfloat16
  is float32 (make_lerobot_fixtures.Float32Torch), so the converted tensors are not rounded;
- the names: the converter writes transformers 4.51's PaliGemma names
  (`paligemma.language_model.model.layers…`), which LeRobot 0.3.3's own modules (transformers
  4.53: `paligemma.model.language_model.layers…`) do not have, and the expert's
  `embed_tokens`, which 0.3.3 deletes; its `load_state_dict` is given the names through
  transformers' own `PaliGemmaForConditionalGeneration._checkpoint_conversion_mapping`, and the
  deleted table dropped (the script prints both, and how many tensors each touched).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.family=pi0", "model.norm_eps=1e-6", "model.vocab_size=256", "model.d_model=32", "model.n_layers=2",
        "model.n_heads=4", "model.n_kv_heads=1", "model.head_dim=8", "model.d_ff=64", "model.expert.d_model=16",
        "model.expert.d_ff=48", "model.vision.image_size=28", "model.vision.patch_size=14", "model.vision.d_model=24",
        "model.vision.n_layers=2", "model.vision.n_heads=2", "model.vision.d_ff=48", "model.action.horizon=4",
        "model.action.prompt_len=16", "model.action.max_state_dim=32", "model.action.max_action_dim=32",
        "model.action.action_dim=2", "model.action.cameras=2", "data.image_size=28", "data.action_horizon=4",
        "data.prompt_len=16", f"data.source=lerobot:{ROOT / 'tests' / 'fixtures' / 'lerobot' / 'tiny'}",
        "train.global_batch=8", "zero.min_shard_size=64", "train.steps=2", "train.eval_every=0", "train.sample_tokens=0", "model.remat=none"]


def zerojax(*args: str) -> None:
    print("$ zerojax " + " ".join(args[:3]) + (" ..." if len(args) > 3 else ""), flush=True)
    subprocess.run([sys.executable, "-m", "zerojax", *args], cwd=ROOT, check=True)


def driver(work: Path, pi0venv: str) -> int:
    import numpy as np
    from safetensors.numpy import load_file

    shutil.rmtree(work, ignore_errors=True)
    zerojax("train", *TINY, f"train.out_dir={work / 'run'}")
    zerojax("export", str(work / "run"), "--format", "openpi", "--out", str(work / "pi0_base"))
    zerojax("export", str(work / "run"), "--format", "lerobot", "--out", str(work / "lerobot"))
    subprocess.run([pi0venv, __file__, "--converter", str(work / "pi0_base" / "params"), str(work / "converted")],
                   cwd=ROOT, check=True)
    ours, theirs = load_file(work / "lerobot" / "model.safetensors"), load_file(work / "converted" / "model.safetensors")
    both = sorted(set(ours) & set(theirs))
    worst = max(both, key=lambda k: float(np.abs(ours[k] - theirs[k]).max()) if ours[k].shape == theirs[k].shape
                else np.inf)
    shapes = [k for k in both if ours[k].shape != theirs[k].shape]
    diff = float(np.abs(ours[worst] - theirs[worst]).max()) if not shapes else np.inf
    print(f"tensors: {len(both)} in both, max |converter - zerojax| = {diff:.3g} (at {worst}); shapes differ: {shapes}")
    for name, only in (("zerojax's export only", set(ours) - set(theirs)), ("the converter's only", set(theirs) - set(ours))):
        print(f"{name}: " + (", ".join(f"{k} {list(ours.get(k, theirs.get(k)).shape)} max|x|="
                                         f"{float(np.abs(ours.get(k, theirs.get(k))).max()):.3g}" for k in sorted(only))
                             or "none"))
    embed, lm_head = (f"model.paligemma_with_expert.paligemma.{k}" for k in ("model.language_model.embed_tokens.weight",
                                                                          "lm_head.weight"))
    tied = embed in ours and lm_head in theirs and np.array_equal(ours[embed], theirs[lm_head])
    print(f"zerojax's embed_tokens equals the converter's lm_head (written tied): {tied}")
    return 0 if diff == 0 and not shapes and tied else 1


def converter(params: str, out: str, as_shipped: str = "") -> int:
    """The converter on `params`, written to `out`; `as_shipped` ("--as-shipped"): without the
    names' shim, to see LeRobot 0.3.3's converter fail on its own modules' names."""
    import functools
    import types

    sys.path.insert(0, str(ROOT / "scripts" / "fixtures"))
    import make_lerobot_fixtures as fixtures  # LeRobot 0.3.3 imported, torchvision stood in for
    import lerobot.policies.pi0.conversion_scripts.convert_pi0_to_hf_lerobot as convert
    from transformers import PaliGemmaForConditionalGeneration

    fixtures.HEADS, fixtures.VOCAB = 4, 256
    fp32 = fixtures.Float32Torch("torch")
    fixtures.pwe.torch = fixtures.modeling_pi0.torch = fp32
    fixtures.pwe.PaliGemmaWithExpertConfig.__init__ = fixtures.tiny_configs
    fixtures.modeling_pi0.AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda *a, **k: None)
    tiny = fixtures.pwe.PaliGemmaWithExpertConfig()
    convert.get_paligemma_config = lambda precision: tiny.paligemma_config
    convert.get_gemma_config = lambda precision: tiny.gemma_expert_config
    convert.PI0Config = functools.partial(convert.PI0Config, proj_width=fixtures.EXPERT)

    mapping = PaliGemmaForConditionalGeneration._checkpoint_conversion_mapping
    load = convert.PI0Policy.load_state_dict
    dropped = "model.paligemma_with_expert.gemma_expert.model.embed_tokens.weight"

    def renamed(self, state, *args, **kwargs):
        prefix, out_state, touched = "model.paligemma_with_expert.paligemma.", {}, 0
        for name, value in state.items():
            if name == dropped:
                continue
            if name.startswith(prefix):
                tail = name[len(prefix):]
                for pattern, replacement in mapping.items():
                    tail, n = re.subn(pattern, replacement, tail)
                    touched += n
                name = prefix + tail
            out_state[name] = value
        print(f"converter: {touched} names renamed by transformers' {mapping}; dropped {dropped}")
        return load(self, out_state, *args, **kwargs)

    if as_shipped != "--as-shipped":
        convert.PI0Policy.load_state_dict = renamed
    convert.convert_pi0_checkpoint(checkpoint_dir=params, precision="float32", tokenizer_id="", output_path=out)
    print(f"converter: wrote {out} and PI0Policy.from_pretrained loaded it")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--converter":
        sys.exit(converter(*sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--pi0venv", default="/work/pi0venv/bin/python")
    args = parser.parse_args()
    sys.exit(driver(args.work, args.pi0venv))
