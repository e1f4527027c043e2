"""Typed configuration schema: dataclass fields carry their type, default, bounds and help text,
and one validating loader reads plain YAML data into them.

Why dataclasses and not pydantic: the schema needs types, defaults, bounds and help per field,
a loader that refuses unknown keys, and errors in the library's one format
(:class:`~hyper_parallel.distributed.errors.CPConfigError` naming the dotted field path, with a
fix). Dataclass ``metadata`` holds the first; ~200 lines here do the second and third without a new
dependency, and the config classes stay the plain dataclasses the rest of the code already uses.

Declare a field with :func:`option`; load with :func:`load_section` (a mapping -> an instance),
re-check an instance built in Python with :func:`check_section`; list fields with
:func:`describe_fields` (``--help`` and the docs are generated from it).

Type rules (the same for a YAML file, a ``from_dict`` mapping and a ``a.b.c=value`` override):

* ``int``: an integer (``true`` / ``2.0`` are refused); ``float``: an integer or a float, or a
  string in exponent form without a dot (``3e-4``; YAML 1.1, hence PyYAML, leaves it a string
  while YAML 1.2 reads a float); ``bool``: ``true``/``false`` only; ``str``: a string;
* ``dict``: a mapping (a list is refused); ``tuple[float, float]``: a list of two numbers (a
  scalar or a mapping is refused); ``X | None``: ``null`` or an ``X``;
* a float must be finite (``.nan`` / ``.inf`` are refused);
* ``ge`` / ``gt`` / ``le`` / ``lt`` bounds and ``choices`` are checked after the type.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import typing
from typing import Any, Callable, Mapping

from .errors import CPConfigError

__all__ = ["option", "load_section", "check_section", "check_value", "describe_fields", "FieldInfo",
           "EXP_FLOAT"]

#: numbers in exponent form without a dot: YAML 1.2 floats that YAML 1.1 (PyYAML) leaves strings
EXP_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$")
_NONE = type(None)


def option(default: Any = dataclasses.MISSING, *, help: str, ge: float | None = None, gt: float | None = None,
           le: float | None = None, lt: float | None = None, choices: tuple | None = None, case_insensitive: bool = False, default_factory: Any = dataclasses.MISSING,
           shown_default: str | None = None, parse: Callable[[Any, str], Any] | None = None,
           type_name: str | None = None, fixed: Any = dataclasses.MISSING,
           fixed_reason: str | None = None) -> Any:
    """A dataclass field with its schema: ``help`` (one line), bounds ``ge``/``gt`` (lower) and
    ``le``/``lt`` (upper), ``choices``
    (compared lower-cased with ``case_insensitive``), ``shown_default`` (how docs show the default),
    ``parse(value, path)`` (a custom parser replacing the type rules; must raise CPConfigError),
    ``type_name`` (how docs show the type), ``fixed`` (the only allowed value, with ``fixed_reason``)."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices, "case_insensitive": case_insensitive,
            "shown_default": shown_default, "parse": parse, "type_name": type_name, "fixed": fixed,
            "fixed_reason": fixed_reason}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# ----------------------------------------------------------------------------- types
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _split_optional(tp) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, _union_type()) and _NONE in args:
        rest = [a for a in args if a is not _NONE]
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True
    return tp, False


def _union_type():
    import types

    return getattr(types, "UnionType", typing.Union)


def _kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (int, float)):
        return "a number"
    return f"a {type(value).__name__}"


def _got(value) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"got {_kind(value)}: {text}" if not isinstance(value, (int, float)) or isinstance(value, bool) \
        else f"got {text}"


def _bounds(meta: Mapping) -> str:
    low = (f"{meta['ge']:g} <= " if meta.get("ge") is not None else
           f"{meta['gt']:g} < " if meta.get("gt") is not None else "")
    high = (f"{meta['le']:g}" if meta.get("le") is not None else
            f"{meta['lt']:g}" if meta.get("lt") is not None else "")
    if high:   # both ends: "in [0, 1]" / "in (0, 1)"; an upper end only: "<= 1"
        op = "<=" if meta.get("le") is not None else "<"
        if low:
            left = "[" if meta.get("ge") is not None else "("
            right = "]" if meta.get("le") is not None else ")"
            lo = meta["ge"] if meta.get("ge") is not None else meta["gt"]
            return f" in {left}{lo:g}, {high}{right}"
        return f" {op} {high}"
    if meta.get("ge") is not None:
        return f" >= {meta['ge']:g}"
    if meta.get("gt") is not None:
        return f" > {meta['gt']:g}"
    return ""


