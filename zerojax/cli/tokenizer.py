"""`zerojax tokenizer train`: a byte-level BPE tokenizer (Hugging Face tokenizers) trained on
Python's own sources or a .txt file."""

from __future__ import annotations

from pathlib import Path

from zerojax import data
from zerojax.cli.args import Parser, UsageError, positive_int

HELP = "train a byte-level BPE tokenizer (Hugging Face tokenizers)"


def arguments(tokenizer: Parser) -> None:
    tokenizer.add_argument("action", choices=["train"])
    tokenizer.add_argument("source", nargs="?", default="stdlib", metavar="SOURCE",
                           help="stdlib (default: Python's own sources) or a .txt file")
    tokenizer.add_argument("--vocab-size", type=positive_int, required=True, metavar="N")
    tokenizer.add_argument("--out", required=True, metavar="DIR", help="writes DIR/tokenizer.json")


def run(args) -> int:
    if args.source != "stdlib" and Path(args.source).suffix != ".txt":
        raise UsageError(f"SOURCE {args.source!r} must be stdlib or a .txt file")
    path = data.train_tokenizer(args.source, args.vocab_size, Path(args.out))
    print(f"zerojax: wrote {path}: byte-level BPE, vocab {args.vocab_size}, trained on {args.source}; "
          f"use data.tokenizer={path} model.vocab_size={args.vocab_size}")
    return 0
