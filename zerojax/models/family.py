"""What a built-in family declares (docs/design.md, "Adding a family"), as torchtitan's
`ModelSpec` does: one `Family` record, `FAMILY` in the family's module, which
`zerojax.models.registry` reads. No jax here.

    FAMILY = Family(
        kind=POLICY,                  # LANGUAGE_MODEL | VISION_LANGUAGE | POLICY: what the rest of
                                      # zerojax asks of it (which rows it reads, what serve takes)
        build=build,                  # build(*, cfg, policy, rngs): the factory (a user's module:factory's signature)
        check_config=check_config,    # its rules on a ModelConfig (ConfigError), beyond the generic ones
        hf=HfLayout(...),             # optional: its Hugging Face architectures, config.json keys, tensor table
        lerobot=LeRobotLayout(...),   # optional: its LeRobot policy type, model keys, tensor table
        openpi=OpenpiLayout(...),     # optional: its openpi `params/` tree (leaf rules, model keys)
        adapter=PolicyAdapter(...),   # a policy: observation features -> its batch (training, serve, rollout)
    )

`data/`, `serve/`, `sim/`, `train/` and the CLI ask the registry ("which families are
policies", "this family's adapter") and never name a family.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

from zerojax.errors import ConfigError

# What a family is: the kinds the rest of zerojax asks about.
LANGUAGE_MODEL = "language model"  # token rows in, next-token loss (a corpus, chat rows)
VISION_LANGUAGE = "vision-language model"  # image and text rows (.jsonl / .parquet of images), answers
POLICY = "policy"  # robot observations in, action chunks out (data.source=lerobot:DIR, serve, rollout)
KINDS = (LANGUAGE_MODEL, VISION_LANGUAGE, POLICY)

# The features a policy's observation and its targets carry, by LeRobot's names (which openpi's
# clients send too): the state, one image per camera, the action chunk, the task's text (beside
# its tokens, for a family that writes its own prompt from it: π0.5).
STATE, ACTION, CAMERA, TASK = "observation.state", "action", "observation.images.", "task"


class Field(NamedTuple):
    """One leaf of a batch spec: the global shape, batch axis first, and a numpy dtype name."""

    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Tensor:
    """Where a zerojax leaf lives in an HF checkpoint: the name (`{i}`: the layer of a stacked
    leaf, `at`), whether HF stores it transposed ([out, in] for a zerojax [in, out] kernel), and
    whether the checkpoint's tensor may have more rows than the model uses (a position table
    longer than model.seq_len: the model reads its first rows)."""

    name: str
    transposed: bool = False
    may_be_longer: bool = False
    # a stacked leaf whose unit holds `every` of the checkpoint's layers (SmolVLA's self- and
    # cross-attention pair): its layer i is the checkpoint's layer i·every + offset
    every: int = 1
    offset: int = 0

    def at(self, i: int) -> str:
        """The tensor's name for layer i of a stacked leaf."""
        return self.name.format(i=i * self.every + self.offset)


@dataclass(frozen=True)
class HfLayout:
    """A family's Hugging Face checkpoints: what `zerojax.interop.hf` reads and writes for it."""

    architectures: tuple[str, ...]  # config.json's `architectures` read as this family; the first is written
    from_hf_config: Callable[[dict, str], dict]  # (config.json, its path) -> model.* keys; ConfigError if unsupported
    to_hf_config: Callable[[dict], dict]  # a run's model section -> config.json (less architectures and dtype)
    tensors: dict[str, Tensor]  # zerojax parameter path -> its HF tensor
    # config.json keys zerojax derives from the model keys: key -> (value of a ModelConfig, what it must be)
    derived: dict[str, tuple[Callable[[Any], Any], str]] = field(default_factory=dict)
    fan_in_fan_out: bool = False  # PEFT's LoraConfig flag: the adapted layers keep their weight [in, out]
    optional_prefix: str = ""  # a prefix of the tensor names that some published checkpoints drop
    # tensor-name prefixes as zerojax writes them -> the prefix other writers store instead
    # (transformers 5 saves PaliGemma's `vision_tower.vision_model.` as `vision_tower.`)
    aliases: dict[str, str] = field(default_factory=dict)


