"""The enumerations of config values (the CLI's choices read them from here) and the checks
that a value is in range. Each is written once."""

from __future__ import annotations

import math
from typing import Any
from zerojax.errors import ConfigError


DTYPES = ("float32", "bfloat16", "float16")
QUANTIZED_GATHERS = ("int8", "float8_e4m3fn")  # block-quantized weight gathers (zerojax.quant)
OFFLOADS = ("none", "optimizer", "optimizer+master")  # zero.offload: what lives in pinned host memory
BUILTIN_FAMILIES = ("gpt", "llama")  # model.family values that need no import
RENAMED = {"model.name": "model.family (gpt | llama | module:factory)"}  # old key -> its replacement
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
FLOAT32_MAX = 3.4028234663852886e38  # loss scales are float32 scalars in the train state


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
