"""The enumerations of config values, and the rules between keys. Each is written once: the
sections check their values against these tuples, the CLI's choices are these tuples, and
`analysis.measure` asks `gather_stages` which stages a config compiles at. Importing this
module imports no jax.

The rules between keys (`check_between_keys`) take the whole `Config`; the checks that need the mesh (batch
divisibility) live where the mesh is known (`train.step.make_engine`)."""

from __future__ import annotations

import math
from typing import Any
from zerojax.errors import ConfigError


STAGES = (0, 1, 2, 3)  # zero.stage: 0 DDP, 1 optimizer states, 2 + gradients, 3 + parameters
SCHEDULES = ("shard_map", "gspmd")  # zero.schedule: the explicit FSDP unit schedule | annotations only
OFFLOADS = ("none", "optimizer", "optimizer+master")  # zero.offload: what lives in pinned host memory
ATTENTIONS = ("auto", "blockwise", "cudnn", "naive")  # model.attention (models.attention.IMPLS)
REMATS = ("none", "full", "dots")  # model.remat: what a block keeps for its backward (models.protocol.REMAT_POLICIES)
PARAM_DTYPES = ("float32",)  # precision.param: the master weights
DTYPES = ("float32", "bfloat16", "float16")  # precision.compute, gather, reduce, frozen
QUANTIZED_GATHERS = ("int8", "float8_e4m3fn")  # block-quantized weight gathers (schedules.quant.QUANT_FORMATS)
LOSS_SCALES = ("dynamic", "none")  # precision.loss_scale, when not a number
LR_SCHEDULES = ("cosine", "constant")  # optim.schedule: after warmup
DECAY_MASKS = ("matrices", "all")  # optim.decay_mask: the parameters weight decay applies to
LORA_BASES = ("all", "targets")  # optim.lora.base: what LoRA freezes (every leaf but the adapters | what the targets adapt)
DISTRIBUTED = ("auto", "off")  # mesh.distributed
RESUMES = ("auto", "never")  # train.resume
IDLE_ACTIONS = ("position", "velocity")  # data.filter_idle_actions: openpi's DROID action spaces (data.idle)
AUGMENTS = ("none", "openpi", "lerobot")  # data.augment: image augmentation in the train step (data.augment)
EXPORT_DTYPES = ("float32", "bfloat16")  # `zerojax export --dtype`
EXPORT_WEIGHTS = ("ema", "raw")  # `zerojax export --weights`: optim.ema's average or the weights themselves
XLA_PRESETS = ("gpu",)  # --xla-preset: the names of parallel.mesh.XLA_PRESETS (which imports jax)
RENAMED = {"model.name": "model.family (gpt | llama | module:factory)"}  # old key -> its replacement
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
FLOAT32_MAX = 3.4028234663852886e38  # loss scales are float32 scalars in the train state


# ---------------------------------------------------------------------------------------------
# The rules between keys, each once.


def gather_stages(gather: str, schedule: str) -> tuple[int, ...]:
    """The ZeRO stages `precision.gather` works at under `zero.schedule`: a block-quantized
    gather is the explicit schedule's, and needs a gather to quantize (stages 1-3)."""
    if gather not in QUANTIZED_GATHERS:
        return STAGES
    return STAGES[1:] if schedule == "shard_map" else ()


def check_between_keys(cfg) -> None:
    """The rules between the keys of a `Config` (its sections have checked their own values)."""
    for rule in (_quantized_gather, _offload, _reduce, _byte_vocab, _decay, _relative_actions):
        rule(cfg)


def _quantized_gather(cfg) -> None:
    gather, z = cfg.precision.gather, cfg.zero
    if z.stage not in gather_stages(gather, z.schedule):
        raise ConfigError(f"precision.gather={gather} (block-quantized weight gathers) is supported with "
                          f"zero.schedule=shard_map at zero.stage 1, 2 or 3, not with zero.schedule={z.schedule} "
                          f"at zero.stage {z.stage}; use those, or precision.gather=auto|{'|'.join(DTYPES)}")


