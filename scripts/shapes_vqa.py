#!/usr/bin/env python3
"""A visual question-answering set small enough to learn on a CPU: images of two (or, with
--shapes 1, one) coloured shapes on white, one question each ("what colour is the circle?" -> "red", "what shape is blue?" ->
"square"), as PaliGemma's fine-tuning JSONL, with a tokenizer for it.

    python scripts/shapes_vqa.py --out data/shapes [--n 2000] [--size 32] [--shapes 2] [--seed 0]

writes, deterministically from --seed:

    OUT/images/NNNNN.png      --size x --size RGB
    OUT/data.jsonl            {"image": "images/NNNNN.png", "prefix": question, "suffix": answer}
    OUT/tokenizer.json        a byte-level BPE trained on the questions and answers, with <pad>,
                              <eos>, <bos>, <unk> and <image> (the last id) as special tokens
    OUT/tokenizer_config.json which of them are BOS, EOS and padding (as transformers saves it)

(--blank: the same questions and answers with every image white, a text-only baseline's set) and
prints the keys a run needs (data.source, data.tokenizer, model.image_token_id, the least
model.vocab_size). Each image has its own question, so the examples zerojax holds out (the last
data.val_fraction of the file) are images it never trains on. An answer cannot be read from the
question: colours and shapes are drawn independently, so a model that does not look answers at
chance (1 in len(COLOURS) for colour, 1 in len(SHAPES) for shape).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (30, 60, 220), "yellow": (230, 200, 20),
           "purple": (140, 40, 170), "orange": (240, 130, 20)}
SHAPES = ("circle", "square", "triangle")
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]


def draw(shape: str, colour: tuple, box: tuple, canvas: ImageDraw.ImageDraw) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        canvas.ellipse(box, fill=colour)
    elif shape == "square":
        canvas.rectangle(box, fill=colour)
    else:
        canvas.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=colour)


def example(rng: np.random.Generator, size: int, n_shapes: int = 2) -> tuple[Image.Image, str, str]:
    """An image of n_shapes shapes of different kinds and colours, each in its own vertical strip,
    and a question about one of them."""
    shapes = rng.choice(len(SHAPES), n_shapes, replace=False)
    colours = rng.choice(len(COLOURS), n_shapes, replace=False)
    image = Image.new("RGB", (size, size), (255, 255, 255))
    canvas = ImageDraw.Draw(image)
    strip = size // n_shapes  # each shape 5/8 to 7/8 of its strip's width
    for k, at in enumerate(rng.permutation(n_shapes)):
        extent = int(rng.integers(strip * 5 // 8, strip * 7 // 8 + 1))
        x0 = int(rng.integers(0, strip - extent + 1)) + int(at) * strip
        y0 = int(rng.integers(0, size - extent + 1))
        draw(SHAPES[shapes[k]], list(COLOURS.values())[colours[k]], (x0, y0, x0 + extent - 1, y0 + extent - 1), canvas)
    asked = int(rng.integers(n_shapes))
    shape, colour = SHAPES[shapes[asked]], list(COLOURS)[colours[asked]]
    if rng.random() < 0.5:
        return image, f"what colour is the {shape}?", colour
    return image, f"what shape is {colour}?", shape


def tokenizer(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # enough merges for every word of the questions and answers to be one token
    trainer = trainers.BpeTrainer(vocab_size=256 + len(SPECIAL) + 64, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([AddedToken("<image>", normalized=False, special=True)])
    return tok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="a new directory for the set")
    parser.add_argument("--n", type=int, default=2000, help="examples (one image each)")
    parser.add_argument("--size", type=int, default=32, help="image side in pixels")
    parser.add_argument("--shapes", type=int, choices=(1, 2), default=2,
                        help="shapes per image: 2 asks the model to bind a colour to a shape; 1 is the easy set")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--blank", action="store_true", help="the same questions and answers, every image white: the "
                        "text-only baseline's training set")
    args = parser.parse_args(argv)
    if args.out.exists():
        print(f"shapes_vqa: error: --out {str(args.out)!r} already exists; give a new directory", file=sys.stderr)
        return 2
    if args.n < 2 or args.size < 16:
        print("shapes_vqa: error: --n must be >= 2 and --size >= 16 (two shapes side by side)", file=sys.stderr)
        return 2
    rng = np.random.default_rng(args.seed)
    (args.out / "images").mkdir(parents=True)
    lines = []
    for i in range(args.n):
        image, question, answer = example(rng, args.size, args.shapes)
        if args.blank:
            image = Image.new("RGB", image.size, (255, 255, 255))
        image.save(args.out / "images" / f"{i:05d}.png")
        lines.append({"image": f"images/{i:05d}.png", "prefix": question, "suffix": answer})
    (args.out / "data.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    tok = tokenizer([e["prefix"] + "\n" + e["suffix"] for e in lines])
    tok.save(str(args.out / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
              "extra_special_tokens": ["<image>"]}
    (args.out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    image_id = tok.token_to_id("<image>")
    print(f"data.source={args.out / 'data.jsonl'} data.tokenizer={args.out} model.image_token_id={image_id} "
          f"model.vocab_size>={tok.get_vocab_size()} model.vision.image_size={args.size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
