"""Greedy answers of a vision-language run (model.family=paligemma) to its held-out examples,
and their exact match: what `zerojax generate RUN_DIR --held-out` reports.

Each answer is decoded as PaliGemma answers: the image tokens, BOS, the prompt and its newline
are the prefix (attended both ways), then one token at a time, each the argmax of the last
position's logits, attended causally, until EOS or `max_new` tokens. The rows of a batch are
left-aligned and padded at the end: a prefix never attends to the padding (it is not prefix) and
a causal position never sees a later one, so a row's answer does not depend on its neighbours.
There is no key/value cache: the answers are short, and the whole row is run again per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zerojax.data import images


@dataclass(frozen=True)
class Answer:
    prefix: str  # the question
    expected: str  # the example's suffix
    answer: str  # the greedy decoding

    @property
    def exact(self) -> bool:
        return self.answer.strip() == self.expected.strip()


def greedy(model, source: images.ImageSource, indices, max_new: int = 16, batch: int = 64,
           blank: bool = False) -> list[str]:
    """The greedy answers to examples `indices` of `source` (`blank`: every image replaced by a
    white one, the text-only baseline's input)."""
    import jax

    v, text = source.vision, source.text
    eos = text.tokenizer.token_to_id(text.eos)
    logits_of = jax.jit(model.logits)
    white = None
    answers = []
    for start in range(0, len(indices), batch):
        picked = list(indices[start:start + batch])
        rows, lengths = _prefix_rows(source, picked)
        if blank:
            white = white if white is not None else images.pixels(_white(v.image_size), v.image_size)
            pixels = np.stack([white] * len(picked))
        else:
            pixels = np.stack([images.decode(source.examples.image(i), source.examples.where(i), v.image_size)
                               for i in picked])
        out = _decode(logits_of, rows, lengths, pixels, eos, max_new)
        answers += [text.tokenizer.decode(ids, skip_special_tokens=True) for ids in out]
    return answers


def _prefix_rows(source: images.ImageSource, picked: list) -> tuple[np.ndarray, np.ndarray]:
    """(rows [B, T]: each example's image tokens and prompt, padded at the end; their lengths)."""
    v, text = source.vision, source.text
    rows = np.full((len(picked), source.seq_len), text.pad_id, np.int32)
    lengths = np.zeros(len(picked), np.int64)
    for r, i in enumerate(picked):
        first = source.ids[i][0]
        n = v.n_image_tokens + len(first)
        rows[r, :v.n_image_tokens], rows[r, v.n_image_tokens:n], lengths[r] = v.image_token_id, first, n
    return rows, lengths


def _decode(logits_of, rows: np.ndarray, lengths: np.ndarray, pixels: np.ndarray, eos: int,
            max_new: int) -> list[list[int]]:
    """Each row's answer tokens, one argmax at a time after its prefix (`lengths`), until EOS,
    `max_new` tokens or the end of the row; `rows` and `lengths` grow in place."""
    import jax.numpy as jnp

    B, T = rows.shape
    n_prefix = lengths.copy()
    done = np.zeros(B, bool)
    out: list[list[int]] = [[] for _ in range(B)]
    for _ in range(max_new):
        if done.all() or (lengths >= T).all():
            break
        types = (np.arange(T)[None, :] >= n_prefix[:, None]).astype(np.int32)
        logits = logits_of(jnp.asarray(rows), jnp.asarray(pixels), jnp.asarray(types))
        last = np.asarray(jnp.argmax(logits[np.arange(B), np.minimum(lengths, T) - 1], -1))
        for r, token in enumerate(last):
            if done[r] or lengths[r] >= T or token == eos:
                done[r] = True
                continue
            out[r].append(int(token))
            rows[r, lengths[r]] = token
            lengths[r] += 1
    return out


def _white(size: int):
    from PIL import Image

    return Image.new("RGB", (size, size), (255, 255, 255))


def held_out(run_dir: str | Path, step: int | None = None, blank: bool = False,
             limit: int = 0, max_new: int = 16) -> list[Answer]:
    """The run's greedy answers to its data source's held-out examples (the last
    data.val_fraction), from its newest checkpoint (or `step`); `limit` > 0: the first that many."""
    from zerojax import config as config_lib
    from zerojax.errors import ConfigError
    from zerojax.models import registry
    from zerojax.models.family import VISION_LANGUAGE
    from zerojax.train import export

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{str(run_dir)!r} is not a zerojax run directory (no config.yaml); --held-out answers the "
                          "held-out examples of a run's data, so give the run directory of a paligemma run")
    cfg = config_lib.load(run_dir / "config.yaml")
    if not registry.is_vision_language(cfg.model.family):
        vision_language = " or ".join(registry.of_kind(VISION_LANGUAGE))
        raise ConfigError(f"{run_dir} is a {cfg.model.family} run; held-out answers need a vision-language run "
                          f"(model.family={vision_language}) trained on image data")
    source = images.open(cfg)
    _, _, model = export.load_model(run_dir, step)
    indices = np.arange(source.n_train, len(source.ids))
    if limit > 0:
        indices = indices[:limit]
    answers = greedy(model, source, indices, max_new, blank=blank)
    return [Answer(source.examples.prefixes[i], source.examples.suffixes[i], a) for i, a in zip(indices, answers)]
