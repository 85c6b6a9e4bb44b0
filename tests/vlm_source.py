"""A data source of the user's own (`data.source=vlm_source:build`) that yields PaliGemma's batch:
random images and random token rows laid out as PaliGemma's processor lays them out (image
tokens, BOS, the prompt, a newline, then the answer and EOS, then padding), with the prefix
(token_type_ids == 0) and the loss mask (the answer and EOS). Only the layout is PaliGemma's:
the tokens are random, so it tests the plumbing, not learning."""

from dataclasses import dataclass

import numpy as np

from zerojax import data

BOS, EOS, NEWLINE, PAD = 2, 1, 10, 0


@dataclass(frozen=True)
class Images:
    vocab_size: int
    seq_len: int
    image_size: int
    image_tokens: int
    image_token_id: int
    seed: int
    global_batch: int

    def spec(self):
        B, T, S = self.global_batch, self.seq_len, self.image_size
        return {"tokens": data.Field((B, T + 1), "int32"), "pixel_values": data.Field((B, 3, S, S), "float32"),
                "prefix": data.Field((B, T), "bool"), "loss_mask": data.Field((B, T), "bool")}

    def rows(self, split, step, rows):
        rng = np.random.default_rng((self.seed, split, step))
        out = [self.row(rng) for _ in range(self.global_batch)][rows]
        return {k: np.stack([row[k] for row in out]) for k in out[0]}

    def row(self, rng):
        N, T = self.image_tokens, self.seq_len
        words = lambda n: rng.integers(11, self.image_token_id, n)  # never a special token nor the image token
        prompt, answer = words(int(rng.integers(1, 5))), words(int(rng.integers(1, T - N - 8)))
        text = np.concatenate([[BOS], prompt, [NEWLINE], answer, [EOS]])
        tokens = np.full(T + 1, PAD, np.int32)
        tokens[:N] = self.image_token_id
        tokens[N:N + len(text)] = text
        prefix = np.arange(T) < N + 2 + len(prompt)  # the image, BOS, the prompt and its newline
        answer_at = np.arange(1, T + 1)  # target t is token t + 1
        loss_mask = (answer_at >= N + 2 + len(prompt)) & (answer_at < N + len(text))
        pixels = rng.standard_normal((3, self.image_size, self.image_size)).astype(np.float32)
        return {"tokens": tokens, "pixel_values": pixels, "prefix": prefix, "loss_mask": loss_mask}


def build(*, cfg):
    m = cfg.model
    return Images(m.vocab_size, m.seq_len, m.vision.image_size, m.vision.image_tokens, m.image_token_id,
                  cfg.train.seed, cfg.train.global_batch)
