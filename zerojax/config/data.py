"""The data section, `data.*` (docs/design.md §5): where a run's rows come from (`DataConfig`),
the kinds of source data.source names (text, rows, a LeRobot dataset, a mixture of them, a
user's factory), and the image augmentation's sub-sections. Split from `sections` by concept: the
data keys are the largest section, and the readers in `zerojax.data` ask these predicates.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from zerojax.config.normalization import CONFIG_NAMES
from zerojax.config.rules import AUGMENTS, IDLE_ACTIONS, _at_least, _choice, _finite
from zerojax.errors import ConfigError


def is_factory(source: str) -> bool:
    """data.source names a function of the user's, `module:factory`, rather than a file."""
    return re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", source) is not None


def is_lerobot(source: str) -> bool:
    """data.source=lerobot:DIR names a LeRobot dataset (tested before `is_factory`, which the
    same text would match)."""
    return source.startswith("lerobot:")


MIXTURE = "mixture"  # data.source=mixture: several LeRobot datasets, data.mixture's (zerojax.data.mixture)


def is_robot_data(source: str) -> bool:
    """data.source reads robot episodes: one LeRobot dataset (lerobot:DIR) or a mixture of them."""
    return is_lerobot(source) or source == MIXTURE


TRAIN_ON = ("assistant", "all")  # data.train_on: the tokens a chat source's loss counts
TOO_LONG = ("error", "drop")  # data.too_long: what a chat source does with an example over model.seq_len
ROW_SUFFIXES = (".jsonl", ".parquet")  # sources of rows (zerojax.data.chat; a vision family's: images)


def is_rows(source: str) -> bool:
    """data.source holds rows: a .jsonl/.parquet file, or a Hugging Face `datasets` directory
    written by save_to_disk (its state.json lists the Arrow files)."""
    return Path(source).suffix in ROW_SUFFIXES or Path(source, "state.json").is_file()


@dataclass(frozen=True, kw_only=True)
class OpenpiAugmentConfig:
    """data.openpi_augment: data.augment=openpi's parameters, openpi's `preprocess_observation`
    (augmax's transforms; zerojax.data.augment)."""

    crop_scale: float = 0.95  # cameras not named wrist: a random crop of this share of each side, resized back
    rotate_degrees: float = 5.0  # cameras not named wrist: then a rotation of up to this many degrees either way
    brightness: float = 0.3  # every camera: augmax.ColorJitter's brightness (an amount in [-x, x])
    contrast: float = 0.4  # ColorJitter's contrast
    saturation: float = 0.5  # ColorJitter's saturation (augmax 0.4.1 draws it and discards it, so it changes nothing)
    hue: float = 0.1  # ColorJitter's hue: augmax's default, which openpi leaves as it is
    jitter_p: float = 0.5  # the chance that ColorJitter applies at all: augmax's default, which openpi leaves too

    def __post_init__(self):
        _finite("data.openpi_augment.crop_scale", self.crop_scale, 0, above=True, high=1)
        _finite("data.openpi_augment.rotate_degrees", self.rotate_degrees, 0, high=180)
        for key in ("brightness", "contrast", "saturation", "hue"):
            _finite(f"data.openpi_augment.{key}", getattr(self, key), 0, high=1)
        _finite("data.openpi_augment.jitter_p", self.jitter_p, 0, high=1)


