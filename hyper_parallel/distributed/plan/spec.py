"""ModuleShardingSpec: one ``plan_overrides`` entry, parsed and shape-checked.

YAML form (every key is checked; unknown keys are rejected)::

    - match: "*.self_attn"        # fnmatch glob over module FQNs (required)
      when: cp                    # only applies when accelerator.cp_size > 1
      region_dispatch: false      # required (and false) for every CP method
      inner_target: self          # "self" or a dotted attribute path below the matched module
      inner_wrapper: sdpa_hf      # registry name, or {_target_: dotted.path, **named_params}
      # local_compute_fn: {_target_: my.fn}   # exclusive with inner_wrapper

The Python API accepts a mapping ``{fqn_glob: ModuleShardingSpec(...)}`` or a
list of specs with ``match`` set; :func:`parse_plan_overrides` is the one place either form is
normalised.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from ..errors import CPConfigError

SPEC_KEYS = ("match", "when", "inner_target", "inner_wrapper", "local_compute_fn", "region_dispatch")
WHEN_VALUES = ("cp",)


@dataclasses.dataclass
class TargetRef:
    """A callable named either by registry name or by ``_target_`` import path, plus params."""

    name: str | None = None
    target: str | None = None
    params: dict = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        if self.name is not None:
            return self.name
        extra = "".join(f", {k}={v!r}" for k, v in self.params.items())
        return f"_target_={self.target}{extra}"

    @classmethod
    def parse(cls, value: Any, field: str) -> "TargetRef | None":
        if value is None:
            return None
        if isinstance(value, TargetRef):
            return value
        if isinstance(value, str):
            if not value.strip():
                raise CPConfigError(field, "is an empty string", fix="give a registry name or a {_target_: ...} mapping")
            if "." in value:
                return cls(target=value)
            return cls(name=value)
        if callable(value):
            return cls(target=f"{value.__module__}.{value.__qualname__}")
        if isinstance(value, Mapping):
            if "_target_" not in value:
                raise CPConfigError(
                    field, f"mapping without '_target_' (keys: {sorted(value)})",
                    fix="write {_target_: package.module.function, <named params>} or a registry name",
                )
            target = value["_target_"]
            if not isinstance(target, str) or "." not in target:
                raise CPConfigError(f"{field}._target_", f"must be a dotted import path, got {target!r}")
            params = {k: v for k, v in value.items() if k != "_target_"}
            return cls(target=target, params=params)
        raise CPConfigError(field, f"must be a registry name or a {{_target_: ...}} mapping, got {type(value).__name__}")


@dataclasses.dataclass
class ModuleShardingSpec:
    inner_target: str | None = None
    inner_wrapper: Any = None
    local_compute_fn: Any = None
    region_dispatch: bool | None = None
    when: str | None = None
    match: str | None = None
    # index in the YAML list, used in error messages (plan_overrides[i])
    index: int | None = None

    def field(self, key: str | None = None) -> str:
        base = f"plan_overrides[{self.index}]" if self.index is not None else f"plan_overrides[{self.match!r}]"
        return f"{base}.{key}" if key else base

    def __post_init__(self):
        self.inner_wrapper = TargetRef.parse(self.inner_wrapper, self.field("inner_wrapper"))
        self.local_compute_fn = TargetRef.parse(self.local_compute_fn, self.field("local_compute_fn"))

    @property
    def declares_cp_method(self) -> bool:
        return self.inner_wrapper is not None or self.local_compute_fn is not None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], index: int) -> "ModuleShardingSpec":
        field = f"plan_overrides[{index}]"
        if not isinstance(data, Mapping):
            raise CPConfigError(field, f"each entry must be a mapping, got {type(data).__name__}")
        unknown = sorted(set(data) - set(SPEC_KEYS))
        if unknown:
            raise CPConfigError(f"{field}.{unknown[0]}", f"unknown key(s) {unknown}",
                                fix=f"use only {list(SPEC_KEYS)} (check for typos)")
        if "match" not in data or not isinstance(data["match"], str) or not data["match"]:
            raise CPConfigError(f"{field}.match", "is required: a glob over module FQNs such as '*.self_attn'")
        when = data.get("when")
        if when is not None and when not in WHEN_VALUES:
            raise CPConfigError(f"{field}.when", f"unknown value {when!r}", fix="use 'when: cp' or omit it")
        rd = data.get("region_dispatch")
        if rd is not None and not isinstance(rd, bool):
            raise CPConfigError(f"{field}.region_dispatch", f"must be true or false, got {rd!r}")
        it = data.get("inner_target")
        if it is not None and (not isinstance(it, str) or not it):
            raise CPConfigError(f"{field}.inner_target", f"must be 'self' or an attribute path, got {it!r}")
        return cls(match=data["match"], when=when, inner_target=it,
                   inner_wrapper=data.get("inner_wrapper"), local_compute_fn=data.get("local_compute_fn"),
                   region_dispatch=rd, index=index)


def parse_plan_overrides(value: Any) -> list[ModuleShardingSpec]:
    """Parse ``plan_overrides`` into specs with ``match`` and ``index`` set: the YAML list (dicts or
    specs; a spec keeps an index it already has) or the Python mapping form ``{glob: spec}``,
    whose entries that declare a CP method default to ``when: cp`` (the design's snippet omits it)."""
    if value is None:
        return []
    if isinstance(value, Mapping):
        specs = []
        for i, (pattern, spec) in enumerate(value.items()):
            if isinstance(spec, ModuleShardingSpec):
                when = spec.when or ("cp" if spec.declares_cp_method else None)
                spec = dataclasses.replace(spec, match=spec.match or pattern, index=i, when=when)
            else:
                spec = dict(spec)
                if "when" not in spec and (spec.get("inner_wrapper") is not None
                                           or spec.get("local_compute_fn") is not None):
                    spec["when"] = "cp"
                spec = ModuleShardingSpec.from_dict({"match": pattern, **spec}, i)
            specs.append(spec)
        return specs
    if isinstance(value, Sequence) and not isinstance(value, str):
        out = []
        for i, item in enumerate(value):
            if isinstance(item, ModuleShardingSpec):
                out.append(item if item.index is not None else dataclasses.replace(item, index=i))
            else:
                out.append(ModuleShardingSpec.from_dict(item, i))
        return out
    raise CPConfigError("plan_overrides", f"must be a list of entries, got {type(value).__name__}")
