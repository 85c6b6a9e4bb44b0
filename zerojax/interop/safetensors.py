"""Safetensors read lazily and written in place, one tensor slice at a time.

`SafetensorsFile` reads with positioned reads (a slice reads only the rows it covers);
`Checkpoint` is a directory's files (one, or the shards an index names). The writer lays out a
file's header and data region first (`create_safetensors`), then fills it leaf by leaf
(`fill`), each block through a short-lived map of just its rows, so host memory holds one
block, not the model."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from zerojax.config.hf_config import safetensors_header
from zerojax.errors import ConfigError


# ---------------------------------------------------------------------------------------------
# Reading: the tensors of a directory, lazily.


READ_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16, "F64": np.float64}  # a header's dtype -> numpy


class SafetensorsFile:
    """One safetensors file read with positioned reads, not a memory map (a map's touched pages
    count as the process's memory): a slice reads only the rows it covers."""

    def __init__(self, path: Path):
        size = path.stat().st_size
        header, self.start = safetensors_header(path)
        self.metadata = header.pop("__metadata__", None) or {}  # str -> str (zerojax's export: export.py)
        self.path, self.header = path, header
        for name, entry in header.items():
            if entry["dtype"] not in READ_DTYPES:
                raise ValueError(f"tensor {name} has dtype {entry['dtype']}; zerojax reads {', '.join(READ_DTYPES)}")
            begin, end = entry["data_offsets"]
            if end - begin != math.prod(entry["shape"]) * np.dtype(READ_DTYPES[entry["dtype"]]).itemsize:
                raise ValueError(f"tensor {name}'s byte range does not match its shape")
        if self.start + max((e["data_offsets"][1] for e in header.values()), default=0) > size:
            raise ValueError("the file is shorter than its header says (truncated)")

    def read(self, name: str, index: tuple) -> np.ndarray:
        entry = self.header[name]
        shape, dtype = tuple(entry["shape"]), np.dtype(READ_DTYPES[entry["dtype"]])
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        rows = range(*index[0].indices(shape[0])) if shape else range(1)
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        with self.path.open("rb") as f:
            f.seek(self.start + entry["data_offsets"][0] + rows.start * row_bytes)
            block = np.frombuffer(f.read(len(rows) * row_bytes), dtype).reshape((len(rows),) + shape[1:])
        return np.array(block[(slice(None),) + index[1:]] if shape else block.reshape(()), np.float32)


class Checkpoint:
    """Safetensors file(s), read lazily: name -> shape, and slices on demand."""

    def __init__(self, paths: list[Path], where: str, optional_prefix: str = "", aliases: dict | None = None):
        self.files, self.shapes, self.where, self.directory = {}, {}, {}, where
        self.optional_prefix = optional_prefix  # a name may be stored without it (`resolve`)
        self.aliases = aliases or {}  # or with another prefix in place of one of these (`HfLayout.aliases`)
        for path in paths:
            try:
                handle = SafetensorsFile(path)
            except Exception as err:  # noqa: BLE001 - a bad header can fail in many ways
                raise ConfigError(f"{path} is not a readable safetensors file ({type(err).__name__}: "
                                  f"{str(err).splitlines()[0][:120] if str(err) else ''})") from None
            for key, entry in handle.header.items():
                self.shapes[key], self.where[key] = tuple(entry["shape"]), path.name
            self.files[path.name] = handle

    @classmethod
    def of_directory(cls, directory: str, optional_prefix: str = "", aliases: dict | None = None) -> "Checkpoint":
        """A Hugging Face directory's model.safetensors, or the shards its index names."""
        root = Path(directory)
        index = root / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ConfigError(f"{index} is not a safetensors index ({type(err).__name__})") from None
            missing = sorted(f for f in set(weight_map.values()) if not (root / f).is_file())
            if missing:
                raise ConfigError(f"{index} names {missing[0]}, which is not in {directory}")
            return cls([root / f for f in sorted(set(weight_map.values()))], directory, optional_prefix, aliases)
        if (root / "model.safetensors").is_file():
            return cls([root / "model.safetensors"], directory, optional_prefix, aliases)
        raise ConfigError(f"model.init_from={directory!r} has no model.safetensors nor model.safetensors.index.json")

    def resolve(self, name: str) -> str | None:
        """The name as stored, which may lack the family's optional prefix (`HfLayout.optional_prefix`)
        or hold an alias of one of its prefixes (`HfLayout.aliases`)."""
        if name in self.shapes:
            return name
        bare = name.removeprefix(self.optional_prefix) if self.optional_prefix else name
        if bare in self.shapes:
            return bare
        for written, stored in self.aliases.items():
            if name.startswith(written) and stored + name[len(written):] in self.shapes:
                return stored + name[len(written):]
        return None

    def read(self, name: str, index: tuple) -> np.ndarray:
        """The fp32 slice `index` (a tuple of slices) of tensor `name`."""
        name = self.resolve(name)
        return self.files[self.where[name]].read(name, index)


# ---------------------------------------------------------------------------------------------
# Writing: config.json, safetensors shards with HF names, the index.

SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16"}
BLOCK_BYTES = 16 * 2**20  # what a writer maps and fills at a time


class Entry(NamedTuple):
    """One tensor of a file being written: its name there, the zerojax leaf it comes from (`layer`:
    which layer of a stacked leaf, None for the whole leaf), its shape in the file, and whether it
    is the leaf's block transposed (HF's [out, in] for a zerojax [in, out] kernel)."""

    name: str
    path: str
    layer: int | None
    shape: tuple
    transposed: bool = False


def shard_plan(tensors: list[Entry], itemsize: int, max_shard_bytes: int) -> list[list[Entry]]:
    """Tensors grouped into files of at most `max_shard_bytes` (a bigger tensor alone), in order."""
    files, size = [[]], 0
    for t in tensors:
        nbytes = math.prod(t.shape) * itemsize
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(t)
        size += nbytes
    return files


def create_safetensors(path: Path, tensors: list[Entry], dtype: str, metadata: dict | None = None) -> dict:
    """A safetensors file of `tensors`, its header written (with `metadata`, str -> str, beside
    "format") and its data region allocated (zeros), to be filled by `fill`. Returns name ->
    (file, data offset)."""
    np_dtype = jnp.dtype(dtype)
    header, offset = {"__metadata__": {"format": "pt", **(metadata or {})}}, 0
    for t in tensors:
        size = math.prod(t.shape) * np_dtype.itemsize
        header[t.name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
    return {t.name: (path, 8 + len(blob) + header[t.name]["data_offsets"][0]) for t in tensors}


def _put(path: Path, offset: int, shape: tuple, dtype, index: tuple, value: np.ndarray) -> None:
    """value -> tensor[index] in the file, a few MB of rows at a time, each through its own
    short-lived map of just those rows (a map's touched pages are the process's memory until
    it is unmapped)."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    rows = range(*index[0].indices(shape[0]))
    row_bytes = math.prod(shape[1:]) * jnp.dtype(dtype).itemsize
    step = max(1, BLOCK_BYTES // max(1, row_bytes))
    for a in range(0, len(rows), step):
        r0, r1 = rows.start + a, min(rows.start + a + step, rows.stop)
        region = np.memmap(path, dtype=dtype, mode="r+", offset=offset + r0 * row_bytes, shape=(r1 - r0,) + shape[1:])
        region[(slice(None),) + index[1:]] = value[a:a + (r1 - r0)]
        region.flush()
        del region


def fill(regions: dict, tensors: list[Entry], blocks_of, dtype: str) -> None:
    """Write every tensor of `tensors` into its region (from `create_safetensors`), leaf by leaf:
    `blocks_of(path)` yields (index, fp32 block) pieces of a zerojax leaf (its true shape), and
    each piece goes to the tensor(s) it covers, transposed where HF stores [out, in]."""
    by_leaf: dict = {}
    for t in tensors:
        by_leaf.setdefault(t.path, {})[t.layer] = t
    np_dtype = jnp.dtype(dtype)
    for path, layers in by_leaf.items():
        for index, block in blocks_of(path):
            for layer, t in layers.items():
                if layer is not None and not index[0].start <= layer < index[0].stop:
                    continue
                value, inner = (block, index) if layer is None else (block[layer - index[0].start], index[1:])
                if t.transposed:  # HF's [out, in]
                    value, inner = value.T, tuple(reversed(inner))
                _put(*regions[t.name], t.shape, np_dtype, inner, value)
            del block
