"""Conversation and instruction data: `data.source=FILE.jsonl | FILE.parquet | DIR` (a Hugging
Face `datasets` directory written by save_to_disk), a row an example.

A row is one of

    {"messages": [{"role": ..., "content": ...}, ...]}   HF's and OpenAI's chat format, rendered
                                                         by the tokenizer's own chat template
    {"prompt": ..., "completion": ...}                   the prompt, then the completion and EOS
    {"text": ...}                                        plain text (with the tokenizer's BOS, and EOS)

Each example is its token ids and which of them the loss counts (`data.train_on=assistant`:
what the assistant writes, from the template's `{% generation %}` blocks, or else from rendering
the conversation turn by turn; the completion; all of a text; `all`: every token). Examples are
packed several to a row (`data.pack=true`, first fit in a seeded order) with segment ids and
positions that restart per example, so that attention never crosses an example (the batch
contract of `zerojax.models.protocol`). The last `data.val_fraction` of the rows is held out
(or `data.val_source` holds the evaluation rows).
Row r of step s's batch is packed row order[(s*B + r) mod N] of a permutation drawn per epoch
from (seed, split, epoch): every packed row once an epoch, the same on any mesh.

Bad input (a line that is not JSON, a row of no accepted form, a role the template refuses,
messages without a chat template, an example over model.seq_len + 1 tokens under
data.too_long=error) is a ConfigError naming the file and the row, raised when the source opens.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zerojax.data import corpus as corpus_lib
from zerojax.data.sources import Field
from zerojax.data import template as template_lib
from zerojax.data.template import ChatTemplate, TemplateError
from zerojax.errors import ConfigError

log = logging.getLogger("zerojax")

FORMS = '{"messages": [...]}, {"prompt", "completion"} or {"text"}'


def spec(cfg) -> dict:
    """The batch of a row source, from the config alone: the language-model batch contract."""
    return fields(cfg.train.global_batch, cfg.model.seq_len)


def fields(B: int, T: int) -> dict:
    return {"tokens": Field((B, T + 1), "int32"), "loss_mask": Field((B, T), "bool"),
            "segment_ids": Field((B, T), "int32"), "positions": Field((B, T), "int32")}


def open(cfg) -> "ChatSource":  # noqa: A001 - the kind module's protocol name
    d = cfg.data
    encoder = Encoder.of(d.tokenizer, d.train_on)
    rows, examples = encoded(d.source, "data.source", encoder, cfg)
    if d.val_source:  # held-out rows of their own
        val_examples = encoded(d.val_source, "data.val_source", encoder, cfg)[1]
    else:
        n_val = max(1, int(len(examples) * d.val_fraction))
        if len(examples) - n_val < 1:
            raise ConfigError(f"data.source={d.source!r}: {len(examples)} example(s) leave none to train on after "
                              f"data.val_fraction={d.val_fraction} holds out {n_val}; give more rows")
        examples, val_examples = examples[:-n_val], examples[-n_val:]
    T1 = cfg.model.seq_len + 1
    train = pack(examples, T1, d.pack, cfg.train.seed)
    val = pack(val_examples, T1, d.pack, cfg.train.seed)
    check_counted(train, len(examples), f"data.source={d.source!r}", d.train_on)
    check_counted(val, len(val_examples), f"data.val_source={d.val_source!r}" if d.val_source else
                  f"data.source={d.source!r}'s held-out rows (data.val_fraction={d.val_fraction})", d.train_on)
    return ChatSource(train, val, encoder.vocab_size, cfg.model.seq_len, cfg.train.seed, cfg.train.global_batch,
                      d.tokenizer, encoder.template, opening(rows) if encoder.template else None)


def check_counted(packed: "Packed", n: int, where: str, train_on: str) -> None:
    """ConfigError when no target of `packed` counts in the loss: a run on it would divide zero
    by zero at every step (loss NaN) and save an untrained model as if it had learnt."""
    if not packed.loss_mask.any():
        why = ("no row has an assistant turn or a completion; give conversations with assistant messages, or "
               "set data.train_on=all") if train_on == "assistant" else "every example is a single token"
        raise ConfigError(f"{where}: none of its {n} example(s) has a token the loss counts (data.train_on="
                          f"{train_on}): {why}")


def encoded(source: str, key: str, encoder: "Encoder", cfg) -> tuple[list, list["Example"]]:
    """(the rows of a file, their examples that fit model.seq_len)."""
    rows = read_rows(source, key)
    examples = [encoder.encode(row, f"{key}={source!r} row {n}") for n, row in rows]
    return rows, fitting(examples, [n for n, _ in rows], cfg.model.seq_len, cfg.data.too_long, source, key)


def opening(rows: list[tuple[int, dict]]) -> tuple | None:
    """The last conversation's turns before its first assistant turn (the end-of-run sample's
    prompt), or None when no row holds one."""
    for _, row in reversed(rows):
        messages = row.get("messages") if isinstance(row, dict) else None
        first = next((i for i, m in enumerate(messages or []) if m.get("role") == "assistant"), 0)
        if first:
            return tuple(messages[:first])
    return None


# ---------------------------------------------------------------------------------------------
# Rows


def read_rows(source: str, key: str = "data.source") -> list[tuple[int, dict]]:
    """(row number, row) of a .jsonl (numbered by line, blank lines skipped) or .parquet file."""
    where = f"{key}={source!r}"
    if Path(source, "state.json").is_file():
        rows = list(enumerate(saved_dataset(Path(source), where), start=1))
        if not rows:
            raise ConfigError(f"{where}: no rows; each row is {FORMS}")
        return rows
    path = corpus_lib.source_file(source, key)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as err:  # noqa: BLE001 - pyarrow reports a bad file with several exception types
            raise ConfigError(f"{where}: not a Parquet file pyarrow can read ({str(err).splitlines()[0][:160]})") from None
        rows = list(enumerate(table.to_pylist(), start=1))
    else:
        rows = []
        with path.open("rb") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append((n, json.loads(line)))
                except (json.JSONDecodeError, UnicodeDecodeError) as err:
                    raise ConfigError(f"{where} line {n}: not JSON ({err}); each line is one row, {FORMS}") from None
    if not rows:
        raise ConfigError(f"{where}: no rows; each row is {FORMS}")
    return rows


def saved_dataset(folder: Path, where: str) -> list[dict]:
    """The rows of a Hugging Face `datasets` directory written by `Dataset.save_to_disk`: the
    Arrow stream files its state.json lists, in order."""
    import pyarrow as pa

    try:
        files = [f["filename"] for f in json.loads((folder / "state.json").read_text())["_data_files"]]
        return [row for name in files for row in pa.ipc.open_stream(folder / name).read_all().to_pylist()]
    except (OSError, KeyError, TypeError, json.JSONDecodeError, pa.ArrowInvalid) as err:
        raise ConfigError(f"{where}: not a `datasets` directory pyarrow can read ({type(err).__name__}: "
                          f"{str(err).splitlines()[0][:160] if str(err) else ''})") from None


# ---------------------------------------------------------------------------------------------
# Examples: token ids, and which of them the loss counts


@dataclass(frozen=True)
class Example:
    ids: np.ndarray  # int32 [n]
    counts: np.ndarray  # bool [n]: token i is a target the loss counts (it is predicted from token i-1)


@dataclass(frozen=True)
class Encoder:
    """Rows to examples, through data.tokenizer (None: bytes) and its chat template (None: none)."""

    tokenizer: object | None
    template: ChatTemplate | None
    eos_id: int | None
    train_on: str
    tokenizer_name: str

    @classmethod
    def of(cls, tokenizer: str, train_on: str) -> "Encoder":
        if not tokenizer:
            return cls(None, None, None, train_on, "")
        tok, folder = corpus_lib.load_tokenizer(tokenizer), corpus_lib.tokenizer_file(tokenizer).parent
        config = template_lib.tokenizer_config(folder)
        eos = template_lib.special_tokens(config).get("eos_token")
        eos_id = None if eos is None else tok.token_to_id(eos)
        return cls(tok, template_lib.load_template(folder, config), eos_id, train_on, tokenizer)

    @property
    def vocab_size(self) -> int:
        return 256 if self.tokenizer is None else self.tokenizer.get_vocab_size()

    def encode(self, row, where: str) -> Example:
        if isinstance(row, dict) and row.get("messages") is not None:
            ids, counts = self.conversation(row["messages"], where)
        elif isinstance(row, dict) and row.get("prompt") is not None and row.get("completion") is not None:
            prompt, completion = text_field(row, "prompt", where), text_field(row, "completion", where)
            head, tail = self.ids(prompt, True), self.ids(completion, False) + self.eos()
            ids, counts = head + tail, [False] * len(head) + [True] * len(tail)
        elif isinstance(row, dict) and row.get("text") is not None:
            ids = self.ids(text_field(row, "text", where), True) + self.eos()
            counts = [True] * len(ids)
        else:
            has = f"it has {', '.join(map(repr, row))}" if isinstance(row, dict) else f"it is a {type(row).__name__}"
            raise ConfigError(f"{where}: expected {FORMS} ({has})")
        counts = np.ones(len(ids), bool) if self.train_on == "all" else np.asarray(counts, bool)
        return Example(np.asarray(ids, np.int32), counts)

    def ids(self, text: str, special: bool) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def eos(self) -> list[int]:
        return [] if self.eos_id is None else [self.eos_id]

    def conversation(self, messages, where: str) -> tuple[list[int], list[bool]]:
        """The template's rendering, tokenized as transformers does (no special tokens added: the
        template writes them), and the tokens overlapping the assistant's spans."""
        check_messages(messages, where)
        if self.template is None:
            raise ConfigError(f"{where}: messages need a chat template, and "
                              + (f"data.tokenizer={self.tokenizer_name!r} has none (no chat_template.jinja, no "
                                 "chat_template in tokenizer_config.json)" if self.tokenizer is not None else
                                 "data.tokenizer is empty; give a tokenizer directory with a chat template"))
        text, spans = render(self.template, messages, where)
        if not self.template.has_generation and self.train_on == "assistant":
            spans = turn_spans(self.template, messages, text, where)
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        return enc.ids, span_mask(enc.offsets, spans)