def local_file(name: str, where: str, file: str) -> Path | None:
    """`name`/`file`, where a checkpoint names a directory by a relative path (SmolVLA's
    `vlm_model_name`, a processor's `tokenizer_name`): from the current directory or one above the
    checkpoint's `where`; None where it is not there (a Hub name)."""
    for base in (Path.cwd(), *Path(where).resolve().parents):
        if name and (base / name / file).is_file():
            return base / name / file
    return None


@dataclass(frozen=True)
class LeRobotLayout:
    """A family's LeRobot policy checkpoints (`PreTrainedPolicy.save_pretrained`: config.json with
    "type", model.safetensors): what `zerojax.interop.lerobot` reads and writes for it."""

    type: str  # config.json's "type"
    # (config.json, tensor name -> shape, config.json's path, the model keys the user gave) -> model.* keys;
    # ConfigError if the checkpoint makes no such model. A key no tensor shape holds: the user's wins.
    model_keys: Callable[[dict, dict, str, dict], dict]
    tensors: dict[str, Tensor]  # zerojax parameter path -> its LeRobot tensor
    to_config: Callable[[dict, dict], dict]  # (a run's model section, a LeRobot config.json to start from) -> config.json
    # a tensor name -> the name another LeRobot version keeps it under (0.3's tied `lm_head` for
    # 0.6's `embed_tokens`): read where the first is absent, and written beside it in an export
    aliases: dict[str, str] = field(default_factory=dict)
    # config.json -> (pre, post): LeRobot 0.4+'s processor steps, as policy_pre/postprocessor.json
    # list them, for an export that did not start from a checkpoint with its own (None: none written)
    processors: Callable[[dict], tuple[list, list]] | None = None
    # a run's model section -> {name: shape}: tensors LeRobot's model holds that zerojax's does not use
    # (π0's expert `lm_head`), written as zeros where model.init_from does not give them (0.6 loads strictly)
    unused: Callable[[dict], dict] | None = None
    # config.json -> it is LeRobot 0.3's (statistics as buffers in model.safetensors, no processor
    # files): by default π0's 0.3 marker, `resize_imgs_with_padding` (0.4+'s π0 says image_resolution);
    # a family LeRobot 0.3 never had (SmolVLA, which keeps that key in 0.6) says never
    legacy: Callable[[dict], bool] = lambda config: "resize_imgs_with_padding" in config
    # (config.json, its directory) -> the tokenizer.json the checkpoint names where it is at hand
    # (SmolVLA's `vlm_model_name`, a local SmolVLM directory), else None: `zerojax serve` then
    # needs --tokenizer (π0's PaliGemma tokenizer is on the Hub, not in the directory)
    tokenizer: Callable[[dict, str], str | None] = lambda config, where: None


class Rule(NamedTuple):
    """Zerojax leaves <-> the openpi leaves that hold them (`OpenpiLayout`), both ways: each
    function takes (xp, *arrays) with xp numpy or jax.numpy (shapes are checked with
    jax.eval_shape before anything is read) and returns the other side's arrays, in order."""

    zerojax: tuple[str, ...]  # zerojax parameter paths (a stacked leaf with its layer axis)
    openpi: tuple[str, ...]  # openpi tree paths, "/"-joined ("PaliGemma/llm/layers/attn/q_einsum/w")
    to_openpi: Callable
    from_openpi: Callable


