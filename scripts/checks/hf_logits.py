"""zerojax's logits of a Hugging Face directory, for scripts/checks/check_hf_export.py to compare with
transformers' (runs in zerojax's venv; the check runs in the torch venv).

    python scripts/checks/hf_logits.py DIR OUT.safetensors     # tensors `tokens` [2, 12], `logits` [2, 12, V]

A vision-language model (PaliGemma: model.vision) gets its image tokens first in each row, then
12 text tokens, random `pixel_values` [2, 3, S, S] and `token_type_ids` (0 on the image and the
first 4 text tokens): all four are saved, and the logits are the prefix-LM ones.
"""

import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from zerojax.interop import hf

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(directory: str, out: str) -> None:
    cfg, model = hf.load(directory)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (2, 12)).astype(np.int32)
    if cfg.family != "paligemma":
        save_file({"tokens": tokens, "logits": np.asarray(model.logits(tokens))}, out)
        print(f"wrote {out}: zerojax's logits of {directory} ({cfg.family}) for tokens [2, 12]")
        return
    v = cfg.vision
    tokens = np.where(tokens == cfg.image_token_id, 0, tokens)
    tokens = np.concatenate([np.full((2, v.image_tokens), cfg.image_token_id, np.int32), tokens], axis=1)
    token_type_ids = (np.arange(tokens.shape[1]) >= v.image_tokens + 4).astype(np.int32)[None].repeat(2, 0)
    pixel_values = rng.standard_normal((2, 3, v.image_size, v.image_size)).astype(np.float32)
    logits = np.asarray(model.logits(tokens, pixel_values, token_type_ids))
    save_file({"tokens": tokens, "pixel_values": pixel_values, "token_type_ids": token_type_ids, "logits": logits}, out)
    print(f"wrote {out}: zerojax's logits of {directory} ({cfg.family}) for {v.image_tokens} image tokens and 12 "
          "text tokens")


if __name__ == "__main__":
    main(*sys.argv[1:])
