"""Corpora and deterministic, step-indexed batches.

Sources: `stdlib` (the Python standard library's own `.py` files, read in sorted order, as
bytes: present on every machine, nothing to download), a `.txt` file (bytes), or a nanoGPT-style
token array (`.bin` raw uint16, or `.npy`). The last `val_fraction` of the tokens is held out.

The batch for step s is a pure function of (seed, s): row starts come from a generator seeded
with (seed, split, s), so it is the same on any mesh and any number of processes; a process
reads only the rows it owns.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zerojax.config import ConfigError

TRAIN, EVAL = 0, 1  # generator streams


@dataclass(frozen=True)
class Corpus:
    name: str
    train: np.ndarray  # 1-D token array
    val: np.ndarray  # 1-D token array, after `train` in the source
    vocab_size: int  # tokens the source can contain (256 for bytes)


def stdlib_files() -> list[Path]:
    """Every `.py` file of this interpreter's standard library, in sorted path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in skip)
        files += [Path(folder, n) for n in sorted(names) if n.endswith(".py")]
    return files


def read_tokens(source: str) -> tuple[np.ndarray, int]:
    """The whole token stream of a source and the size of its vocabulary."""
    if source == "stdlib":
        return np.frombuffer(b"".join(f.read_bytes() for f in stdlib_files()), np.uint8), 256
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"data.source={source!r}: no such file")
    if path.suffix == ".txt":
        return np.frombuffer(path.read_bytes(), np.uint8), 256
    tokens = np.memmap(path, np.uint16, mode="r") if path.suffix == ".bin" else np.load(path, mmap_mode="r")
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ConfigError(f"data.source={source!r} must hold a 1-D integer token array, got {tokens.dtype}{list(tokens.shape)}")
    return tokens, int(tokens.max()) + 1 if tokens.size else 0


def load_corpus(source: str, val_fraction: float, seq_len: int) -> Corpus:
    tokens, vocab = read_tokens(source)
    n_val = int(len(tokens) * val_fraction)
    train, val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]
    for split, arr in (("training", train), ("validation", val)):
        if len(arr) < seq_len + 2:
            raise ConfigError(
                f"data.source={source!r}: the {split} split has {len(arr)} tokens, fewer than "
                f"model.seq_len+2={seq_len + 2}; use a bigger corpus or a shorter model.seq_len"
            )
    return Corpus(source, train, val, vocab)


def row_starts(n_tokens: int, seq_len: int, seed: int, stream: int, step: int, batch: int) -> np.ndarray:
    rng = np.random.default_rng((seed, stream, step))
    return rng.integers(0, n_tokens - seq_len - 1, size=batch)


def batch_rows(tokens: np.ndarray, seq_len: int, seed: int, stream: int, step: int,
               global_batch: int, rows: slice = slice(None)) -> np.ndarray:
    """Rows `rows` of the global batch for `step`: int32 [rows, seq_len + 1] (inputs + next)."""
    starts = row_starts(len(tokens), seq_len, seed, stream, step, global_batch)[rows]
    return np.stack([np.asarray(tokens[s : s + seq_len + 1], np.int32) for s in starts])


def process_rows(sharding, global_batch: int) -> slice:
    """The contiguous block of batch rows that this process's devices hold under `sharding`."""
    index_map = sharding.addressable_devices_indices_map((global_batch,))
    starts = sorted({idx[0].indices(global_batch)[0] for idx in index_map.values()})
    stops = sorted({idx[0].indices(global_batch)[1] for idx in index_map.values()})
    return slice(starts[0], stops[-1])
