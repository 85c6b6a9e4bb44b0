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
    if typing.get_origin(typ) is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise bad
        return tuple(value)
    raise TypeError(f"no parser for {key}: {typ}")


def _type_name(typ: Any) -> str:
    if isinstance(typ, types.UnionType) and type(None) in typ.__args__:
        return _type_name(next(t for t in typ.__args__ if t is not type(None))) + " (or null: the default)"
    if isinstance(typ, types.UnionType):
        return "a number or one of its named values"
    if typing.get_origin(typ) is tuple:
        return "a list of strings"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[typ]
