"""Rules read off the catalogue rows: name/alias lookup, batch policies, the degree and head
rules, and the entry-point tables. No collective; imports only :mod:`.rows`."""
from __future__ import annotations

from typing import Iterable, Optional

from .rows import (_ALIASES, ADAPTER_ARCHS, ASYNC_ADAPTER_MODULES, BALANCED, CONTIGUOUS, HEAD_TAIL, METHODS, STYLES,
                   CPMethod, async_entry_name)


def method_names(kind: str = "attention") -> tuple:
    """Canonical names of the rows of ``kind`` in catalogue order."""
    return tuple(m.name for m in METHODS.values() if m.kind == kind)


def attention_methods() -> list:
    return [m for m in METHODS.values() if m.kind == "attention"]


def mixer_methods() -> list:
    return [m for m in METHODS.values() if m.kind == "mixer"]


def gathers_kv(row: CPMethod) -> bool:
    """The attention all-gathers K/V over the whole CP group, Colossal-style (its heads are not
    split: ``head_rule`` "gqa"): colossal, Head-Tail, the balanced split."""
    return row.kind == "attention" and row.head_rule == "gqa"


def gathers_kv_only(row: CPMethod) -> bool:
    """:func:`gathers_kv` with the K/V gather as the only forward exchange: the queries stay on
    their rank (every layout but Head-Tail, which dispatches them): colossal, the balanced split."""
    return gathers_kv(row) and row.layout != HEAD_TAIL


def has_ulysses_degree(row: CPMethod) -> bool:
    """A Ulysses group of a named degree inside the CP group, Colossal across the groups
    (``head_rule`` "split", ``degree`` "param"): Hybrid and Hybrid on the balanced split."""
    return row.kind == "attention" and row.head_rule == "split" and row.degree == "param"


def splits_heads_over_cp(row: CPMethod) -> bool:
    """The heads are split over the whole CP group, no K/V gather (``head_rule`` "split", ``degree``
    "cp"): pure Ulysses."""
    return row.kind == "attention" and row.head_rule == "split" and row.degree == "cp"


def uses_balanced_permutation(row: CPMethod) -> bool:
    """The batch is on the work-balanced permutation (``layout`` "balanced")."""
    return row.layout == BALANCED


def token_layout(policy: str) -> Optional[str]:
    """The token layout (:data:`.rows.CONTIGUOUS` | ``HEAD_TAIL`` | ``BALANCED``) of batch policy
    ``policy`` when its methods keep every head on every rank and split only the tokens; None for a
    policy whose methods split heads (Ulysses, Hybrid) or an unknown one."""
    layouts = {m.layout for m in attention_methods() if m.batch_policy == policy and m.head_rule == "gqa"}
    return layouts.pop() if len(layouts) == 1 else None


def reorders(row: CPMethod) -> bool:
    """The method's batch is not in the contiguous layout (Head-Tail, the balanced split)."""
    return row.layout != CONTIGUOUS


def get_method(name: str, kind: Optional[str] = "attention") -> CPMethod:
    """The row for a method name or alias (of ``kind``; None: any); ValueError lists the names."""
    key = _ALIASES.get(name) if isinstance(name, str) else None
    row = METHODS.get(key) if key else None
    if row is None or (kind is not None and row.kind != kind):
        known = sorted(a for a, n in _ALIASES.items() if kind is None or METHODS[n].kind == kind)
        raise ValueError(f"unknown CP method {name!r}; expected one of {known}")
    return row


def wrapper_styles() -> tuple:
    """``WrapperInfo.style`` values: the built-in styles' plus "model" (adapters) and "custom"."""
    out = []
    for s in STYLES.values():
        if s.registry_style not in out:
            out.append(s.registry_style)
    return tuple(out) + ("model", "custom")


# ---------------------------------------------------------------------------- batch
def batch_policies() -> dict:
    """``shard_batch_for_cp`` policy strings -> (policy name, length factor): every attention
    method's policy, canonical name and aliases."""
    out: dict = {}
    for m in attention_methods():
        for key in (m.batch_policy, m.name) + m.aliases:
            out[key] = (m.batch_policy, m.length_factor)
    return out


def method_policies() -> dict:
    """Attention method -> its batch policy."""
    return {m.name: m.batch_policy for m in attention_methods()}


def batch_policy_for(methods: Iterable[str]) -> str:
    """The one batch policy of a model whose attention wrappers use ``methods`` (the caller has
    refused incompatible layouts): the latest catalogue row among them; "all_gather" for custom
    wrappers and mixers (contiguous layout)."""
    order = [m.name for m in attention_methods()]
    rows = [METHODS[_ALIASES[m]] for m in methods if m in _ALIASES and METHODS[_ALIASES[m]].kind == "attention"]
    if not rows:
        return "all_gather"
    return max(rows, key=lambda r: order.index(r.name)).batch_policy


