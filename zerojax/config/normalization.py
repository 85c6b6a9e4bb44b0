"""LeRobot's normalization modes, written once: `NormalizationMode` with LeRobot's names and
spelling (`lerobot.configs.types.NormalizationMode`, LeRobot 0.6.1: IDENTITY, MEAN_STD, MIN_MAX,
QUANTILES, QUANTILE10), and one table, `MODES`, from each mode to zerojax's spelling (what a
user writes in data.norm_state / data.norm_action, and what a run's lerobot.json records), the
statistics it reads and whether LeRobot 0.3.x has it.

It sits in config, the lowest part that needs it, so that config's checks, the dataset reader
(data/) and the checkpoint writers (interop/) all import it without a circle. No jax.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

from zerojax.errors import ConfigError


class NormalizationMode(str, Enum):
    """How a feature is normalized. The value is LeRobot's spelling (config.json's
    normalization_mapping, the processor files); `config` is zerojax's."""

    IDENTITY = "IDENTITY"
    MEAN_STD = "MEAN_STD"
    MIN_MAX = "MIN_MAX"
    QUANTILES = "QUANTILES"
    QUANTILE10 = "QUANTILE10"

    @property
    def config(self) -> str:
        """data.norm_*'s spelling: mean_std."""
        return MODES[self].config

    @property
    def stats(self) -> tuple[str, ...]:
        """The statistics it reads: (offset, scale) for MEAN_STD, (low, high) for the others."""
        return MODES[self].stats

    @classmethod
    def of_config(cls, name: str) -> NormalizationMode:
        """The mode data.norm_* names (ConfigError listing the valid names)."""
        for mode, spelling in MODES.items():
            if spelling.config == name:
                return mode
        raise ConfigError(f"normalization {name!r} is not one of {', '.join(CONFIG_NAMES)} (LeRobot's modes)")

    @classmethod
    def of_lerobot(cls, name: str) -> NormalizationMode | None:
        """The mode LeRobot's spelling names, None for one LeRobot 0.6.1 does not have."""
        return cls._value2member_map_.get(name)


class Spelling(NamedTuple):
    config: str  # data.norm_state / norm_action, and a run's lerobot.json "mode"
    stats: tuple[str, ...]  # the keys of stats.json it reads, as NormalizerProcessorStep reads them
    v03: bool  # LeRobot 0.3.x has it (its normalization buffers); the quantiles came with 0.4


MODES = {
    NormalizationMode.IDENTITY: Spelling("identity", (), True),
    NormalizationMode.MEAN_STD: Spelling("mean_std", ("mean", "std"), True),
    NormalizationMode.MIN_MAX: Spelling("min_max", ("min", "max"), True),
    NormalizationMode.QUANTILES: Spelling("quantiles", ("q01", "q99"), False),
    NormalizationMode.QUANTILE10: Spelling("quantile10", ("q10", "q90"), False),
}
CONFIG_NAMES = tuple(s.config for s in MODES.values())  # data.norm_*'s choices
V03_MODES = tuple(mode for mode, s in MODES.items() if s.v03)  # what LeRobot 0.3.x's π0 normalizes with