def text_field(row: dict, key: str, where: str) -> str:
    if not isinstance(row[key], str):
        raise ConfigError(f"{where}: {key!r} must be a string, got {type(row[key]).__name__}")
    return row[key]


def check_messages(messages, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: 'messages' must be a non-empty list of {{\"role\", \"content\"}}")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ConfigError(f"{where}: message {i} must be {{\"role\": str, \"content\": str}}, got {m!r:.120}")


def render(template: ChatTemplate, messages, where: str, add_generation_prompt: bool = False):
    try:
        return template.render(messages, add_generation_prompt)
    except TemplateError as err:
        raise ConfigError(f"{where}: the chat template ({template.where}) refused the conversation: {err}") from None


def turn_spans(template: ChatTemplate, messages: list, text: str, where: str) -> list[tuple[int, int]]:
    """The assistant's spans of a template without `{% generation %}`: for each assistant turn,
    what rendering it adds to the conversation before it with the generation prompt."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, _ = render(template, messages[:i], where, add_generation_prompt=True) if i else ("", [])
        upto, _ = render(template, messages[: i + 1], where)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise ConfigError(f"{where}: the chat template ({template.where}) does not render this conversation "
                              f"turn by turn, so the assistant's tokens cannot be told apart; add "
                              "{% generation %} blocks to it, or set data.train_on=all")
        spans.append((len(before), len(upto)))
    return spans


def span_mask(offsets, spans) -> list[bool]:
    """Tokens whose characters overlap a span: transformers' `assistant_masks` (one pass, both in order)."""
    mask, at = [False] * len(offsets), 0
    for i, (start, end) in enumerate(offsets):
        while at < len(spans) and start >= spans[at][1]:
            at += 1
        if at == len(spans):
            break
        mask[i] = end > spans[at][0]
    return mask


def fitting(examples: list[Example], numbers: list[int], seq_len: int, too_long: str, source: str,
            key: str = "data.source") -> list[Example]:
    """The examples of at most seq_len + 1 tokens (seq_len inputs and their targets)."""
    long = [(len(e.ids), n) for e, n in zip(examples, numbers) if len(e.ids) > seq_len + 1]
    if not long:
        return examples
    size, row = max(long)
    what = (f"{key}={source!r}: {len(long)} of {len(examples)} examples are longer than model.seq_len + 1 = "
            f"{seq_len + 1} tokens (the longest, row {row}, has {size})")
    if too_long == "error":
        raise ConfigError(f"{what}; raise model.seq_len, or set data.too_long=drop to leave them out")
    kept = [e for e in examples if len(e.ids) <= seq_len + 1]
    if not kept:
        raise ConfigError(f"{what}, and that is all of them; raise model.seq_len")
    log.warning("%s: dropped (data.too_long=drop)", what)
    return kept


# ---------------------------------------------------------------------------------------------
# Packing and batches


@dataclass(frozen=True)
class Packed:
    """Rows of the batch contract, [N, T+1] tokens and [N, T] the rest; `pad_fraction` the share
    of input slots that hold no example."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray

    @property
    def pad_fraction(self) -> float:
        return float((self.segment_ids == 0).mean())

    def __len__(self) -> int:
        return len(self.tokens)


OPEN_ROWS = 64  # rows still taking examples while packing (first fit among them: O(examples x 64))


def pack(examples: list[Example], T1: int, several: bool, seed: int) -> Packed:
    """Examples into rows of T1 tokens: in a seeded order, each into the first of the last
    OPEN_ROWS rows with room for it, else a new row (several=True); or one a row."""
    order = np.random.default_rng((seed, 7)).permutation(len(examples)) if several else range(len(examples))
    rows: list[list[Example]] = []
    open_rows: list[list] = []  # [row index, free tokens]
    for i in order:
        e = examples[i]
        fit = next((o for o in open_rows if o[1] >= len(e.ids)), None) if several else None
        if fit is None:
            rows.append([])
            fit = [len(rows) - 1, T1]
            open_rows = [*open_rows[-(OPEN_ROWS - 1):], fit]
        rows[fit[0]].append(e)
        fit[1] -= len(e.ids)
    tokens, seg, pos, counts = (np.zeros((len(rows), T1), dt) for dt in (np.int32, np.int32, np.int32, bool))
    for r, row in enumerate(rows):
        at = 0
        for k, e in enumerate(row, start=1):
            n = len(e.ids)
            tokens[r, at:at + n], seg[r, at:at + n], pos[r, at:at + n] = e.ids, k, np.arange(n)
            counts[r, at:at + n] = e.counts
            at += n
    # target t (token t+1) counts when it continues input t's example and the example counts it
    loss_mask = (seg[:, :-1] == seg[:, 1:]) & (seg[:, :-1] > 0) & counts[:, 1:]
    return Packed(tokens, loss_mask, seg[:, :-1], pos[:, :-1])


@dataclass(frozen=True)
class ChatSource:
    train: Packed
    val: Packed
    vocab_size: int
    seq_len: int
    seed: int
    global_batch: int
    tokenizer: str  # data.tokenizer ("" = bytes)
    template: ChatTemplate | None
    sample_messages: tuple | None = None  # a conversation's opening, for the end-of-run sample

    def spec(self) -> dict:
        return fields(self.global_batch, self.seq_len)

    def rows(self, split: int, step: int, rows: slice) -> dict:
        packed = self.val if split == corpus_lib.EVAL else self.train
        index = row_indices(len(packed), self.seed, split, step, self.global_batch)[rows]
        return {"tokens": packed.tokens[index], "loss_mask": packed.loss_mask[index],
                "segment_ids": packed.segment_ids[index], "positions": packed.positions[index]}


def row_indices(n: int, seed: int, split: int, step: int, batch: int) -> np.ndarray:
    """The packed rows of step `step`'s batch: slots step*B .. step*B + B - 1 of the epochs'
    permutations (each from (seed, split, epoch))."""
    slots = np.arange(step * batch, (step + 1) * batch)
    out = np.empty(batch, np.int64)
    for epoch in np.unique(slots // n):
        here = slots // n == epoch
        out[here] = np.random.default_rng((seed, split, int(epoch))).permutation(n)[slots[here] % n]
    return out
