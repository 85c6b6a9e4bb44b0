"""Parsing a YAML scalar or a command-line string to a config field's type."""

from __future__ import annotations

import types
import typing
from typing import Any
from zerojax.errors import ConfigError


def _field_type(cls: type, name: str) -> Any:
    return typing.get_type_hints(cls)[name]


def coerce(key: str, value: Any, typ: Any) -> Any:
    """Parse `value` (a YAML scalar or a command-line string) to the field type `typ`."""
    bad = ConfigError(f"{key} expects {_type_name(typ)}, got {value!r}")
    if isinstance(typ, types.UnionType) and type(None) in typ.__args__:  # bool | None: null/auto = default
        if value is None or str(value).strip().lower() in ("", "null", "none", "auto"):
            return None
        return coerce(key, value, next(t for t in typ.__args__ if t is not type(None)))
    if isinstance(typ, types.UnionType):  # str | float: a number if it parses as one
        try:
            return coerce(key, value, float)
        except ConfigError:
            return coerce(key, value, str)
    if typ is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "yes", "on", "1"):
            return True
        if text in ("false", "no", "off", "0"):
            return False
        raise bad
    if typ is int:
        if isinstance(value, bool) or isinstance(value, float):
            raise bad
        try:
            return int(str(value).strip())
        except ValueError:
            raise bad from None
    if typ is float:
        if isinstance(value, bool):
            raise bad
        try:
            return float(str(value).strip())
        except ValueError:
            raise bad from None
    if typ is str:
        if isinstance(value, (dict, list)):
            raise bad
        return "" if value is None else str(value)
    if _is_mapping(typ):  # a YAML mapping, or NAME:VALUE,NAME:VALUE on the command line: kept as pairs
        return _pairs(key, value, typing.get_args(typ)[0].__args__[1], bad)
    if typing.get_origin(typ) is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise bad
        return tuple(value)
    raise TypeError(f"no parser for {key}: {typ}")


def _is_mapping(typ: Any) -> bool:
    """tuple[tuple[str, X], ...]: a mapping from names to X (optim.lora.rank_pattern)."""
    args = typing.get_args(typ)
    return typing.get_origin(typ) is tuple and len(args) == 2 and args[1] is Ellipsis and typing.get_origin(args[0]) is tuple


def _pairs(key: str, value: Any, typ: type, bad: ConfigError) -> tuple:
    if isinstance(value, str):
        items = [item.strip() for item in value.split(",") if item.strip()]
        if not all(":" in item for item in items):
            raise bad
        value = dict(item.rsplit(":", 1) for item in items)
    if value is None or value == []:
        value = {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and k.strip() for k in value):
        raise bad
    return tuple((k.strip(), coerce(f"{key}[{k.strip()!r}]", v, typ)) for k, v in value.items())


def _type_name(typ: Any) -> str:
    if isinstance(typ, types.UnionType) and type(None) in typ.__args__:
        return _type_name(next(t for t in typ.__args__ if t is not type(None))) + " (or null: the default)"
    if isinstance(typ, types.UnionType):
        return "a number or one of its named values"
    if _is_mapping(typ):
        value = _type_name(typing.get_args(typ)[0].__args__[1])
        return f"a mapping NAME: VALUE, each VALUE {value} (in YAML, or NAME:VALUE,NAME:VALUE, e.g. expert:32)"
    if typing.get_origin(typ) is tuple:
        return "a list of strings"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[typ]
