"""The policy families' config sections, `model.expert.*` and `model.action.*` (π0's, π0.5's and
SmolVLA's alike): frozen dataclasses that check themselves, declared to the config through the
registry (`registry.SECTIONS`), so that they live with the policies and not in the shared
ModelConfig. No jax here: the config imports them.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerojax.errors import ConfigError
from zerojax.models.family import at_least


@dataclass(frozen=True, kw_only=True)
class ExpertConfig:
    """model.expert: a policy's action expert, a decoder of the VLM's depth, heads, kv heads and
    head dim, narrower (ignored by the families that are not policies)."""

    d_model: int = 1024  # the expert's width (gemma_300m's; LeRobot's proj_width)
    d_ff: int = 4096  # the expert's MLP width

    def __post_init__(self):
        for key in ("d_model", "d_ff"):
            at_least(f"model.expert.{key}", getattr(self, key), 1)


@dataclass(frozen=True, kw_only=True)
class ActionConfig:
    """model.action: what a policy reads and predicts (LeRobot's π0 defaults; ignored by the
    families that are not policies)."""

    horizon: int = 50  # H: actions per chunk (LeRobot's chunk_size)
    max_state_dim: int = 32  # the state is zero-padded to this (state_proj's input)
    max_action_dim: int = 32  # actions are zero-padded to this (action_in_proj's input)
    action_dim: int = 0  # the real action dimensions, the loss's (0 = max_action_dim)
    cameras: int = 1  # images per row (a missing one is masked)
    prompt_len: int = 48  # prompt tokens per row (LeRobot's tokenizer_max_length)
    train_delay: int = 0  # D: training-time RTC, each row's first d ~ U{0..D} actions given clean (0 = off)
    relative: bool = False  # learn actions relative to the frame's state (openpi's DeltaActions; LeRobot's use_relative_actions)
    relative_exclude: tuple[str, ...] = ()  # with relative: joints kept absolute, by the action's names (a name within a joint's: gripper)

    def __post_init__(self):
        for key in ("horizon", "max_state_dim", "max_action_dim", "cameras", "prompt_len"):
            at_least(f"model.action.{key}", getattr(self, key), 1)
        at_least("model.action.action_dim", self.action_dim, 0)
        at_least("model.action.train_delay", self.train_delay, 0)
        if self.train_delay >= self.horizon:  # LeRobot's rule: a chunk keeps at least one action to learn
            raise ConfigError(f"model.action.train_delay={self.train_delay} must be smaller than model.action.horizon="
                              f"{self.horizon} (a row's first d <= train_delay actions are given, the rest learnt); "
                              f"lower it")
        if self.relative_exclude and not self.relative:
            raise ConfigError(f"model.action.relative_exclude={list(self.relative_exclude)} names joints to keep absolute, "
                              "but model.action.relative=false; set model.action.relative=true, or drop the exclusion")
        if self.action_dim > self.max_action_dim:
            raise ConfigError(f"model.action.action_dim={self.action_dim} is larger than model.action.max_action_dim="
                              f"{self.max_action_dim}; raise max_action_dim (the actions are padded to it)")