@dataclass(frozen=True)
class OpenpiLayout:
    """A family's openpi checkpoints (a `params/` orbax tree beside `assets/<id>/norm_stats.json`):
    what `zerojax.interop.openpi` reads and writes for it."""

    heads: tuple[str, ...]  # top-level leaves only this family's tree has: which family a tree is
    # (openpi path -> shape, the tree's path, the model keys the user gave) -> model.* keys; ConfigError if none
    model_keys: Callable[[dict, str, dict], dict]
    rules: Callable[[dict], list]  # a model section (dict) -> its `Rule`s, every parameter in exactly one
    # the run keys ("data.norm_state": "quantiles", "optim.lr": 2.5e-5, ...) openpi's model type and its
    # TrainConfig imply, which a fine-tune from such a checkpoint takes where the user sets none
    run_keys: dict = field(default_factory=dict)


def at_least(key: str, value: float, low: float) -> None:
    """A family's config key is at least `low` (ConfigError naming it; NaN fails too)."""
    if not value >= low:
        raise ConfigError(f"{key}={value!r} is not valid; it must be >= {low}")


def require(hf: dict, where: str, family: str, keys: list[str]) -> None:
    """ConfigError naming the `keys` that config.json lacks (or holds as null)."""
    missing = [key for key in keys if hf.get(key) is None]
    if missing:
        raise ConfigError(f"{where} has no {', '.join(missing)}; zerojax needs {'it' if len(missing) == 1 else 'them'} "
                          f"to build the {family} model")


@dataclass(frozen=True)
class PolicyAdapter:
    """How a policy family reads robot data: the dataset's features (a LeRobot source's rows,
    `zerojax.data.lerobot`: the state, the cameras, the action chunk, the prompt's tokens) become
    its batch, in training and in `zerojax serve` / `rollout` alike, so what a served policy reads
    cannot drift from what it was trained on."""

    # (cfg, the features' spec) -> None: the dataset fits the model (ConfigError naming the key if not)
    check: Callable[[Any, dict], None]
    # (the features' source, cfg) -> the source of the family's batch (the same rows, stacked and padded)
    rows: Callable[[Any, Any], Any]
    # (stacked observation features, batch first; the cameras in order; the run's model section as
    # a dict; the tokenizer the prompt's tokens were made with, None: bytes) -> the observation
    # part of the family's batch: what `sample_actions` reads
    observation: Callable[[dict, list, dict, Any], dict]
    # the run's model section (a dict) -> (horizon, width) of the noise `sample_actions` integrates
    chunk: Callable[[dict], tuple[int, int]]
    # cfg -> the features of the widest dataset the model reads (state and action at their padded
    # widths, every camera slot filled): the batch `zerojax analyze` and `plan` compile when no
    # dataset is named, which is the batch of any dataset that fits (the adapter pads to these)
    widest: Callable[[Any], dict]
    # a camera that is not square is padded on the top and left when resized to the model's size,
    # not centred (SmolVLA's `resize_with_pad` in every LeRobot version; π0's and π0.5's centre, as
    # openpi): in training, `serve` and `rollout` alike, and named in an export's metadata
    pad_before: bool = False


@dataclass(frozen=True)
class Family:
    """Everything a built-in family brings (module docstring): its kind, its factory and rule,
    its checkpoint layouts and, for a policy, its batch adapter."""

    kind: str
    build: Callable
    check_config: Callable[[Any], None]
    hf: HfLayout | None = None
    lerobot: LeRobotLayout | None = None
    openpi: OpenpiLayout | None = None
    adapter: PolicyAdapter | None = None
    # the run keys ("optim.lr": 2.5e-5, "data.norm_action": "quantiles", ...) a run of the family takes
    # where neither the user nor its checkpoint sets them: its authors' recipe (a policy's: LeRobot's
    # preset, `vla.lerobot.preset`), so that no default of the tiny GPT's reaches it
    recipe: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Family.kind={self.kind!r}; one of {KINDS}")
        if (self.kind == POLICY) != (self.adapter is not None):
            raise ValueError("a policy family declares its PolicyAdapter, and only a policy does")
