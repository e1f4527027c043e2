"""The trainer's YAML text layer: YAML 1.2 parsing (:func:`load_yaml_text`: floats such as ``3e-4``,
only ``true``/``false`` booleans, duplicate keys refused), ``dotted.key=value`` overrides applied to
the plain data (:func:`apply_overrides`) and the override named in a schema error
(:func:`blame_override`). The schema itself is :mod:`.config`; docs/trainer.md."""
from __future__ import annotations

import re
from typing import Mapping, Sequence

import yaml

from ..distributed.errors import CPConfigError

__all__ = ["SECTIONS", "load_yaml_text", "apply_overrides", "blame_override"]

#: the top-level sections of a trainer YAML file (the schema, :class:`.config.TrainerConfig`, has one field each)
SECTIONS = ("model", "data", "optimizer", "schedule", "loss", "accelerator", "plan_overrides", "logging")


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML's SafeLoader read the YAML 1.2 way where 1.1 differs in a way that changes a value:
    ``3e-4`` / ``1E5`` (exponent without a dot) are floats, as in YAML 1.2 and JSON, not strings;
    only ``true`` / ``false`` (any case) are booleans — ``yes`` / ``no`` / ``on`` / ``off`` stay
    strings, so a boolean field given one of them is refused by the schema naming the field."""


_BOOL_TAG = "tag:yaml.org,2002:bool"
_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Yaml12Loader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"), list("-+0123456789"))


def load_yaml_text(text: str, where: str = "<root>"):
    """Parse YAML text as plain data (safe: no Python objects), YAML 1.2 floats. A key given twice
    in one mapping (a section repeated, the same field twice) raises CPConfigError naming its dotted
    path and both lines instead of letting the last one silently win (``where``: the field an
    override's value belongs to)."""
    loader = _Yaml12Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicate_keys(node, "" if where == "<root>" else where)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _refuse_duplicate_keys(node, path: str) -> None:
    if isinstance(node, yaml.MappingNode):
        seen = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            field = f"{path}.{key}" if path else str(key)
            if key is not None:
                if key in seen:
                    raise CPConfigError(field, f"is given twice (lines {seen[key] + 1} and "
                                        f"{key_node.start_mark.line + 1}); YAML would keep the last one silently",
                                        fix="keep one of them (merge the two into one)")
                seen[key] = key_node.start_mark.line
            _refuse_duplicate_keys(value_node, field)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, f"{path}[{i}]")


def apply_overrides(data: Mapping | None, overrides: Sequence[str], sections: Sequence[str] = SECTIONS) -> dict:
    """Apply ``dotted.key=value`` overrides (value parsed as YAML, as in the file) to nested plain
    data; the result is then loaded by the schema like the file itself.

    Missing intermediate sections are created; a key that would descend into a value that is not
    a mapping (``optimizer.lr.x=1``, ``plan_overrides.0.match=...``) is refused naming the field.
    """
    if data is not None and not isinstance(data, Mapping):
        raise CPConfigError("<root>", f"the YAML document must be a mapping of sections, got {_kind_of(data)}",
                            fix="write the sections as top-level keys: " + ", ".join(sections))
    data = dict(data or {})
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            raise CPConfigError(str(item), "a command-line override must look like key.path=value",
                                fix="e.g. optimizer.lr=3e-4 (see hyper-train --help for the fields)")
        key, raw = item.split("=", 1)
        key = key.strip()
        parts = key.split(".")
        if not key or any(not p for p in parts):
            raise CPConfigError(key or "<override>", f"override {item!r} has an empty field name",
                                fix="write the dotted field path, e.g. optimizer.lr=3e-4")
        try:
            value = load_yaml_text(raw, key) if raw.strip() else None
        except yaml.YAMLError as exc:
            raise CPConfigError(key, f"the override value {raw!r} is not valid YAML ({exc.__class__.__name__})",
                                fix="quote it or write a YAML value, e.g. [0.9, 0.95]") from None
        node = data
        for depth, part in enumerate(parts[:-1]):
            nxt = node.get(part)
            if nxt is not None and not isinstance(nxt, Mapping):
                where = ".".join(parts[:depth + 1])
                raise CPConfigError(where, f"is {_kind_of(nxt)}, so the override {item!r} cannot set a field "
                                    "inside it", fix=f"override the whole value: {where}=<YAML value>")
            nxt = dict(nxt or {})
            node[part] = nxt
            node = nxt
        node[parts[-1]] = value
    return data


def _kind_of(value) -> str:
    if isinstance(value, list):
        return "a list"
    return f"a {type(value).__name__} ({value!r})"


def blame_override(exc: CPConfigError, overrides: Sequence[str]) -> CPConfigError:
    """``exc`` with the override that set its field (if any) named in the problem."""
    for item in reversed(list(overrides)):
        key = item.split("=", 1)[0].strip()
        field = re.sub(r"\[\d+\]", "", exc.field)
        if field == key or field.startswith(key + ".") or key.startswith(field + "."):
            return type(exc)(exc.field, f"{exc.problem} (from the command-line override {item!r})",
                             module=exc.module, fix=exc.fix)
    return exc
