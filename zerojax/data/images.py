"""Image data (data.source=a .jsonl or .parquet file, for a vision-language family): PaliGemma's
fine-tuning examples, processed as transformers' PaliGemmaProcessor processes them.

A dataset is a JSONL file of {"image": path relative to the file, "prefix": ..., "suffix": ...}
(big_vision's and PaliGemma's fine-tuning convention), or a Parquet file with columns image
(the encoded bytes, or Hugging Face datasets' Image struct {bytes, path}), prefix and suffix.
The last `data.val_fraction` of the examples is held out.

An example becomes one row (PaliGemmaProcessor, with SiglipImageProcessor's pixels):

    pixels  the image, alpha composited onto white, resized to image_size^2 with Pillow's bicubic,
            rescaled by 1/255 and normalized with mean 0.5, std 0.5, channels first
    tokens  n_image image tokens, BOS, the prefix, "\\n" | the suffix, EOS | padding to T+1
            (T = model.seq_len counts the image tokens); the text is tokenized with the run's
            tokenizer exactly as the processor tokenizes its two strings
    prefix     True on the inputs left of "|" (token_type_ids == 0): attended bidirectionally
    loss_mask  target t counts when token t+1 is a suffix token or the EOS

The batch for step s is a pure function of (seed, split, s): each epoch visits the examples in an
order drawn from (seed, split, epoch), so any process finds the examples of its rows without the
others, and decodes only those. Opening the source reads every example's text and checks every
image (present, and of a format Pillow can verify), so bad input stops the run before it writes.
"""

from __future__ import annotations

import functools
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from zerojax.data import corpus as corpus_lib
from zerojax.data.sources import Field
from zerojax.errors import ConfigError

# SiglipImageProcessor's normalization (IMAGENET_STANDARD_MEAN / _STD) and rescale
MEAN, STD, RESCALE = 0.5, 0.5, 1 / 255
# Where tokenizer_config.json does not name them: the names Gemma, Llama-2 / SentencePiece,
# Llama-3 and GPT-2 give their special tokens
CONVENTIONAL = {"bos": ("<bos>", "<s>", "<|begin_of_text|>"),
                "eos": ("<eos>", "</s>", "<|end_of_text|>", "<|endoftext|>"),
                "pad": ("<pad>",)}
FIELDS = ("image", "prefix", "suffix")


class Vision(NamedTuple):
    """The vision shapes the model gives the data: image side, image tokens per row, their id."""

    image_size: int
    n_image_tokens: int
    image_token_id: int


