"""Text generation from a trained model (`zerojax generate` and the end-of-run sample), and the
run's progress bar.

`Generator` decodes incrementally with a key/value cache: the prompt is prefilled in one call
(padded to a power of two, so prompts of similar length share one compiled shape; a prompt of
at most FED tokens goes through the one-token step instead), then one token per call; each
shape is compiled once per Generator. A model without `decode` (a model of
the user's own with only `logits`) re-runs its window of `seq_len` tokens for every token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.data import load_tokenizer


def pick(logits_V: jax.Array, key, temperature: float, top_p: float) -> jax.Array:
    """The next token: the most likely (temperature 0), or a sample at `temperature` from the
    smallest set of tokens whose probability reaches `top_p` (nucleus sampling, Holtzman et al. 2019)."""
    if temperature == 0:
        return jnp.argmax(logits_V)
    logits_V = logits_V / temperature
    if top_p < 1.0:
        order = jnp.argsort(-logits_V)
        probs = jax.nn.softmax(logits_V[order])
        keep = jnp.cumsum(probs) - probs < top_p  # tokens before this one hold less than top_p: keep it
        logits_V = jnp.full_like(logits_V, -jnp.inf).at[order].set(jnp.where(keep, logits_V[order], -jnp.inf))
    return jax.random.categorical(key, logits_V)


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    first_s: float = 0.0  # the prefill and the first token (the first prefill of a shape compiles)
    decode_s: float = 0.0  # the tokens after the second (the first step compiles)

    @property
    def tokens_per_s(self) -> float:
        return (self.new_tokens - 2) / self.decode_s if self.new_tokens > 2 and self.decode_s > 0 else 0.0


@dataclass
class Generator:
    """Generation from `view(params)`, the model (over the compute view of the master weights,
    possibly sharded, in a run; a one-device model in `zerojax generate`), in a context of
    `seq_len` tokens. `vocab`: only tokens below it are sampled (a corpus of fewer tokens than
    the model's vocabulary)."""

    view: object
    params: object
    seq_len: int
    cached: bool = True  # the model has `decode` (protocol.Units.has_decode)
    temperature: float = 0.8
    top_p: float = 1.0
    vocab: int | None = None
    _jitted: dict = field(default_factory=dict)
    _buckets: set = field(default_factory=set)  # the prefill lengths compiled
    _empty: object = None  # the shapes of an empty cache (traced once)

    def _fn(self, name):
        if name not in self._jitted:
            self._jitted[name] = jax.jit(getattr(self, f"_{name}"))
        return self._jitted[name]

    def _prefill(self, params, tokens_1P, n, key):
        logits, cache = self.view(params).decode(tokens_1P, jnp.arange(tokens_1P.shape[1])[None], self.seq_len)
        return pick(logits[0, n - 1][: self.vocab], key, self.temperature, self.top_p), cache

    def _step(self, params, token, position, cache, key):
        logits, cache = self.view(params).decode(token.reshape(1, 1), position.reshape(1, 1), cache)
        return pick(logits[0, 0][: self.vocab], key, self.temperature, self.top_p), cache

    def _window(self, params, window_1T, n, key):
        logits_V = self.view(params).logits(window_1T)[0, n - 1][: self.vocab]
        return pick(logits_V, key, self.temperature, self.top_p)

    def generate(self, prompt_ids: list[int], n_new: int, seed: int, stop: tuple[int, ...] = ()) -> tuple[list[int], Stats]:
        """The prompt and up to `n_new` tokens after it (ending early after a token of `stop`),
        and how fast. When the context fills, its last tokens are prefilled again (`_restart_keep`)."""
        if not prompt_ids:
            raise ValueError("generation needs a prompt of at least one token")
        ids, key, stats = list(prompt_ids), jax.random.key(seed), Stats(prompt_tokens=len(prompt_ids))
        cache, position, start = None, 0, time.perf_counter()  # position: the slot of the next token fed
        for i in range(n_new):
            key, sub = jax.random.split(key)
            if not self.cached:
                token = self._fn("window")(self.params, *self._padded(ids[-self.seq_len:]), sub)
            elif cache is None or position >= self.seq_len:  # the prompt, or a full context restarted
                context = ids[-self._restart_keep():] if cache is not None else ids[-self.seq_len:]
                token, cache, position = self._start(context, sub)
            else:
                token, cache = self._fn("step")(self.params, np.int32(ids[-1]), np.int32(position), cache, sub)
                position += 1
            ids.append(int(token))  # waits for the device: the token decides what comes next
            now = time.perf_counter()
            if i == 0:
                stats.first_s = now - start
            if i <= 1:
                start = now
            stats.new_tokens = i + 1
            if ids[-1] in stop:
                break
        stats.decode_s = time.perf_counter() - start
        return ids, stats

    def _start(self, context: list[int], key):
        """(the token after `context`, the cache holding it, the next slot): one padded prefill,
        or, for at most FED tokens, the one-token step fed each in turn (nothing more to compile)."""
        if len(context) > FED:
            tokens, n = self._padded(context)
            self._buckets.add(pow2(n, self.seq_len))
            token, cache = self._fn("prefill")(self.params, tokens[:, : pow2(n, self.seq_len)], n, key)
            return token, cache, n
        if self._empty is None:  # an empty cache shaped as a prefill's: traced for its shapes, never compiled
            self._empty = jax.eval_shape(self._prefill, self.params, jnp.zeros((1, 1), jnp.int32), 1, key)[1]
        cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self._empty)
        for position, t in enumerate(context):
            token, cache = self._fn("step")(self.params, np.int32(t), np.int32(position), cache, key)
        return token, cache, len(context)

    def _restart_keep(self) -> int:
        """How many of the last tokens a full context keeps, between an eighth and a half of it,
        chosen to compile nothing new (the end-of-run sample runs past its context): the longest
        prefill already compiled, else FED tokens fed through the step, else half."""
        low, high = self.seq_len // 8, self.seq_len // 2
        fits = [b for b in self._buckets if low <= b <= high]
        return max(fits, default=FED if low <= FED <= high else high)

    def _padded(self, context: list[int]) -> tuple[np.ndarray, int]:
        window = np.zeros((1, self.seq_len), np.int32)
        window[0, : len(context)] = context
        return window, len(context)


