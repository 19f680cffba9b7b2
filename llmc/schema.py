"""Strict parsing of plain data (YAML, keyword arguments) into frozen dataclasses.

Used for recipes and for runtime options, so both refuse the same mistakes with the same words:
an unknown key, a wrong type, a value outside its range or choices — one line naming the key.
Constraints live in field metadata: `choices`, `min`, `max`, `min_exclusive`, `help`; `alias` is a second
name the key is accepted by (vLLM's name where llmc's differs).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from typing import Any, Union

from llmc.errors import LlmcError


def opt(default=dataclasses.MISSING, *, help: str = "", **constraints) -> Any:
    """A dataclass field with a help text and constraints (choices=, min=, max=, min_exclusive=)."""
    metadata = {"help": help, **constraints}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def canonical_keys(klass, data: dict, where: str, error: type[LlmcError]) -> dict:
    """`data` with keys given by a field's alias renamed to the field's name; both names at once is an error."""
    aliases = {f.metadata["alias"]: f.name for f in dataclasses.fields(klass) if "alias" in f.metadata}
    if not aliases.keys() & data.keys():
        return data
    renamed, given_as = {}, {}
    for key, value in data.items():
        name = aliases.get(key, key)
        if name in renamed:
            raise error(f"{_join(where, name)}: given twice, as {given_as[name]!r} and as {key!r} (one setting, "
                        f"two names); keep one")
        renamed[name], given_as[name] = value, key
    return renamed


def parse(klass, data: Any, where: str, error: type[LlmcError]):
    """Build `klass` from a mapping, checking every key; `where` prefixes messages ("quantization")."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise error(f"{where or 'the top level'} must be a mapping of keys to values, got {_show(data)}")
    data = canonical_keys(klass, data, where, error)
    fields = {f.name: f for f in dataclasses.fields(klass)}
    for key in data:
        if key not in fields:
            raise error(f"{_join(where, key)}: unknown key{_did_you_mean(key, fields)}; allowed: {', '.join(fields)}")
    hints = typing.get_type_hints(klass)
    values = {}
    for name, f in fields.items():
        if name in data:
            values[name] = _convert(hints[name], data[name], _join(where, name), error)
            _check_constraints(f, values[name], _join(where, name), error)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            help_text = f.metadata.get("help")
            raise error(f"{_join(where, name)}: required key is missing" + (f" ({help_text})" if help_text else ""))
    return klass(**values)


def check_fields(obj, where: str, error: type[LlmcError]) -> None:
    """Check the constraints of an already-built dataclass (e.g. after dataclasses.replace)."""
    for f in dataclasses.fields(obj):
        _check_constraints(f, getattr(obj, f.name), _join(where, f.name), error)


def _convert(hint, value, key: str, error):
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, key, error)
    if origin in (list, tuple):
        (inner, *_) = typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            raise error(f"{key}: expected a list, got {_show(value)}")
        items = [_convert(inner, v, f"{key}[{i}]", error) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise error(f"{key}: expected a mapping, got {_show(value)}")
        return dict(value)
    if dataclasses.is_dataclass(hint):
        return parse(hint, value, key, error)
    return _convert_scalar(hint, value, key, error)


def _convert_scalar(hint, value, key: str, error):
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise error(f"{key}: expected true or false, got {_show(value)}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise error(f"{key}: expected an integer, got {_show(value)}{_yaml11_hint(value, True)}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if abs(value) < 1e308 or isinstance(value, float) else math.inf
            if not math.isfinite(number):  # NaN passes every range check; infinity is no size or fraction
                raise error(f"{key}: expected a finite number, got {value if isinstance(value, float) else 'a huge integer'}")
            return number
        raise error(f"{key}: expected a number, got {_show(value)}{_yaml11_hint(value)}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise error(f"{key}: expected a string, got {_show(value)}")
    raise TypeError(f"schema: unsupported type {hint!r} for {key}")


def _yaml11_hint(value, integer: bool = False) -> str:
    """YAML 1.1 (PyYAML) reads 1e-2 and 1e3 as text: a float needs a dot (1.0e-2)."""
    if isinstance(value, str) and re.fullmatch(r"[-+]?\d+[eE][-+]?\d+", value.strip()):
        mantissa, exponent = re.split("[eE]", value.strip())
        if integer:
            return f" (YAML reads {value} as text; write the integer in full)"
        return f" (YAML reads {value} as text; write {mantissa}.0e{exponent}, or the number in full)"
    return ""


def _check_constraints(f: dataclasses.Field, value, key: str, error) -> None:
    if value is None:
        return
    meta = f.metadata
    if "choices" in meta and value not in meta["choices"]:
        allowed = ", ".join(str(c) for c in meta["choices"])
        raise error(f"{key}: {_show(value)} is not allowed; choose one of: {allowed}")
    if "min" in meta and value < meta["min"]:
        raise error(f"{key}: {value} is too small; it must be at least {meta['min']}")
    if "min_exclusive" in meta and value <= meta["min_exclusive"]:
        raise error(f"{key}: {value} is too small; it must be greater than {meta['min_exclusive']}")
    if "max" in meta and value > meta["max"]:
        raise error(f"{key}: {value} is too large; it must be at most {meta['max']}")


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _show(value) -> str:
    return f"{type(value).__name__} {value!r}" if not isinstance(value, str) else repr(value)


def _did_you_mean(key: str, fields) -> str:
    close = difflib.get_close_matches(str(key), list(fields), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
