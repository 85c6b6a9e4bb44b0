"""Token corpora and their deterministic, step-indexed rows.

Sources: `stdlib` (the Python standard library's own `.py` files, read in sorted order, as
bytes: present on every machine, nothing to download), a `.txt` file (bytes), or a nanoGPT-style
token array (`.bin` raw uint16, or `.npy`). The last `val_fraction` of the tokens is held out.

The batch for step s is a pure function of (seed, s): row starts come from a generator seeded
with (seed, split, s), so it is the same on any mesh and any number of processes; a process
reads only the rows it owns.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zerojax.errors import ConfigError
from zerojax.config import file_in_the_way

TRAIN, EVAL = 0, 1  # generator streams


@dataclass(frozen=True)
class Corpus:
    name: str
    train: np.ndarray  # 1-D token array
    val: np.ndarray  # 1-D token array, after `train` in the source
    vocab_size: int  # tokens the source can contain (256 for bytes)
    tokenizer: str = ""  # data.tokenizer, for decoding samples; "" = bytes


def stdlib_files() -> list[Path]:
    """Every `.py` file of this interpreter's standard library, in sorted path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in skip)
        files += [Path(folder, n) for n in sorted(names) if n.endswith(".py")]
    return files


def source_file(source: str, key: str = "data.source") -> Path:
    """The file a source names (ConfigError naming `key` if there is none)."""
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"{key}={source!r}: " + ("a directory, not a file" if path.is_dir() else "no such file"))
    return path


def text_pieces(source: str, key: str = "data.source") -> list[bytes]:
    """A text source as pieces (the stdlib's files; a .txt file's blocks of lines)."""
    if source == "stdlib":
        return [f.read_bytes() for f in stdlib_files()]
    lines = source_file(source, key).read_bytes().splitlines(keepends=True)
    return [b"".join(lines[i : i + 2000]) for i in range(0, len(lines), 2000)]


def read_tokens(source: str, tokenizer: str = "") -> tuple[np.ndarray, int]:
    """The whole token stream of a source and the size of its vocabulary."""
    if tokenizer:
        return tokenized(source, tokenizer)
    if source == "stdlib" or Path(source).suffix == ".txt":
        return np.frombuffer(b"".join(text_pieces(source)), np.uint8), 256
    path = source_file(source)
    tokens = token_array(path, source)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ConfigError(f"data.source={source!r} must hold a 1-D integer token array, got {tokens.dtype}{list(tokens.shape)}")
    if np.issubdtype(tokens.dtype, np.signedinteger) and tokens.size and tokens.min() < 0:
        raise ConfigError(f"data.source={source!r} holds negative token ids (down to {tokens.min()}); "
                          "token ids count from 0")
    return tokens, int(tokens.max()) + 1 if tokens.size else 0


def token_array(path: Path, source: str) -> np.ndarray:
    """A .bin (raw uint16, nanoGPT's format) or .npy token file, memory-mapped."""
    if path.suffix == ".bin":
        size = path.stat().st_size
        if size % 2:
            raise ConfigError(f"data.source={source!r} has {size:,} bytes, an odd number: a .bin holds raw "
                              "uint16 tokens (2 bytes each); is it a .bin of another dtype, or cut short?")
        return np.memmap(path, np.uint16, mode="r") if size else np.zeros(0, np.uint16)  # mmap refuses 0 bytes
    try:
        return np.load(path, mmap_mode="r")  # never pickles
    except (ValueError, OSError, EOFError) as err:
        raise ConfigError(f"data.source={source!r} is not a .npy array numpy can map "
                          f"({str(err).splitlines()[0][:120]})") from None


def tokenizer_file(tokenizer: str) -> Path:
    """data.tokenizer as a tokenizer.json path (a directory holding one, or the file)."""
    path = Path(tokenizer)
    path = path / "tokenizer.json" if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"data.tokenizer={tokenizer!r}: no such tokenizer.json (give the file or its directory; "
                          "`zerojax tokenizer train` makes one)")
    return path