FED = 16  # a context this short is fed through the one-token step: no prefill to compile (the end-of-run sample's)


def pow2(n: int, cap: int) -> int:
    """The smallest power of two >= n (at least 16), at most `cap`: the prefill's padded length."""
    return min(cap, max(16, 1 << (n - 1).bit_length()))


def sample_text(generator: Generator, corpus, seed: int, prompt: str = "def ", n_new: int = 200) -> str:
    """The end-of-run sample: a short continuation of `prompt` (bytes corpora; else the
    validation split's first tokens) from the trained model."""
    if corpus.tokenizer:  # text through a Hugging Face tokenizer: encoded and decoded by it
        tok = load_tokenizer(corpus.tokenizer)
        return tok.decode(generator.generate(tok.encode(prompt).ids, n_new, seed)[0])
    prompt_ids = [int(t) for t in corpus.val[:8]] if corpus.vocab_size != 256 else list(prompt.encode())
    ids = generator.generate(prompt_ids, n_new, seed)[0]
    if corpus.vocab_size != 256:
        return " ".join(map(str, ids))
    return bytes(ids).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------
# `zerojax generate`: a run directory's checkpoint or a Hugging Face directory, its tokenizer,
# a prompt or a conversation.


@dataclass
class Loaded:
    model: object  # on one device, fp32
    seq_len: int  # the context: the run's model.seq_len, or config.json's max_position_embeddings
    tokenizer: str  # a tokenizer directory or file ("" = bytes)
    where: str  # what was loaded, for the user


def tokenizer_of(source: str) -> str | None:
    """The tokenizer `load_for_generation(source)` will give, read from its config files alone
    (no weights): "" for bytes, None where this cannot tell before loading (a run directory
    without its config.yaml), so that `--chat` is checked before a checkpoint is read."""
    import yaml
    from pathlib import Path

    path = Path(source)
    if (path / "config.json").is_file() and not (path / "config.yaml").is_file():
        return source if (path / "tokenizer.json").is_file() else ""
    if (path / "config.yaml").is_file():
        saved = yaml.safe_load((path / "config.yaml").read_text()) or {}
        return (saved.get("data") or {}).get("tokenizer", "")
    return None


def load_for_generation(source: str, step: int | None = None) -> Loaded:
    """RUN_DIR (its latest checkpoint, or `step`) or HF_DIR (config.json and safetensors)."""
    import json
    from pathlib import Path

    from zerojax.errors import ConfigError
    from zerojax.interop import hf
    from zerojax.train import export

    path = Path(source)
    if (path / "config.json").is_file() and not (path / "config.yaml").is_file():
        cfg, model = hf.load(source)
        hf_cfg = json.loads((path / "config.json").read_text())
        seq_len = hf_cfg.get("max_position_embeddings") or hf_cfg.get("n_positions") or cfg.seq_len
        return Loaded(model, int(seq_len), source if (path / "tokenizer.json").is_file() else "",
                      f"{source} ({cfg.family}, Hugging Face)")
    if not path.is_dir():
        raise ConfigError(f"{source!r} is not a directory; give a zerojax run directory or a Hugging Face "
                          "model directory (config.json and safetensors)")
    saved, step, model = export.load_model(path, step)
    return Loaded(model, saved["model"]["seq_len"], saved["data"].get("tokenizer", ""),
                  f"{source} (step {step}, {saved['model']['family']})")