@dataclass(frozen=True, kw_only=True)
class LeRobotAugmentConfig:
    """data.lerobot_augment: data.augment=lerobot's parameters, LeRobot 0.6.1's
    `ImageTransformsConfig` defaults (torchvision's transforms; zerojax.data.augment). Each colour
    factor is drawn from [1 - x, 1 + x], as torchvision reads one number."""

    brightness: float = 0.2  # ColorJitter(brightness=(0.8, 1.2))
    contrast: float = 0.2  # ColorJitter(contrast=(0.8, 1.2))
    saturation: float = 0.5  # ColorJitter(saturation=(0.5, 1.5))
    hue: float = 0.05  # ColorJitter(hue=(-0.05, 0.05)): a shift of the hue in [-x, x] turns
    sharpness: float = 0.5  # SharpnessJitter(sharpness=(0.5, 1.5))
    degrees: float = 5.0  # RandomAffine(degrees=(-5, 5)), nearest-neighbour, zero fill
    translate: float = 0.05  # RandomAffine(translate=(0.05, 0.05)): a shift of up to this share of each side
    max_num_transforms: int = 3  # how many of the six (each of weight 1) each image gets, in the order above

    def __post_init__(self):
        for key in ("brightness", "contrast", "saturation", "sharpness"):
            _finite(f"data.lerobot_augment.{key}", getattr(self, key), 0, high=1)
        _finite("data.lerobot_augment.hue", self.hue, 0, high=0.5)
        _finite("data.lerobot_augment.degrees", self.degrees, 0, high=180)
        _finite("data.lerobot_augment.translate", self.translate, 0, high=1)
        if not 1 <= self.max_num_transforms <= 6:
            raise ConfigError(f"data.lerobot_augment.max_num_transforms={self.max_num_transforms} is not valid; "
                              "it must be in [1, 6] (LeRobot's six transforms)")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    source: str = "stdlib"  # stdlib (Python's own sources, bytes) | a .txt file | a .bin/.npy token file
    #                         | rows: a .jsonl/.parquet file or a Hugging Face `datasets` directory (save_to_disk):
    #                           images and text for a vision-language family (zerojax.data.images), else
    #                           messages, prompt+completion or text (zerojax.data.chat)
    #                         | lerobot:DIR (a LeRobot v3.0 or v2.1 dataset: zerojax.data.lerobot)
    #                         | mixture (several LeRobot datasets with sampling weights: data.mixture)
    #                         | module:factory (a source of your own: zerojax.data.sources)
    val_fraction: float = 0.1  # tail of the corpus (of a row source: of its rows; LeRobot: episodes) held out for evaluation
    val_source: str = ""  # rows: evaluation rows of their own (as data.source) instead of data.source's tail
    tokenizer: str = ""  # a Hugging Face tokenizer.json (or its directory) for a text source; empty = bytes
    train_on: str = "assistant"  # chat rows: the loss counts the assistant's turns and completions | all (every token)
    pack: bool = True  # chat rows: several examples to a row, never attending across (false: one a row, padded)
    too_long: str = "error"  # chat rows: an example over model.seq_len + 1 tokens is an error (exit 2) | drop (counted)
    # data.source=lerobot:DIR (zerojax.data.lerobot); a policy family's three shapes are its model's
    # (config.policy_keys: set from them, a contradiction is an error); these defaults are for other models
    action_horizon: int = 50  # actions per chunk: the frame's and the next H-1 (a policy: model.action.horizon)
    image_size: int = 224  # camera frames resized with padding to image_size x image_size, in [-1, 1] (a policy: model.vision.image_size)
    prompt_len: int = 48  # the task prompt's tokens, truncated or padded (a policy: model.action.prompt_len)
    norm_state: str = "mean_std"  # observation.state from meta/stats.json: identity | mean_std | min_max | quantiles | quantile10
    norm_action: str = "mean_std"  # action, likewise (LeRobot's pi05: quantiles for both)
    cameras: tuple[str, ...] = ()  # observation.images.<camera> to read; empty = every camera of the dataset
    mixture: tuple[tuple[str, float], ...] = ()  # data.source=mixture: {LeRobot dataset DIR: sampling weight} (YAML: a mapping; DIR:W,DIR:W)
    filter_idle: float = 0.0  # drop training frames whose chunk's first half moves <= this, in the data's units (openpi's DROID rule: 1e-3); 0 = keep all
    filter_idle_actions: str = "position"  # data.filter_idle's actions: position (moves from the frame's action) | velocity (|action|)
    augment: str = "none"  # none | openpi | lerobot: the training images augmented in the train step (zerojax.data.augment)
    wrist_cameras: tuple[str, ...] = ()  # data.augment=openpi: cameras with no crop or rotation; empty = those named *wrist* (openpi's rule)
    openpi_augment: OpenpiAugmentConfig = field(default_factory=OpenpiAugmentConfig)  # data.augment=openpi's parameters
    lerobot_augment: LeRobotAugmentConfig = field(default_factory=LeRobotAugmentConfig)  # data.augment=lerobot's parameters

    @property
    def robot(self) -> bool:
        """data.source reads robot episodes (`is_robot_data`)."""
        return is_robot_data(self.source)

    def __post_init__(self):
        _choice("data.augment", self.augment, AUGMENTS)
        object.__setattr__(self, "mixture", tuple(self.mixture.items()) if isinstance(self.mixture, dict)
                           else tuple(map(tuple, self.mixture)))  # a mapping from Python or a saved config: pairs
        if self.mixture and self.source != MIXTURE:
            raise ConfigError(f"data.mixture is set but data.source={self.source!r}; set data.source=mixture to "
                              "train on the mixture's datasets, or leave data.mixture empty")
        if is_robot_data(self.source):
            return _check_lerobot(self)
        if self.filter_idle:
            raise ConfigError(f"data.filter_idle={self.filter_idle} drops a robot dataset's idle frames: it needs "
                              f"data.source=lerobot:DIR, not {self.source!r}; or data.filter_idle=0")
        if self.augment != "none":
            raise ConfigError(f"data.augment={self.augment} augments a robot policy's camera images: it needs "
                              f"data.source=lerobot:DIR (a LeRobot dataset), not {self.source!r}; or data.augment=none")
        suffix, rows = Path(self.source).suffix, is_rows(self.source)
        if (self.source != "stdlib" and suffix not in (".txt", ".bin", ".npy") and not rows
                and not is_factory(self.source)):
            raise ConfigError(
                f"data.source={self.source!r} is not valid; use 'stdlib', a .txt file, a .bin/.npy token file, "
                "rows (a .jsonl/.parquet file or a `datasets` save_to_disk directory), lerobot:DIR (a LeRobot "
                "dataset), or module:factory (a source of your own)"
            )
        if (self.tokenizer and self.source != "stdlib" and suffix != ".txt" and not rows
                and not is_factory(self.source)):
            raise ConfigError(f"data.tokenizer applies to text (data.source=stdlib, a .txt or a .jsonl/.parquet "
                              f"file); data.source={self.source!r} already holds tokens")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={self.val_fraction} must be between 0 and 1, both excluded (the share "
                              f"of the data held out for validation; only a lerobot: source may hold out none)")
        if self.val_source and not (rows and is_rows(self.val_source)):
            raise ConfigError(f"data.val_source={self.val_source!r} applies to rows: both it and data.source "
                              f"({self.source!r}) must be .jsonl/.parquet files or `datasets` directories")
        _choice("data.train_on", self.train_on, TRAIN_ON)
        _choice("data.too_long", self.too_long, TOO_LONG)


def _check_lerobot(d: DataConfig) -> None:
    if d.source == MIXTURE:
        _check_mixture(d.mixture)
    elif not d.source[len("lerobot:"):]:
        raise ConfigError("data.source=lerobot: names no directory; give data.source=lerobot:DIR (a LeRobot dataset)")
    for key in ("action_horizon", "image_size", "prompt_len"):
        _at_least(f"data.{key}", getattr(d, key), 1)
    for key in ("norm_state", "norm_action"):
        _choice(f"data.{key}", getattr(d, key), CONFIG_NAMES)
    if not 0.0 <= d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must be in [0, 1): the share of episodes held out")
    _finite("data.filter_idle", d.filter_idle, 0)
    _choice("data.filter_idle_actions", d.filter_idle_actions, IDLE_ACTIONS)


def _check_mixture(mixture: tuple) -> None:
    if not mixture:
        raise ConfigError("data.source=mixture names no dataset; give data.mixture={DIR: weight, ...} (YAML) or "
                          "data.mixture=DIR_A:0.7,DIR_B:0.3")
    for root, weight in mixture:
        _finite(f"data.mixture[{root!r}]", weight, 0, above=True)
