"""The source protocol: what a run reads, as a batch spec and step-indexed rows.

A source (one per `data.source` kind, `KINDS`) is opened from the config and has

    vocab_size: int                          # token ids it can hold (checked against the model's)
    spec() -> pytree of Field                # the global batch: shapes [B, ...] and dtypes
    rows(split, step, rows: slice) -> pytree of numpy arrays   # rows `rows` of that batch
    run_files() -> {name: text}              # optional: files for the run directory (LeRobot: lerobot.json)

`rows` is a pure function of (seed, split, step): the same batch on any mesh and any number of
processes, each process building only the rows its devices hold (`process_rows`). Every leaf
has the batch axis first and is sharded over (replica, data); the schedules split every leaf
into microbatches the same way. Which fields a batch holds is the batch contract of
`zerojax.models.protocol`: a bare int32 [B, T+1] token array, or a dict of named fields.

`batch_spec(cfg)` gives the spec from the config alone (no file is read), so that a step can
be compiled (`zerojax analyze`) for data that is not on this machine.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from zerojax.config.data import MIXTURE, is_factory, is_lerobot, is_rows
from zerojax.data import corpus as corpus_lib
from zerojax.errors import ConfigError
from zerojax.models import registry
from zerojax.models.family import POLICY, Field  # noqa: F401 - Field: a batch spec's leaf, named here for sources


class Source(Protocol):
    vocab_size: int

    def spec(self) -> Any: ...

    def rows(self, split: int, step: int, rows: slice) -> Any: ...


# data.source kinds: name -> the module whose `spec(cfg)` and `open(cfg)` make its batches
KINDS = {"tokens": "zerojax.data.sources", "lerobot": "zerojax.data.lerobot", "images": "zerojax.data.images",
         "chat": "zerojax.data.chat", "mixture": "zerojax.data.mixture"}
ROBOT = ("lerobot", "mixture")  # the kinds of robot episodes, which a policy's adapter reads


def kind_of(cfg) -> str:
    """The kind of source a config reads: `lerobot` (data.source=lerobot:DIR, tested first: it
    looks like module:factory), `custom` (data.source=module:factory), rows (a .jsonl/.parquet
    file or a `datasets` directory: image data for a vision-language family, else chat and
    instruction rows) or a token corpus."""
    if is_lerobot(cfg.data.source):
        return "lerobot"
    if cfg.data.source == MIXTURE:  # several LeRobot datasets (data.mixture)
        return "mixture"
    if is_factory(cfg.data.source):
        return "custom"
    if is_rows(cfg.data.source):
        return "images" if registry.is_vision_language(cfg.model.family) else "chat"
    return "tokens"


def check_fits(cfg, kind: str, compile_only: bool = False) -> None:
    """ConfigError where a built-in family and the data source cannot make one batch: a policy
    reads robot episodes, the other families text or image rows. `batch_spec` asks it, and
    `open_source` for a policy, so every command that builds a step refuses before anything is
    traced (a policy's step over a text corpus would fail inside JAX's tracing); `open_source`
    still reads a dataset as it is for the other families (its own features, for tools and tests). `compile_only` (analyze, plan: the
    batch's shapes, no rows): a policy with no dataset named is compiled on its model's widest
    batch (`PolicyAdapter.widest`), which any dataset that fits pads to."""
    family, source = cfg.model.family, cfg.data.source
    policy = registry.is_policy(family)
    if policy and kind not in (*ROBOT, "custom") and not compile_only:
        raise ConfigError(f"model.family={family} is a robot policy: it trains on a LeRobot dataset (data.source="
                          f"lerobot:DIR) or a source of your own (data.source=module:factory); data.source={source!r} "
                          f"is {SOURCE_WORDS[kind]}")
    if kind in ROBOT and registry.kind(family) is not None and not policy:
        raise ConfigError(f"data.source={source!r} is a LeRobot dataset of robot episodes, which a policy family "
                          f"reads ({', '.join(registry.of_kind(POLICY))}); model.family={family} is a "
                          f"{registry.kind(family)}: give it text or image rows")


SOURCE_WORDS = {"tokens": "a text corpus", "chat": "chat or instruction rows", "images": "image-and-text rows"}


def batch_spec(cfg):
    """The global batch the config's source yields (a pytree of Field), from the config alone
    (a source of the user's own is opened to ask it). A policy family reads a LeRobot source
    through its adapter (`family.PolicyAdapter`): its own batch of the dataset's features; with
    no dataset named, of its widest one (what analyze and plan compile; training refuses)."""
    kind = kind_of(cfg)
    check_fits(cfg, kind, compile_only=True)
    if kind == "custom":
        return open_source(cfg).spec()
    adapter = registry.adapter(cfg.model.family)
    if adapter is not None and kind not in ROBOT:  # no dataset named: the model's widest batch
        return adapter.rows(_SpecOnly(adapter.widest(cfg)), cfg).spec()
    spec = importlib.import_module(KINDS[kind]).spec(cfg)
    adapter = adapter if kind in ROBOT else None
    return adapter.rows(_SpecOnly(spec), cfg).spec() if adapter is not None else spec


def features_spec(cfg) -> dict:
    """The robot data's own features (a LeRobot dataset's or a mixture's, before a policy's
    adapter), from the config and the datasets' info.json."""
    return importlib.import_module(KINDS[kind_of(cfg)]).spec(cfg)


def open_source(cfg) -> Source:
    """The config's source, opened (bad input surfaces here, as ConfigError); a policy family's
    LeRobot source through its adapter, as `batch_spec`."""
    kind = kind_of(cfg)
    if registry.is_policy(cfg.model.family):  # training a policy on text; any family still opens a dataset as it is
        check_fits(cfg, kind)
    if kind == "custom":
        return custom_source(cfg)
    source = importlib.import_module(KINDS[kind]).open(cfg)
    adapter = registry.adapter(cfg.model.family) if kind in ROBOT else None
    if adapter is not None and kind == "mixture":  # each row's missing cameras masked (data.mixture)
        return importlib.import_module(KINDS[kind]).Masked(adapter.rows(source, cfg), source)
    return adapter.rows(source, cfg) if adapter is not None else source


@dataclass(frozen=True)
class _SpecOnly:
    """A source known by its spec alone (`batch_spec` reads no file): what an adapter's spec needs."""

    features: dict
    vocab_size: int = 0

    def spec(self) -> dict:
        return self.features


def custom_source(cfg) -> Source:
    """data.source=module:factory: `factory(cfg=cfg)` returns the source (bad input if it cannot
    be imported or does not follow the protocol; a bug inside it shows its traceback)."""
    where = f"data.source={cfg.data.source}"
    source = registry.users_callable(cfg.data.source, where)(cfg=cfg)
    missing = [name for name in ("vocab_size", "spec", "rows") if not hasattr(source, name)]
    if missing:
        raise ConfigError(f"{where}: the factory returned a {type(source).__name__} without "
                          f"{', '.join(missing)} (a source has vocab_size, spec() and rows(split, step, rows))")
    return source


def process_rows(sharding, global_batch: int) -> slice:
    """The contiguous block of batch rows that this process's devices hold under `sharding`."""
    index_map = sharding.addressable_devices_indices_map((global_batch,))
    starts = sorted({idx[0].indices(global_batch)[0] for idx in index_map.values()})
    stops = sorted({idx[0].indices(global_batch)[1] for idx in index_map.values()})
    return slice(starts[0], stops[-1])


# ---------------------------------------------------------------------------------------------
# The token corpus: a bare int32 [B, T+1] batch (inputs and their successors).


def spec(cfg) -> Field:
    return Field((cfg.train.global_batch, cfg.model.seq_len + 1), "int32")


def open(cfg) -> "TokenSource":  # noqa: A001 - the kind module's protocol name
    d = cfg.data
    corpus = corpus_lib.load_corpus(d.source, d.val_fraction, cfg.model.seq_len, d.tokenizer)
    return TokenSource(corpus, cfg.model.seq_len, cfg.train.seed, cfg.train.global_batch)


@dataclass(frozen=True)
class TokenSource:
    corpus: corpus_lib.Corpus
    seq_len: int
    seed: int
    global_batch: int

    @property
    def vocab_size(self) -> int:
        return self.corpus.vocab_size

    def spec(self) -> Field:
        return Field((self.global_batch, self.seq_len + 1), "int32")

    def rows(self, split: int, step: int, rows: slice) -> np.ndarray:
        tokens = self.corpus.val if split == corpus_lib.EVAL else self.corpus.train
        return corpus_lib.batch_rows(tokens, self.seq_len, self.seed, split, step, self.global_batch, rows)