@dataclass(frozen=True)
class ChatTokenizer:
    tok: object  # tokenizers.Tokenizer
    template: object  # data.template.ChatTemplate
    stop: tuple[int, ...]  # the template's eos_token, where the tokenizer has it


def chat_tokenizer(tokenizer: str) -> ChatTokenizer:
    """The tokenizer and its chat template, for conversations (ConfigError where it has none)."""
    from zerojax.data import template as template_lib
    from zerojax.data.corpus import tokenizer_file
    from zerojax.errors import ConfigError

    if not tokenizer:
        raise ConfigError("--chat needs a tokenizer with a chat template; this model reads bytes (no data.tokenizer)")
    folder = tokenizer_file(tokenizer).parent
    template = template_lib.load_template(folder, template_lib.tokenizer_config(folder))
    if template is None:
        raise ConfigError(f"--chat: the tokenizer in {folder} has no chat template (no chat_template.jinja, no "
                          "chat_template in tokenizer_config.json); use --prompt TEXT")
    tok = load_tokenizer(tokenizer)
    eos = template.specials.get("eos_token")
    return ChatTokenizer(tok, template, () if eos is None or tok.token_to_id(eos) is None else (tok.token_to_id(eos),))


def reply(generator: Generator, chat: ChatTokenizer, messages: list[dict], n_new: int, seed: int):
    """The assistant's next turn: (text, Stats), the conversation rendered with the generation
    prompt and tokenized as transformers' apply_chat_template does, decoded to the stop token."""
    from zerojax.data.template import TemplateError
    from zerojax.errors import ConfigError

    try:
        text, _ = chat.template.render(messages, add_generation_prompt=True)
    except TemplateError as err:
        raise ConfigError(f"the chat template ({chat.template.where}) refused the conversation: {err}") from None
    prompt = chat.tok.encode(text, add_special_tokens=False).ids
    ids, stats = generator.generate(prompt, n_new, seed, chat.stop)
    new = ids[len(prompt):]
    return chat.tok.decode(new[:-1] if new and new[-1] in chat.stop else new), stats


def chat_turns(generator: Generator, tokenizer: str, lines, n_new: int, seed: int):
    """A conversation: each line a user turn; yields (reply, Stats) for each, the whole
    conversation prefilled again each turn."""
    chat = chat_tokenizer(tokenizer)
    messages: list[dict] = []
    for line in lines:
        messages.append({"role": "user", "content": line.rstrip("\n")})
        text, stats = reply(generator, chat, messages, n_new, seed)
        messages.append({"role": "assistant", "content": text})
        yield text, stats


def sample_reply(generator: Generator, source, seed: int, n_new: int = 64) -> str:
    """The end-of-run sample of a chat source: the model's reply to the opening of its last
    conversation (`source.sample_messages`), through the chat template."""
    return reply(generator, chat_tokenizer(source.tokenizer), list(source.sample_messages), n_new, seed)[0]


def continuation(generator: Generator, tokenizer: str, prompt: str, n_new: int, seed: int) -> tuple[str, Stats]:
    """The text after `prompt` (through the tokenizer, with its BOS; else as bytes)."""
    if not tokenizer:
        ids, stats = generator.generate(list(prompt.encode()), n_new, seed)
        return bytes(ids[len(prompt.encode()):]).decode("utf-8", errors="replace"), stats
    tok = load_tokenizer(tokenizer)
    prompt_ids = tok.encode(prompt).ids
    ids, stats = generator.generate(prompt_ids, n_new, seed)
    return tok.decode(ids[len(prompt_ids):]), stats


class Progress:
    """A rich progress bar with step, loss, eval loss and tokens/s (silent when disabled)."""

    def __init__(self, total: int, enabled: bool, start: int = 0):
        self.total, self.enabled, self.start = total, enabled, start

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeRemainingColumn
            self.bar = Bar(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("loss {task.fields[loss]}  eval {task.fields[eval]}  {task.fields[tps]} tok/s"),
                           TimeRemainingColumn())
            self.bar.__enter__()
            self.task = self.bar.add_task("train", total=self.total, completed=self.start, loss="-", eval="-", tps="-")
        return self

    def update(self, step: int, line: dict | None = None):
        if not self.enabled:
            return
        fields = {}
        if line:
            fields = {"loss": f"{line['loss']:.3f}", "tps": f"{line['tokens_per_sec']:,.0f}"}
            if "eval_loss" in line:
                fields["eval"] = f"{line['eval_loss']:.3f}"
        self.bar.update(self.task, completed=step, **fields)

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.__exit__(*exc)
