#!/usr/bin/env python3
"""Record what transformers' PaliGemmaProcessor makes of two fixed images and prompts, so that
zerojax's image data (zerojax/data/images.py) is checked against it without torch at test time.

It needs transformers and Pillow, which zerojax's own environment must not mix with torch; run
it in the separate reference environment (see scripts/make_hf_fixtures.py):

    /work/hfvenv/bin/python scripts/make_processor_fixtures.py [--only bytelevel]

Outputs (committed) in tests/fixtures/processor/<name>/, one per tiny tokenizer:

    tokenizer.json, tokenizer_config.json, ...   the processor, save_pretrained (its tokenizer
                                                 holds <image> and PaliGemma's 1,152 <loc>/<seg>
                                                 tokens, as the processor adds them)
    images/*.png, examples.jsonl                 the two images and their prefix / suffix
    expected.safetensors                         per example i: input_ids_i, token_type_ids_i
                                                 (int64 [L_i]) and pixel_values_i (float32
                                                 [3, 28, 28]), from processor(images=, text=,
                                                 suffix=) one example at a time

The two tokenizers: `bytelevel` (GPT-2's byte-level BPE) and `metaspace` (SentencePiece's
"▁" words, prepended to the first piece only, as Gemma-style tokenizers do: the text after
<bos> must be tokenized as the processor tokenizes it, not as a fresh string).

The images: a 37x23 RGB and a 20x45 RGBA with varying alpha (transformers composites alpha onto
white), so that the bicubic resize to 28x28 both shrinks and stretches. The image processor is
SiglipImageProcessorPil (Pillow's resize), which transformers picks where torchvision is not
installed; the torchvision backend (SiglipImageProcessor in transformers 5) resamples with
torch instead and is not what this records.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
from PIL import Image
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PaliGemmaProcessor, PreTrainedTokenizerFast, SiglipImageProcessorPil

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURE_DIR = REPO_ROOT / "tests" / "fixtures" / "processor"

IMAGE_SIZE, PATCH_SIZE = 28, 14
N_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]  # Gemma's order: pad 0, eos 1, bos 2, unk 3
EXAMPLES = [
    {"image": "images/a.png", "prefix": "what colour is the circle?", "suffix": "red"},
    {"image": "images/b.png", "prefix": "caption en", "suffix": "a blue square, left of a green triangle"},
]
TRAIN_TEXT = [e["prefix"] + "\n" + e["suffix"] for e in EXAMPLES] + [
    "what shape is red? the circle is red and the square is blue.",
    "a green triangle sits left of a yellow circle on a white ground.",
    "answer en where is the triangle? caption es un cuadrado azul",
] * 4


def bytelevel_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TRAIN_TEXT, trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok


def metaspace_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(TRAIN_TEXT, trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIAL,
                                                            show_progress=False))
    return tok


TOKENIZERS = {"bytelevel": bytelevel_tokenizer, "metaspace": metaspace_tokenizer}


def make_images(out: Path) -> None:
    rng = np.random.default_rng(23)
    (out / "images").mkdir(parents=True)
    Image.fromarray(rng.integers(0, 256, (23, 37, 3), dtype=np.uint8), "RGB").save(out / "images" / "a.png")
    rgba = rng.integers(0, 256, (45, 20, 4), dtype=np.uint8)
    rgba[..., 3] = np.linspace(0, 255, 45, dtype=np.uint8)[:, None]  # transparent at the top
    Image.fromarray(rgba, "RGBA").save(out / "images" / "b.png")


def make(name: str) -> None:
    out = FIXTURE_DIR / name
    if out.exists():
        shutil.rmtree(out)
    make_images(out)
    with (out / "examples.jsonl").open("w") as f:
        f.writelines(json.dumps(e) + "\n" for e in EXAMPLES)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=TOKENIZERS[name](), bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>", unk_token="<unk>")
    images = SiglipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                     image_seq_length=N_IMAGE_TOKENS)
    processor = PaliGemmaProcessor(image_processor=images, tokenizer=tokenizer)
    processor.save_pretrained(out)
    Tokenizer.from_file(str(out / "tokenizer.json")).save(str(out / "tokenizer.json"), pretty=False)  # 140 KB, not 220
    expected = {}
    for i, e in enumerate(EXAMPLES):
        with Image.open(out / e["image"]) as image:
            got = processor(images=[image], text=["<image>" + e["prefix"]], suffix=[e["suffix"]], return_tensors="np")
        expected[f"input_ids_{i}"] = got["input_ids"][0].astype(np.int64)
        expected[f"token_type_ids_{i}"] = got["token_type_ids"][0].astype(np.int64)
        expected[f"pixel_values_{i}"] = got["pixel_values"][0].astype(np.float32)
    meta = {"image_size": str(IMAGE_SIZE), "patch_size": str(PATCH_SIZE),
            "image_token_id": str(processor.image_token_id)}
    save_file(expected, str(out / "expected.safetensors"), metadata=meta)
    print(f"{out}: image_token_id={processor.image_token_id}, "
          + ", ".join(f"{len(expected[f'input_ids_{i}'])} ids" for i in range(len(EXAMPLES))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=sorted(TOKENIZERS), help="write this fixture alone")
    args = parser.parse_args()
    for name in [args.only] if args.only else TOKENIZERS:
        make(name)


if __name__ == "__main__":
    main()
