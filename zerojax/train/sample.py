"""Text generation from a trained model, and the run's progress bar."""

from __future__ import annotations

import jax
import numpy as np

from zerojax.data import load_tokenizer


def sample_text(view, params, corpus, seq_len: int, seed: int, prompt: str = "def ", n_new: int = 200) -> str:
    """A short continuation of `prompt` (bytes corpora; else the validation split's first tokens)
    from the trained model, whose `logits(tokens)` method `view(params)` reaches."""
    if corpus.tokenizer:  # text through a Hugging Face tokenizer: encoded and decoded by it
        tok = load_tokenizer(corpus.tokenizer)
        ids = generate(view, params, tok.encode(prompt).ids, n_new, seq_len, seed, vocab=corpus.vocab_size)
        return tok.decode(ids)
    if corpus.vocab_size != 256:
        prompt_ids = [int(t) for t in corpus.val[:8]]
    else:
        prompt_ids = list(prompt.encode())
    ids = generate(view, params, prompt_ids, n_new, seq_len, seed, vocab=corpus.vocab_size)
    if corpus.vocab_size != 256:
        return " ".join(map(str, ids))
    return bytes(ids).decode("utf-8", errors="replace")


def generate(view, params, prompt_ids: list[int], n_new: int, seq_len: int, seed: int,
             temperature: float = 0.8, vocab: int | None = None) -> list[int]:
    """Sample `n_new` tokens after the prompt, re-running the last `seq_len` tokens each time.

    `view(params)` is the model seen through the compute view of the (sharded) master weights.
    """

    @jax.jit
    def next_token(params, window_1T, length, key):
        logits_V = view(params).logits(window_1T)[0, length - 1][:vocab]  # only tokens the corpus has
        return jax.random.categorical(key, logits_V / temperature)

    ids, key = list(prompt_ids), jax.random.key(seed)
    for _ in range(n_new):
        context = ids[-seq_len:]
        window = np.zeros((1, seq_len), np.int32)
        window[0, : len(context)] = context
        key, sub = jax.random.split(key)
        ids.append(int(next_token(params, window, len(context), sub)))
    return ids


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
