"""How FP32, BF16, FP16, FP8 E4M3 and FP8 E5M2 store a real number.

A float is (-1)^sign x 1.mantissa x 2^(exponent - bias): exponent bits buy range, mantissa bits
buy precision. All rounding is done by numpy / ml_dtypes casts (round to nearest even), never by
hand; this module only reads the stored bits back and names what happened to the value.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from zerojax.errors import ConfigError

FORMATS = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
LABELS = {"float32": "FP32", "bfloat16": "BF16", "float16": "FP16",
          "float8_e4m3fn": "FP8 E4M3", "float8_e5m2": "FP8 E5M2"}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name, None) or name)


@dataclass(frozen=True)
class FormatInfo:
    name: str
    exponent_bits: int
    mantissa_bits: int
    max: float  # largest finite value
    smallest_normal: float
    smallest_subnormal: float
    eps: float  # gap between 1.0 and the next representable number
    has_inf: bool  # E4M3 (the "fn" variant) has no infinities: overflow becomes NaN

    @property
    def bits(self) -> str:
        return f"1 / {self.exponent_bits} / {self.mantissa_bits}"


def info(name: str) -> FormatInfo:
    f = ml_dtypes.finfo(dtype(name))
    has_inf = bool(np.isinf(np.array(np.inf).astype(dtype(name))))
    return FormatInfo(name, int(f.nexp), int(f.nmant), float(f.max), float(f.smallest_normal),
                      float(f.smallest_subnormal), float(f.eps), has_inf)


def rounds_via_float32(name: str) -> bool:
    """Whether casting a float64 to `name` rounds twice, to float32 first. ml_dtypes 0.6 casts
    float64 to bfloat16 and the float8 formats that way; numpy's float16 cast rounds once. Read
    from the cast itself: 1 + 2^-(m+1) + 2^-30 lies just above the midpoint of 1 and the next
    value up, so one rounding goes up; through float32, the 2^-30 is lost, the midpoint is a
    tie, and ties go to the even neighbour, 1. The report's explorer rounds the same way."""
    mantissa = info(name).mantissa_bits
    if mantissa >= info("float32").mantissa_bits:
        return False
    probe = 1 + 2.0 ** -(mantissa + 1) + 2.0**-30
    return float(np.array(probe).astype(dtype(name))) == 1.0


@dataclass(frozen=True)
class Stored:
    format: str
    sign: str  # the bit fields as '0'/'1' strings
    exponent: str
    mantissa: str
    stored: float  # the value actually held
    rel_error: float | None  # |stored - x| / |x|; None where undefined (x = 0, or not finite)
    status: str  # ok | overflow | underflow | nan

    @property
    def bits(self) -> str:
        return f"{self.sign} {self.exponent} {self.mantissa}"


def store(value: float, name: str) -> Stored:
    """Round `value` (a Python float, i.e. float64) into format `name` and describe the result."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # overflow in the cast is what we report
        held = np.array(value, np.float64).astype(dtype(name))
    width = held.dtype.itemsize * 8
    word = format(int(held.view(_UINT[held.dtype.itemsize])), f"0{width}b")
    e = info(name).exponent_bits
    stored = float(held.astype(np.float64))
    return Stored(name, word[0], word[1 : 1 + e], word[1 + e :], stored,
                  _rel_error(value, stored), _status(value, stored))


def _status(value: float, stored: float) -> str:
    if math.isnan(stored) and not math.isnan(value):
        return "nan"  # out of range in a format without infinities
    if math.isinf(stored) and math.isfinite(value):
        return "overflow"
    if stored == 0.0 and value != 0.0:
        return "underflow"
    return "ok"


def _rel_error(value: float, stored: float) -> float | None:
    if value == 0.0 or not (math.isfinite(value) and math.isfinite(stored)):
        return 0.0 if value == stored == 0.0 else None
    return abs(stored - value) / abs(value)


def parse_value(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{text!r} is not a number; give values like 0.1, 70000, 1e-8 or -3.5") from None


def _json_number(x: float | None):
    """JSON has no inf/nan: they are written as the strings 'inf', '-inf', 'nan'."""
    if x is None or math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def explain(texts: list[str]) -> dict:
    """The `zerojax formats --json` document (DESIGN §4) for the given values."""
    values = []
    for text in texts:
        x = parse_value(text)
        cells = {}
        for name in FORMATS:
            s = store(x, name)
            cells[name] = {"bits": s.bits, "stored": _json_number(s.stored),
                           "rel_error": _json_number(s.rel_error), "status": s.status}
        values.append({"input": text, "formats": cells})
    return {"values": values}


def table() -> dict:
    """Per format: bit split, largest finite, smallest normal/subnormal, gap after 1.0."""
    return {name: {"bits": i.bits, "max": i.max, "smallest_normal": i.smallest_normal,
                   "smallest_subnormal": i.smallest_subnormal, "eps": i.eps, "has_inf": i.has_inf}
            for name, i in ((n, info(n)) for n in FORMATS)}
