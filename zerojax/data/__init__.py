"""Data: what a run reads, as deterministic, step-indexed global batches.

    corpus.py    token corpora (the stdlib's sources, .txt, .bin, .npy, tokenized text) and
                 their rows: int32 [B, T+1]
    images.py    image data (.jsonl / .parquet of image, prefix, suffix) for a vision-language
                 family, as PaliGemmaProcessor makes it: tokens, pixel_values, prefix, loss_mask
    sources.py   the source protocol (`Source`): a batch spec and `rows(split, step, rows)`;
                 which source a config reads; the process's share of the rows
    chat.py      conversation and instruction rows (.jsonl, .parquet): examples through the
                 chat template, the assistant-only loss mask, packing
    template.py  the tokenizer's own chat template, rendered as transformers renders it
    lerobot/     LeRobot datasets (v3.0, v2.1) as a policy's batch: the source, the tables and
                 metadata, the camera frames, the statistics as LeRobot computes them (its
                 own index lists the modules)
    mixture.py   several LeRobot datasets in one run at their weights (data.source=mixture)
    idle.py      openpi's idle-frame filter for LeRobot datasets (data.filter_idle)
    augment.py   openpi's and LeRobot's image augmentation, run in the train step (data.augment)

The batch for step s is a pure function of (seed, split, s), the same on any mesh and any
number of processes; each process builds only the rows its devices hold. A batch is a pytree
of arrays with the batch axis first: a bare token array, or a dict of named fields (the batch
contract: `zerojax.models.protocol` and docs/design.md §1).
"""

from zerojax.data.corpus import (EVAL, TRAIN, Corpus, batch_rows, cache_dir, load_corpus, load_tokenizer,
                                 read_tokens, tokenizer_file, train_tokenizer)
from zerojax.data.sources import Field, Source, TokenSource, batch_spec, open_source, process_rows

__all__ = ["EVAL", "TRAIN", "Corpus", "Field", "Source", "TokenSource", "batch_rows", "batch_spec", "cache_dir",
           "load_corpus", "load_tokenizer", "open_source", "process_rows", "read_tokens", "tokenizer_file",
           "train_tokenizer"]