def _offload(cfg) -> None:
    z = cfg.zero
    if z.offload != "none" and z.schedule != "shard_map":
        raise ConfigError(f"zero.offload={z.offload} (the update streamed unit by unit from host memory) is "
                          f"supported with zero.schedule=shard_map, not {z.schedule}; use zero.schedule=shard_map, "
                          "or zero.offload=none")


def _reduce(cfg) -> None:
    reduce = cfg.precision.reduce
    if reduce != "float32" and cfg.zero.schedule == "gspmd":
        raise ConfigError(f"precision.reduce={reduce!r}: choosing the reduce dtype under gspmd is not "
                          "implemented in zerojax yet; use zero.schedule=shard_map")


def _byte_vocab(cfg) -> None:
    data, model = cfg.data, cfg.model
    byte_corpus = (data.source == "stdlib" or data.source.endswith(".txt")) and not data.tokenizer
    if byte_corpus and model.vocab_size < 256:
        raise ConfigError(f"model.vocab_size={model.vocab_size} is too small for the byte corpus "
                          f"data.source={data.source}; it needs model.vocab_size >= 256")


def _decay(cfg) -> None:
    opt = cfg.optim
    if opt.schedule == "constant" and (opt.decay_steps or opt.final_lr is not None):
        key = "decay_steps" if opt.decay_steps else "final_lr"
        raise ConfigError(f"optim.{key} shapes the cosine decay, and optim.schedule=constant has none; use "
                          f"optim.schedule=cosine, or leave optim.{key} out")


def _relative_actions(cfg) -> None:
    from zerojax.models import registry

    family, source = cfg.model.family, cfg.data.source
    if not cfg.model.action.relative:
        return
    if not registry.is_policy(family):
        raise ConfigError(f"model.action.relative=true makes a policy's actions relative to the robot's state; "
                          f"model.family={family} is not a policy: set model.action.relative=false")
    if not cfg.data.robot:
        raise ConfigError(f"model.action.relative=true subtracts a LeRobot dataset's state from its actions; "
                          f"data.source={source!r} is not one (data.source=lerobot:DIR or mixture)")


def profile_range(text: str, steps: int) -> tuple[int, int] | None:
    """train.profile=START:STOP: the steps START+1..STOP are traced (0 <= START < STOP <= steps)."""
    if not text:
        return None
    start, sep, stop = text.partition(":")
    try:
        bounds = (int(start), int(stop)) if sep else None
    except ValueError:
        bounds = None
    if bounds is None or not 0 <= bounds[0] < bounds[1] <= steps:
        raise ConfigError(f"train.profile={text!r} is not a range of the run's steps; give START:STOP with "
                          f"0 <= START < STOP <= train.steps={steps}, e.g. train.profile=10:15")
    return bounds


# ---------------------------------------------------------------------------------------------
# The checks a section applies to one value.


def _choice(key: str, value: Any, valid: tuple) -> None:
    if value not in valid:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of {', '.join(map(str, valid))}")


def _at_least(key: str, value: float, low: float) -> None:
    if not value >= low:  # written so that NaN fails too
        raise ConfigError(f"{key}={value!r} is not valid; it must be >= {low}")


def _finite(key: str, value: float, low: float, *, above: bool = False, high: float = math.inf) -> None:
    """A float key: finite (YAML and the command line both accept nan and inf), >= low (> low
    with `above`) and <= high."""
    if not (math.isfinite(value) and (value > low if above else value >= low) and value <= high):
        bound = f"> {low:g}" if above else f">= {low:g}"
        raise ConfigError(f"{key}={value!r} is not valid; it must be a finite number {bound}"
                          + (f" and <= {high:g}" if high < math.inf else ""))


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, at_most + 1) if n % d == 0)