def vision_of(cfg) -> Vision:
    """The model's vision shapes (model.vision.image_size / patch_size, model.image_token_id)."""
    vision = getattr(cfg.model, "vision", None)
    size, patch = getattr(vision, "image_size", None), getattr(vision, "patch_size", None)
    token = getattr(cfg.model, "image_token_id", None)
    if size is None or patch is None or token is None:
        raise ConfigError(f"data.source={cfg.data.source!r} is image data, but model.family={cfg.model.family} "
                          "gives no model.vision.image_size, model.vision.patch_size and model.image_token_id")
    return Vision(size, (size // patch) ** 2, token)


def spec(cfg) -> dict:
    return fields(cfg.train.global_batch, cfg.model.seq_len, vision_of(cfg).image_size)


def fields(B: int, T: int, image_size: int) -> dict:
    """The batch: tokens [B, T+1], pixel_values [B, 3, H, W], prefix and loss_mask [B, T]."""
    return {"tokens": Field((B, T + 1), "int32"), "pixel_values": Field((B, 3, image_size, image_size), "float32"),
            "prefix": Field((B, T), "bool"), "loss_mask": Field((B, T), "bool")}


def open(cfg) -> "ImageSource":  # noqa: A001 - the kind module's protocol name
    d, vision = cfg.data, vision_of(cfg)
    if not d.tokenizer:
        raise ConfigError(f"data.source={d.source!r} is image data: set data.tokenizer to the model's "
                          "tokenizer.json (PaliGemma's format needs its BOS, EOS and image tokens)")
    examples = read_examples(d.source)
    n_val = int(len(examples.prefixes) * d.val_fraction)
    n_train = len(examples.prefixes) - n_val
    if not n_val or not n_train:
        raise ConfigError(f"data.source={d.source!r} has {len(examples.prefixes)} examples, and "
                          f"data.val_fraction={d.val_fraction} leaves {n_train} to train on and {n_val} to "
                          "validate on; both need at least one (add examples or change data.val_fraction)")
    text = Text.load(d.tokenizer, vision.image_token_id)
    ids = encode(text, examples.prefixes, examples.suffixes)
    for i, (first, pair) in enumerate(ids):
        check_length(len(first), len(pair), vision.n_image_tokens, cfg.model.seq_len, examples.where(i))
    for i in range(len(examples.prefixes)):
        check_image(examples, i)
    return ImageSource(examples, ids, text, vision, cfg.model.seq_len, cfg.train.seed, cfg.train.global_batch, n_train)


# ---------------------------------------------------------------------------------------------
# Pixels


def to_rgb(image):
    """transformers' convert_to_rgb: an image with alpha is composited onto white."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", image.size, (255, 255, 255, 255)), image).convert("RGB")
    return image.convert("RGB")


def pixels(image, image_size: int) -> np.ndarray:
    """SiglipImageProcessor's pixel_values of a PIL image: float32 [3, image_size, image_size]."""
    from PIL import Image

    resized = to_rgb(image).resize((image_size, image_size), Image.Resampling.BICUBIC)
    x = (np.asarray(resized).transpose(2, 0, 1).astype(np.float64) * RESCALE).astype(np.float32)
    return (x - np.float32(MEAN)) / np.float32(STD)  # transformers rescales in float64, normalizes in float32


def decode(source: bytes | Path, where: str, image_size: int) -> np.ndarray:
    """The pixel values of one encoded image (ConfigError naming `where` if Pillow cannot decode it)."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as image:
            # as transformers' load_image: the orientation a camera's EXIF tag gives
            return pixels(ImageOps.exif_transpose(image), image_size)
    except Image.DecompressionBombError as err:
        raise ConfigError(f"{where}: {too_large(err)}") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as err:
        raise ConfigError(f"{where}: cannot decode the image ({type(err).__name__}: "
                          f"{str(err).splitlines()[0][:120] if str(err) else ''}); expected a PNG, JPEG or "
                          "other image Pillow reads") from None


# ---------------------------------------------------------------------------------------------
# Text


@dataclass(frozen=True)
class Text:
    """The run's tokenizer and the special tokens PaliGemma's format needs."""

    tokenizer: object  # tokenizers.Tokenizer
    bos: str
    eos: str
    pad_id: int
    image_token_id: int

    @classmethod
    def load(cls, tokenizer: str, image_token_id: int) -> "Text":
        tok, path = corpus_lib.load_tokenizer(tokenizer), corpus_lib.tokenizer_file(tokenizer)
        named = tokenizer_config(path)
        special = {}
        for kind, names in CONVENTIONAL.items():
            given = named.get(f"{kind}_token")
            given = given.get("content") if isinstance(given, dict) else given
            special[kind] = given or next((n for n in names if tok.token_to_id(n) is not None), None)
            if special[kind] is not None and tok.token_to_id(special[kind]) is None:
                raise ConfigError(f"data.tokenizer={tokenizer!r}: {path.with_name('tokenizer_config.json')} names "
                                  f"{kind}_token {special[kind]!r}, which {path} does not hold")
        for kind in ("bos", "eos"):
            if special[kind] is None:
                raise ConfigError(f"data.tokenizer={tokenizer!r}: no {kind.upper()} token (PaliGemma's format "
                                  f"needs one): name it as {kind}_token in tokenizer_config.json beside {path}, "
                                  f"or give the tokenizer one of {', '.join(CONVENTIONAL[kind])}")
        image_id = tok.token_to_id("<image>")
        if image_id is not None and image_id != image_token_id:
            raise ConfigError(f"data.tokenizer={tokenizer!r} holds <image> as id {image_id}, but "
                              f"model.image_token_id={image_token_id}; set model.image_token_id={image_id}")
        pad = tok.token_to_id(special["pad"]) if special["pad"] else tok.token_to_id(special["eos"])
        return cls(tok, special["bos"], special["eos"], pad, image_token_id)

    @property
    def vocab_size(self) -> int:
        return max(self.tokenizer.get_vocab_size(), self.image_token_id + 1)


def tokenizer_config(path: Path) -> dict:
    """tokenizer_config.json beside a tokenizer.json ({} if there is none)."""
    config = path.with_name("tokenizer_config.json")
    if not config.is_file():
        return {}
    try:
        return json.loads(config.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(f"{config} is not JSON ({str(err)[:120]})") from None


def encode(text: Text, prefixes: list[str], suffixes: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each example's two token strings, as PaliGemmaProcessor tokenizes them: BOS, the prefix
    and "\\n" (after the image tokens, so never the first piece of a text); the suffix and EOS
    (a fresh text: the tokenizer's pair). Each comes with no post-processor tokens, as the
    processor turns its tokenizer's add_bos_token / add_eos_token off."""
    tok = text.tokenizer
    firsts = tok.encode_batch([text.bos + p + "\n" for p in prefixes], add_special_tokens=False)
    pairs = tok.encode_batch([s + text.eos for s in suffixes], add_special_tokens=False)
    bos, eos = tok.token_to_id(text.bos), tok.token_to_id(text.eos)
    if firsts and (firsts[0].ids[0] != bos or pairs[0].ids[-1] != eos):
        raise ConfigError(f"the tokenizer does not keep {text.bos} and {text.eos} whole (they must be its "
                          "special, added tokens)")
    return [(np.asarray(f.ids, np.int32), np.asarray(p.ids, np.int32)) for f, p in zip(firsts, pairs)]


def check_length(n_first: int, n_pair: int, n_image: int, seq_len: int, where: str) -> None:
    """A row holds seq_len + 1 tokens (the inputs and the last target), the image tokens first."""
    if n_first > seq_len - n_image:
        raise ConfigError(f"{where}: the prompt takes {n_first} tokens with BOS and the newline, but model.seq_len="
                          f"{seq_len} leaves {seq_len - n_image} once the {n_image} image tokens (and the answer's EOS) "
                          f"are counted; shorten the prompt or raise model.seq_len to {n_image + n_first + n_pair - 1}")
    if n_first + n_pair > seq_len + 1 - n_image:
        raise ConfigError(f"{where}: the prompt and the answer take {n_first} + {n_pair} tokens with BOS, the newline "
                          f"and EOS, but model.seq_len={seq_len} leaves {seq_len + 1 - n_image} once the {n_image} "
                          f"image tokens are counted; raise model.seq_len to {n_image + n_first + n_pair - 1}")


def text_row(first: np.ndarray, pair: np.ndarray, n_image: int, image_token_id: int, pad_id: int,
             seq_len: int) -> dict[str, np.ndarray]:
    """One example's tokens [T+1], prefix [T] and loss_mask [T] (T = seq_len)."""
    n_prefix = n_image + len(first)
    n = n_prefix + len(pair)
    tokens = np.full(seq_len + 1, pad_id, np.int32)
    tokens[:n_image], tokens[n_image:n_prefix], tokens[n_prefix:n] = image_token_id, first, pair
    position = np.arange(seq_len + 1)
    suffix = (position >= n_prefix) & (position < n)  # the suffix and EOS (token_type_ids == 1, not padding)
    return {"tokens": tokens, "prefix": position[:-1] < n_prefix, "loss_mask": suffix[1:]}


# ---------------------------------------------------------------------------------------------
# Examples: a JSONL or Parquet file's images and texts


@dataclass(frozen=True)
class Examples:
    source: str
    images: list  # per example: a Path (JSONL) or encoded bytes / a Path (Parquet), fetched by image()
    prefixes: list[str]
    suffixes: list[str]
    parquet: object = None  # the Parquet image column, read an example at a time

    def where(self, i: int) -> str:
        return f"data.source={self.source!r} " + (f"row {i}" if self.parquet is not None else f"line {i + 1}")

    def image(self, i: int) -> bytes | Path:
        if self.parquet is None:
            return self.images[i]
        value = self.parquet[i].as_py()
        if isinstance(value, dict):  # Hugging Face datasets' Image: {bytes, path}
            value = value.get("bytes") or (Path(self.source).parent / value["path"] if value.get("path") else None)
        if not isinstance(value, (bytes, Path)):
            raise ConfigError(f"{self.where(i)}: the image column holds {type(value).__name__}; expected the "
                              "image's encoded bytes (or a {bytes, path} struct)")
        return value


def read_examples(source: str) -> Examples:
    path = corpus_lib.source_file(source)
    return read_parquet(path, source) if path.suffix == ".parquet" else read_jsonl(path, source)


def read_jsonl(path: Path, source: str) -> Examples:
    images, prefixes, suffixes = [], [], []
    for k, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"data.source={source!r} line {k}"
        try:
            example = json.loads(line)
        except ValueError as err:
            raise ConfigError(f"{where} is not JSON ({err}); expected one object per line") from None
        missing = [f for f in FIELDS if not isinstance(example, dict) or f not in example]
        if missing:
            raise ConfigError(f"{where} has no {', '.join(map(repr, missing))}; expected an object of "
                              '{"image": path relative to the file, "prefix": text, "suffix": text}')
        wrong = [f for f in FIELDS if not isinstance(example[f], str)]
        if wrong:
            raise ConfigError(f"{where}: {', '.join(map(repr, wrong))} must be text, not "
                              f"{', '.join(type(example[f]).__name__ for f in wrong)}")
        images.append(path.parent / example["image"])
        prefixes.append(example["prefix"])
        suffixes.append(example["suffix"])
    return Examples(source, images, prefixes, suffixes)


def read_parquet(path: Path, source: str) -> Examples:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path, memory_map=True)
    except (pa.ArrowException, OSError) as err:
        raise ConfigError(f"data.source={source!r} is not a Parquet file pyarrow reads ({str(err)[:120]})") from None
    missing = [f for f in FIELDS if f not in table.column_names]
    if missing:
        raise ConfigError(f"data.source={source!r} has no column {', '.join(map(repr, missing))} (it has "
                          f"{', '.join(table.column_names)}); expected image (bytes), prefix and suffix")
    texts = {}
    for f in ("prefix", "suffix"):
        texts[f] = table.column(f).to_pylist()
        bad = next((i for i, t in enumerate(texts[f]) if not isinstance(t, str)), None)
        if bad is not None:
            raise ConfigError(f"data.source={source!r} row {bad}: {f} is {type(texts[f][bad]).__name__}, not text")
    return Examples(source, [], texts["prefix"], texts["suffix"], parquet=table.column("image"))


def too_large(err: Exception) -> str:
    """What Pillow's decompression-bomb guard refused, as advice (its limit: Image.MAX_IMAGE_PIXELS)."""
    from PIL import Image

    return (f"too large for Pillow to decode ({str(err).splitlines()[0][:120]}); the limit guards against "
            f"decompression bombs ({Image.MAX_IMAGE_PIXELS:,} pixels, twice that refused): downscale the image, "
            "the model sees it at model.vision.image_size anyway")


def check_image(examples: Examples, i: int) -> None:
    """The image is there and Pillow can verify it (its format and integrity, short of decoding)."""
    from PIL import Image, UnidentifiedImageError

    source, where = examples.image(i), examples.where(i)
    name = f"{str(source)!r} " if isinstance(source, Path) else ""
    if isinstance(source, Path) and not source.is_file():
        raise ConfigError(f"{where}: no image file {str(source)!r}; expected a path relative to "
                          f"{str(Path(examples.source).parent)!r}")
    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as image:
            image.verify()
    except Image.DecompressionBombError as err:
        raise ConfigError(f"{where}: the image {name}{too_large(err)}") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as err:
        raise ConfigError(f"{where}: cannot decode the image {name}"
                          f"({type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}); "
                          "expected a PNG, JPEG or other image Pillow reads") from None


# ---------------------------------------------------------------------------------------------
# The source


@functools.lru_cache(maxsize=8)
def epoch_order(n: int, seed: int, split: int, epoch: int) -> np.ndarray:
    return np.random.default_rng((seed, split, epoch)).permutation(n)


def example_indices(n: int, seed: int, split: int, step: int, global_batch: int, rows: slice) -> np.ndarray:
    """Which of a split's n examples fill rows `rows` of step `step`: the examples in an order per
    epoch, global_batch at a time."""
    at = step * global_batch + np.arange(global_batch)[rows]
    return np.array([epoch_order(n, seed, split, int(a // n))[a % n] for a in at], np.int64)


@dataclass(frozen=True)
class ImageSource:
    examples: Examples
    ids: list  # per example: (BOS, prefix, "\n") and (suffix, EOS) token ids
    text: Text
    vision: Vision
    seq_len: int
    seed: int
    global_batch: int
    n_train: int  # examples [0, n_train) train, the rest validate

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    def spec(self) -> dict:
        return fields(self.global_batch, self.seq_len, self.vision.image_size)

    def rows(self, split: int, step: int, rows: slice) -> dict:
        first, n = (self.n_train, len(self.ids) - self.n_train) if split == corpus_lib.EVAL else (0, self.n_train)
        picked = first + example_indices(n, self.seed, split, step, self.global_batch, rows)
        v = self.vision
        texts = [text_row(*self.ids[i], v.n_image_tokens, v.image_token_id, self.text.pad_id, self.seq_len)
                 for i in picked]
        batch = {k: np.stack([t[k] for t in texts]) for k in ("tokens", "prefix", "loss_mask")}
        batch["pixel_values"] = np.stack([decode(self.examples.image(i), self.examples.where(i), v.image_size)
                                          for i in picked])
        return batch
