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

The dataset's features carry the task's text beside its tokens (`family.TASK`, the text the
data layer and `zerojax serve` read); the adapter writes π0.5's prompt from that text and the
normalized state, so the state is normalized in one place (`data.lerobot`, with the run's
data.norm_state), for training (`vla.batch.PolicyRows`) and `zerojax serve` / `rollout`
(`observation`, handed the run's tokenizer) alike. The text is never read back from the tokens:
a word-level tokenizer would lose a word it maps to <unk>. No jax here.
"""

from __future__ import annotations

import numpy as np

from zerojax.models.vla import batch as vla_batch
from zerojax.models.family import STATE, PolicyAdapter

BINS = 256


def state_bins(state_D: np.ndarray) -> np.ndarray:
    """The state's 256 bins (module docstring): np.digitize on linspace(-1, 1, 257)[:-1], minus 1."""
    return np.digitize(np.asarray(state_D), bins=np.linspace(-1, 1, BINS + 1)[:-1]) - 1


def prompt_text(task: str, state_D: np.ndarray) -> str:
    """π0.5's prompt for one row: the cleaned task and the state's bins."""
    cleaned = task.strip().replace("_", " ").replace("\n", " ")
    return f"Task: {cleaned}, State: {' '.join(map(str, state_bins(state_D)))};\nAction: "


def prompts(raw: dict, length: int, tokenizer) -> dict:
    """Each row's π0.5 tokens and mask from its task's text and its normalized state."""
    return vla_batch.prompts(raw, length, tokenizer, lambda task, row: prompt_text(task, raw[STATE][row]))


def spec(cfg, features: dict) -> dict:
    """π0.5's batch (`pi05.model.BATCH`): π0's less the state (the tokens are model.action.prompt_len long)."""
    return {k: v for k, v in vla_batch.spec(cfg, features).items() if k != "state"}


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
