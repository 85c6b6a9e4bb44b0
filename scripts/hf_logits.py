"""zerojax's logits of a Hugging Face directory, for scripts/check_hf_export.py to compare with
transformers' (runs in zerojax's venv; the check runs in the torch venv).

    python scripts/hf_logits.py DIR OUT.safetensors     # tensors `tokens` [2, 12], `logits` [2, 12, V]
"""

import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from zerojax.interop import hf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(directory: str, out: str) -> None:
    cfg, model = hf.load(directory)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)).astype(np.int32)
    save_file({"tokens": tokens, "logits": np.asarray(model.logits(tokens))}, out)
    print(f"wrote {out}: zerojax's logits of {directory} ({cfg.family}) for tokens [2, 12]")


if __name__ == "__main__":
    main(*sys.argv[1:])