def _type_error(tp, meta, path: str, value, optional: bool):
    want = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
            dict: "a mapping (key: value lines)"}.get(tp)
    if want is None and typing.get_origin(tp) is tuple:
        n = len(typing.get_args(tp))
        want = f"a list of {n} numbers"
    want = (want or f"a {getattr(tp, '__name__', tp)}") + _bounds(meta)
    if optional:
        want += " or null"
    return CPConfigError(path, f"must be {want}, {_got(value)}", fix=_fix(tp, meta))


def _fix(tp, meta) -> str | None:
    if typing.get_origin(tp) is tuple:
        return "write a YAML list, e.g. [0.9, 0.95]"
    if tp is dict:
        return "write a mapping, e.g. {hidden_size: 64}"
    if meta.get("choices"):
        return f"use one of {[c for c in meta['choices'] if c is not None]}"
    if tp is bool:
        return "write true or false (YAML 1.2: yes/no/on/off are strings, not booleans)"
    return None


def check_value(value, tp, meta: Mapping, path: str):
    """``value`` checked and normalized against type ``tp`` and the field's ``meta``; raises
    CPConfigError naming ``path``."""
    if meta.get("parse") is not None:
        return meta["parse"](value, path)
    tp, optional = _split_optional(tp)
    if value is None:
        if optional:
            return None
        raise _type_error(tp, meta, path, value, optional)
    if tp is Any:
        out = value
    elif tp is bool:
        if not isinstance(value, bool):
            raise _type_error(tp, meta, path, value, optional)
        out = value
    elif tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _type_error(tp, meta, path, value, optional)
        out = value
    elif tp is float:
        if isinstance(value, str) and EXP_FLOAT.match(value.strip()):
            value = float(value.strip().replace("_", ""))
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _type_error(tp, meta, path, value, optional)
        out = float(value)
        if not math.isfinite(out):
            raise CPConfigError(path, f"must be a finite number, got {out!r}", fix="write a finite number")
    elif tp is str:
        if isinstance(value, os.PathLike):  # pathlib.Path from Python callers
            value = os.fspath(value)
        if not isinstance(value, str):
            raise _type_error(tp, meta, path, value, optional)
        out = value
    elif tp is dict:
        if not isinstance(value, Mapping):
            raise _type_error(tp, meta, path, value, optional)
        out = dict(value)
    elif typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise _type_error(tp, meta, path, value, optional)
        out = tuple(check_value(v, a, {}, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    else:  # pragma: no cover - a schema bug, not a user error
        raise TypeError(f"{path}: unsupported schema type {tp!r}")
    _check_bounds(out, meta, path, optional)
    return out


def _check_bounds(value, meta: Mapping, path: str, optional: bool) -> None:
    ge, gt, choices = meta.get("ge"), meta.get("gt"), meta.get("choices")
    le, lt = meta.get("le"), meta.get("lt")
    if (ge is not None and value < ge or gt is not None and not value > gt
            or le is not None and value > le or lt is not None and not value < lt):
        kind = "an integer" if isinstance(value, int) else "a number"
        raise CPConfigError(path, f"must be {kind}{_bounds(meta)}{' or null' if optional else ''}, got {value!r}")
    if choices:
        probe = value.lower() if meta.get("case_insensitive") and isinstance(value, str) else value
        if probe not in choices:
            raise CPConfigError(path, f"unknown value {value!r}",
                                fix=f"use one of {[c for c in choices if c is not None]}"
                                    + (" or omit it" if None in choices else ""))
    fixed = meta.get("fixed", dataclasses.MISSING)
    if fixed is not dataclasses.MISSING and value != fixed:
        raise CPConfigError(path, f"{meta.get('fixed_reason') or f'is fixed at {fixed!r}'}, got {value!r}")


# ----------------------------------------------------------------------------- sections
def load_section(cls, data, path: str, *, forbidden: Mapping[str, str] | None = None,
                 forbidden_fix: str | None = None):
    """An instance of dataclass ``cls`` from ``data`` (a mapping, or None for all defaults).

    Refuses a non-mapping, keys in ``forbidden`` (``{key: why}``, with ``forbidden_fix``) and
    unknown keys; every given field is checked with :func:`check_value`, then the instance's
    ``check_fields(path)`` hook (cross-field rules) runs when the class defines one.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise CPConfigError(path, f"must be a mapping of its fields, {_got(data)}",
                            fix=f"write it as '{path.rsplit('.', 1)[-1]}:' followed by indented 'key: value' lines")
    for key in data:
        if forbidden and key in forbidden:
            raise CPConfigError(f"{path}.{key}", f"'{key}' is not a field of {path}: {forbidden[key]}",
                                fix=forbidden_fix)
    known = [f.name for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")]
    unknown = sorted(set(data) - set(known), key=str)
    if unknown:
        raise CPConfigError(f"{path}.{unknown[0]}", f"unknown key(s) {unknown}",
                            fix=f"use only {sorted(known)} (check for typos)")
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _field_value(data[f.name], hints[f.name], f, f"{path}.{f.name}")
    obj = cls(**kwargs)
    if hasattr(obj, "check_fields"):
        obj.check_fields(path)
    return obj


def check_section(obj, path: str) -> None:
    """Re-check (and normalize in place) every field of a dataclass instance built in Python."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        if f.init and "help" in f.metadata:
            setattr(obj, f.name, _field_value(getattr(obj, f.name), hints[f.name], f, f"{path}.{f.name}",
                                              recheck=True))
    if hasattr(obj, "check_fields"):
        obj.check_fields(path)


def _field_value(value, tp, f: dataclasses.Field, path: str, recheck: bool = False):
    if dataclasses.is_dataclass(tp):
        if recheck and isinstance(value, tp):
            check_section(value, path)
            return value
        return load_section(tp, value, path, **getattr(tp, "_schema_load_kwargs", {}))
    return check_value(value, tp, f.metadata, path)


# ----------------------------------------------------------------------------- description
@dataclasses.dataclass
class FieldInfo:
    """One leaf field of the schema, for ``--help`` and the generated docs."""

    path: str      # dotted: optimizer.lr
    type: str      # "float > 0", "int >= 1 | null", "adamw | sgd"
    default: str   # YAML spelling of the default
    help: str


def _yaml_scalar(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(_yaml_scalar(v) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, dict)) and not value:
        return "[]" if isinstance(value, list) else "{}"
    return str(value)


def _type_text(tp, meta: Mapping) -> str:
    if meta.get("type_name"):
        return meta["type_name"]
    tp, optional = _split_optional(tp)
    choices = meta.get("choices")
    if choices:
        text = " | ".join(str(c) for c in choices if c is not None)
    elif meta.get("fixed", dataclasses.MISSING) is not dataclasses.MISSING:
        text = f"{getattr(tp, '__name__', tp)} = {meta['fixed']!r}"
    elif typing.get_origin(tp) is tuple:
        text = "[" + ", ".join(getattr(a, "__name__", str(a)) for a in typing.get_args(tp)) + "]"
    elif tp is dict:
        text = "mapping"
    elif tp is bool:
        text = "bool"
    else:
        text = getattr(tp, "__name__", str(tp)) + _bounds(meta)
    return text + (" | null" if optional else "")


def describe_fields(cls, prefix: str = "") -> list[FieldInfo]:
    """Every leaf field of dataclass ``cls`` (nested dataclass fields expanded), in declaration order."""
    hints = _hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init or "help" not in f.metadata and not dataclasses.is_dataclass(hints[f.name]):
            continue
        path = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.extend(describe_fields(tp, path + "."))
            continue
        if f.metadata.get("shown_default") is not None:
            default = f.metadata["shown_default"]
        elif f.default is not dataclasses.MISSING:
            default = _yaml_scalar(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = _yaml_scalar(f.default_factory())
        else:
            default = "(required)"
        out.append(FieldInfo(path, _type_text(tp, f.metadata), default, f.metadata["help"]))
    return out
