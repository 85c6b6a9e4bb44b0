"""π0.5's batch from a robot dataset's features: its `PolicyAdapter` (`models/family.py`).

As π0's (`vla.batch`: cameras stacked, actions padded, each row's noise and time a pure function
of (seed, split, step, row)), but with no `state`: the normalized state (its real dimensions, not
padded) is put in the prompt as text, as LeRobot 0.6.1's `Pi05PrepareStateTokenizerProcessorStep`
and openpi's `PaligemmaTokenizer` (π0.5) write it:

    bins   = np.digitize(state, np.linspace(-1, 1, 257)[:-1]) - 1     (256 bins, no clipping)
    prompt = f"Task: {task}, State: {' '.join(bins)};\\nAction: "      (task: strip(), "_" and
                                                                        "\\n" -> " ")

tokenized with the run's tokenizer (data.tokenizer; bytes if none), truncated to L =
model.action.prompt_len (LeRobot's tokenizer_max_length, 200) and padded with 0 on the right.

The dataset's features carry the task as the data layer tokenized it (the task and "\\n",
`data.lerobot.prompt`); the adapter reads the text back with the same tokenizer and writes
π0.5's prompt in its place, so the state is normalized in one place (`data.lerobot`, with the
run's data.norm_state), for training (`vla.batch.PolicyRows`) and `zerojax serve` / `rollout`
(`observation`, handed the run's tokenizer) alike. The round trip is exact for bytes and for a
tokenizer that decodes plain text back (PaliGemma's SentencePiece, byte fallback); a word-level
tokenizer loses a word it maps to <unk> (LeRobot cleans "red_cube" to "red cube" before
tokenizing; here the data layer has tokenized it first). No jax here.
"""

from __future__ import annotations

import numpy as np

from zerojax.models.vla import batch as vla_batch
from zerojax.models.family import STATE, Field, PolicyAdapter

BINS = 256


def state_bins(state_D: np.ndarray) -> np.ndarray:
    """The state's 256 bins (module docstring): np.digitize on linspace(-1, 1, 257)[:-1], minus 1."""
    return np.digitize(np.asarray(state_D), bins=np.linspace(-1, 1, BINS + 1)[:-1]) - 1


def prompt_text(task: str, state_D: np.ndarray) -> str:
    """π0.5's prompt for one row: the cleaned task and the state's bins."""
    cleaned = task.strip().replace("_", " ").replace("\n", " ")
    return f"Task: {cleaned}, State: {' '.join(map(str, state_bins(state_D)))};\nAction: "


def tokenize(text: str, length: int, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """`text` tokenized (bytes if no tokenizer), truncated to `length`, padded with 0 on the right."""
    ids = tokenizer.encode(text).ids if tokenizer is not None else list(text.encode("utf-8"))
    ids = ids[:length]
    tokens, mask = np.zeros(length, np.int32), np.zeros(length, bool)
    tokens[:len(ids)], mask[:len(ids)] = ids, True
    return tokens, mask


def task_of(tokens_L: np.ndarray, mask_L: np.ndarray, tokenizer) -> str:
    """The task's text back from the features' tokens (the data layer's "task\\n")."""
    ids = [int(t) for t in np.asarray(tokens_L)[np.asarray(mask_L, bool)]]
    text = tokenizer.decode(ids) if tokenizer is not None else bytes(ids).decode("utf-8", errors="replace")
    return text


def prompts(raw: dict, length: int, tokenizer) -> dict:
    """Each row's π0.5 tokens and mask from its task tokens and its normalized state."""
    rows = [tokenize(prompt_text(task_of(t, m, tokenizer), s), length, tokenizer)
            for t, m, s in zip(raw["tokens"], raw["token_mask"], raw[STATE])]
    return {"tokens": np.stack([r[0] for r in rows]), "token_mask": np.stack([r[1] for r in rows])}


def spec(cfg, features: dict) -> dict:
    """π0.5's batch (`pi05.model.BATCH`): π0's less the state (the tokens are model.action.prompt_len long)."""
    out = {k: v for k, v in vla_batch.spec(cfg, features).items() if k != "state"}
    B, L = cfg.train.global_batch, cfg.model.action.prompt_len
    return {**out, "tokens": Field((B, L), "int32"), "token_mask": Field((B, L), "bool")}


def observation_batch(raw: dict, cameras: list[str], slots: int, length: int, tokenizer) -> dict:
    """π0.5's observation (images, image_masks, tokens, token_mask) from stacked rows of the features."""
    out = vla_batch.observation_batch(raw, cameras, slots, raw[STATE].shape[-1])
    del out["state"]
    return {**out, **prompts(raw, length, tokenizer)}


def observation(raw: dict, cameras: list[str], model: dict, tokenizer=None) -> dict:
    """The adapter's `observation` (`zerojax serve`, `rollout`): the prompt re-written with the
    state, in the tokenizer the served run's tokens were made with."""
    return observation_batch(raw, cameras, model["action"]["cameras"], model["action"]["prompt_len"], tokenizer)


ADAPTER = PolicyAdapter(check=vla_batch.check, rows=vla_batch.rows_of(spec, observation), observation=observation,
                        chunk=vla_batch.chunk, widest=vla_batch.widest)