def load_tokenizer(tokenizer: str):
    from tokenizers import Tokenizer

    path = tokenizer_file(tokenizer)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - the Rust library reports a bad file as a generic Exception
        raise ConfigError(f"data.tokenizer={tokenizer!r}: {path} is not a tokenizer.json ({str(err)[:120]})") from None


def cache_dir() -> Path:
    """Where tokenized corpora are kept: $ZEROJAX_CACHE, else ~/.cache/zerojax."""
    return Path(os.environ.get("ZEROJAX_CACHE") or Path.home() / ".cache" / "zerojax")


def tokenized(source: str, tokenizer: str) -> tuple[np.ndarray, int]:
    """A text source through a Hugging Face tokenizer, tokenized once and kept in the cache under
    the hash of the text and of the tokenizer (a change to either tokenizes again)."""
    pieces, path = text_pieces(source), tokenizer_file(tokenizer)
    digest = hashlib.sha256(path.read_bytes())
    for piece in pieces:
        digest.update(hashlib.sha256(piece).digest())
    cached = cache_dir() / "tokens" / f"{digest.hexdigest()[:32]}.npy"
    tok = load_tokenizer(tokenizer)
    if not cached.is_file():
        ids = [np.asarray(e.ids, np.uint32) for e in tok.encode_batch([p.decode("utf-8", "replace") for p in pieces])]
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f"{cached.stem}.{os.getpid()}.tmp.npy")
        np.save(tmp, np.concatenate(ids) if ids else np.zeros(0, np.uint32))
        tmp.replace(cached)  # complete or absent
    return np.load(cached, mmap_mode="r"), tok.get_vocab_size()


def train_tokenizer(source: str, vocab_size: int, out: Path) -> Path:
    """A byte-level BPE (GPT-2's pre-tokenization) trained on a text source, as out/tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ConfigError(f"--vocab-size {vocab_size} must be > 256 (the 256 bytes, plus merges)")
    in_the_way = file_in_the_way(out)
    if in_the_way or (out / "tokenizer.json").exists():
        raise ConfigError(f"--out {str(out)!r}: {in_the_way or out / 'tokenizer.json'} already exists"
                          f"{' and is not a directory' if in_the_way else ''}; give a new directory")
    pieces = text_pieces(source, "SOURCE")
    if not any(pieces):
        raise ConfigError(f"SOURCE {source!r} is empty: there is no text to learn merges from")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator((p.decode("utf-8", "replace") for p in pieces), trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"


def load_corpus(source: str, val_fraction: float, seq_len: int, tokenizer: str = "") -> Corpus:
    tokens, vocab = read_tokens(source, tokenizer)
    n_val = int(len(tokens) * val_fraction)
    train, val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]
    for split, arr in (("training", train), ("validation", val)):
        if len(arr) < seq_len + 2:
            raise ConfigError(
                f"data.source={source!r}: the {split} split has {len(arr)} tokens, fewer than "
                f"model.seq_len+2={seq_len + 2}; use a bigger corpus or a shorter model.seq_len"
            )
    return Corpus(source, train, val, vocab, tokenizer)


def row_starts(n_tokens: int, seq_len: int, seed: int, stream: int, step: int, batch: int) -> np.ndarray:
    rng = np.random.default_rng((seed, stream, step))
    return rng.integers(0, n_tokens - seq_len - 1, size=batch)


def batch_rows(tokens: np.ndarray, seq_len: int, seed: int, stream: int, step: int,
               global_batch: int, rows: slice = slice(None)) -> np.ndarray:
    """Rows `rows` of the global batch for `step`: int32 [rows, seq_len + 1] (inputs + next)."""
    starts = row_starts(len(tokens), seq_len, seed, stream, step, global_batch)[rows]
    return np.stack([np.asarray(tokens[s : s + seq_len + 1], np.int32) for s in starts])
