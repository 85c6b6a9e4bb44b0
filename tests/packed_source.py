"""A data source of the user's own (`data.source=packed_source:build`), as one outside zerojax
would write it: random pieces of the stdlib corpus packed several to a row, with segment ids,
positions that restart per piece, and a loss mask on each piece's own next tokens. Its batch
is the dict of the language-model batch contract (zerojax.models.protocol)."""

from dataclasses import dataclass

import numpy as np

from zerojax import data


@dataclass(frozen=True)
class Packed:
    corpus: data.Corpus
    seq_len: int
    seed: int
    global_batch: int

    @property
    def vocab_size(self):
        return self.corpus.vocab_size

    def spec(self):
        B, T = self.global_batch, self.seq_len
        return {"tokens": data.Field((B, T + 1), "int32"), "loss_mask": data.Field((B, T), "bool"),
                "segment_ids": data.Field((B, T), "int32"), "positions": data.Field((B, T), "int32")}

    def rows(self, split, step, rows):
        tokens = self.corpus.val if split == data.EVAL else self.corpus.train
        rng = np.random.default_rng((self.seed, split, step))
        packed = [pack_row(tokens, self.seq_len, rng) for _ in range(self.global_batch)][rows]
        return {k: np.stack([row[k] for row in packed]) for k in packed[0]}


def pack_row(tokens, T, rng):
    """One row of T+1 tokens: pieces of 3..T/2+1 tokens one after another, then padding."""
    ids, seg = np.zeros(T + 1, np.int32), np.zeros(T + 1, np.int32)
    pos = np.zeros(T + 1, np.int32)
    at, k = 0, 0
    while at < T + 1:
        n = min(int(rng.integers(3, T // 2 + 2)), T + 1 - at)
        if n < 2 or (k and rng.random() < 0.2):  # sometimes pad the rest
            break
        start = int(rng.integers(0, len(tokens) - n))
        k += 1
        ids[at:at + n], seg[at:at + n], pos[at:at + n] = tokens[start:start + n], k, np.arange(n)
        at += n
    # target t (token t+1) counts when it continues the piece that input t belongs to
    loss_mask = (seg[:-1] == seg[1:]) & (seg[:-1] > 0)
    return {"tokens": ids, "loss_mask": loss_mask, "segment_ids": seg[:-1], "positions": pos[:-1]}


def build(*, cfg):
    d = cfg.data
    corpus = data.load_corpus("stdlib", d.val_fraction, cfg.model.seq_len)
    return Packed(corpus, cfg.model.seq_len, cfg.train.seed, cfg.train.global_batch)


def not_a_source(*, cfg):
    return object()