# ---------------------------------------------------------------------------- rules
def check_degree(method, cp_size: Optional[int], degree, who: str = "") -> None:
    """The degree rule of ``method`` (row or name): raise ValueError naming the fix.

    "none": no ``ulysses_degree`` (or 1); "cp": None or exactly ``cp_size``; "param": an int
    with ``1 < degree < cp_size`` and ``cp_size % degree == 0``. ``cp_size`` None: only the
    parts that do not need it are checked. No collective.
    """
    row = method if isinstance(method, CPMethod) else get_method(method)
    pre = f"{who}: " if who else ""
    if row.degree == "none":
        if degree not in (None, 1):
            raise ValueError(
                f"{pre}{row.title} CP takes no ulysses_degree (got ulysses_degree={degree}): Ulysses or Hybrid "
                "combined with Head-Tail is not supported; pick one wrapper per attention")
    elif row.degree == "cp":
        if degree is not None and cp_size is not None and degree != cp_size:
            raise ValueError(f"{pre}pure Ulysses uses ulysses_degree == cp_size={cp_size}, got "
                             f"ulysses_degree={degree}; use method='hybrid' for a smaller degree")
    elif row.degree == "param":
        p = row.degree_param
        if degree is None:
            raise ValueError(f"{pre}method='{row.name}' needs {p} (1 < {p} < cp_size)")
        if isinstance(degree, bool) or not isinstance(degree, int):
            raise ValueError(f"{pre}{p} must be an integer, got {degree!r}")
        if cp_size is not None and (not 1 < degree < cp_size or cp_size % degree):
            raise ValueError(
                f"{pre}Hybrid needs 1 < {p} < cp_size and cp_size % {p} == 0, got {p}={degree}, "
                f"cp_size={cp_size} (use the Ulysses wrapper for {p} == cp_size, the colossal wrapper for 1)")


def head_split(method, cp_size: int, degree=None) -> Optional[tuple]:
    """(degree, label) the heads of a "split" method are split over; None for other head rules.

    A "split" method's heads go to the ranks of its Ulysses group as
    ``methods.ulysses.layout.ulysses_head_layout(Hq, Hk, degree)`` decides: any GQA ratio with
    ``Hq >= degree``; counts that do not divide the degree are split unevenly (differing by at
    most one) and KV heads fewer than the degree are replicated to the ranks that use them."""
    row = method if isinstance(method, CPMethod) else get_method(method)
    if row.head_rule != "split":
        return None
    if row.degree == "cp":
        return cp_size, "cp_size (ulysses_degree)"
    return degree, row.degree_param


# ---------------------------------------------------------------------------- entry points
def offers(kind: Optional[str] = "attention") -> list:
    """Every (row, offer) with an entry point, in catalogue order."""
    return [(m, o) for m in METHODS.values() if kind is None or m.kind == kind for o in m.offers if o.entry]


def _find_entry(entry: str):
    for m, o in offers(None):
        if o.entry == entry:
            return m, o
    raise KeyError(f"{entry!r} is not an entry point of the CP method catalogue")


def entry_meta(entry: str) -> dict:
    """``{"method": CPMethod, "style": Style, "offer": Offer}`` of a built-in entry point."""
    m, o = _find_entry(entry)
    return {"method": m, "style": STYLES[o.style], "offer": o}


def async_methods() -> list:
    """The attention rows with async variants, in catalogue order."""
    return [m for m in attention_methods() if m.async_targets]


def async_adapters() -> tuple:
    """The model types whose async adapter has registered (``models/<model_type>/async_cp.py``)."""
    return tuple(ADAPTER_ARCHS)


def async_targets(row: CPMethod) -> tuple:
    """Every async ``_target_`` path of ``row``: its generic one, then each registered adapter's
    ``<arch>_async_<method>_cp_wrapper`` at the adapter's public module."""
    if not row.async_targets:
        return ()
    return tuple(row.async_targets) + tuple(f"{ASYNC_ADAPTER_MODULES[a]}.{async_entry_name(row.name, a)}"
                                            for a in ADAPTER_ARCHS)


def entry_params(method: CPMethod, is_async: bool = False) -> tuple:
    """(required, optional) named parameters of the method's entry points after the five mesh
    parameters: the degree parameter (required) and, async, the pipeline depth (default None)."""
    required = (method.degree_param,) if method.degree == "param" else ()
    optional = (method.async_param,) if is_async and method.async_param else ()
    return required, optional


def builtin_modules() -> tuple:
    """Modules whose import registers the built-in YAML names (in catalogue order)."""
    out = []
    for _m, o in offers(None):
        if o.registry_name and o.module not in out:
            out.append(o.module)
    return tuple(out)


def builtin_names(kind: Optional[str] = None) -> dict:
    """YAML short name -> ``_target_`` path of every built-in entry point that has one."""
    return {o.registry_name: o.target for _m, o in offers(kind) if o.registry_name}


_ROW_PACKAGE = "hyper_parallel.distributed.context_parallel"   # where a built-in row's "module:ATTR" paths start


def _resolve(path: str):
    """The object at ``"module:ATTR"``: the module relative to the context_parallel package (the
    built-in rows), else an absolute module name (a row added by ``context_parallel.extension``)."""
    import importlib

    module, attr = path.split(":")
    relative = f"{_ROW_PACKAGE}.{module}"
    try:
        mod = importlib.import_module(relative)
    except ModuleNotFoundError as exc:
        if not f"{relative}.".startswith(f"{exc.name}."):   # a module it imports is missing: a real error
            raise
        mod = importlib.import_module(module)
    return getattr(mod, attr)


def cost_model(method: Optional[str]):
    """The :class:`~..cost_model.CostModel` the row of ``method`` (a name or alias) names; a custom
    wrapper's (nothing known but the full K/V in flight) for None, ``"custom"`` or an unknown name."""
    key = _ALIASES.get(method) if isinstance(method, str) else None
    path = METHODS[key].cost if key else None
    if path is None:
        from ..cost_model import CostModel

        return CostModel()
    return _resolve(path)


def async_plan_builder(row: CPMethod):
    """The row's ``async_plan(method, strategy_cls, mesh, cp_mesh, ulysses_degree) -> AsyncPlan``
    (``methods/<method>/async_.py``), or None for a row without async variants."""
    return _resolve(row.async_plan) if row.async_plan else None
