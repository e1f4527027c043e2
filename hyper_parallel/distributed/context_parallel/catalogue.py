"""The CP method catalogue: every CP method is one row, and everything else reads it.

A row (:class:`CPMethod`) says, for one method: its public name and aliases, the sync strategy
class that computes it, the batch it needs (``shard_batch_for_cp`` policy, layout and sequence
length multiple), its head rule and degree rule, sync/async, and for every calling style
(:data:`STYLES`) the public entry point that offers it — or why it is not offered. Readers:

* :mod:`.registry` — the method names ``@inner_wrapper(method=...)`` accepts, the wrapper styles,
  and the modules that register built-in names (:func:`builtin_modules`);
* :mod:`.strategies.factory` — name/alias resolution, strategy class, degree rule;
* :mod:`.batch` — the padding policies and their length multiple (:func:`batch_policies`);
* :mod:`..plan.planner` — one batch policy per model (:func:`batch_policy_for`), which methods
  reorder the sequence (``layout``) and cannot be mixed;
* :mod:`.wrappers` — the entry points (:func:`entry_meta`), the head and degree checks
  (:func:`check_degree`, :func:`head_split`);
* docs/wrappers.md — the support matrix is :func:`support_matrix_markdown` verbatim (a test
  compares them).

Pure data plus small rule functions; imports nothing from the package (any module may read it
without an import cycle). Adding a method = adding a row (plus its strategy / entry functions);
a test enumerates the rows and runs every offered entry end to end.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

__all__ = ["Style", "Offer", "CPMethod", "STYLES", "METHODS", "WRAPPERS_MODULE", "MIXERS_MODULE", "MAMBA2_FAMILIES",
           "get_method", "attention_methods", "mixer_methods", "method_names", "wrapper_styles",
           "batch_policies", "method_policies", "batch_policy_for", "check_degree", "head_split", "offers",
           "entry_meta", "async_methods", "entry_params", "adapter_module", "async_entry_name",
           "builtin_modules", "builtin_names", "entry_table_markdown", "support_matrix_markdown"]

WRAPPERS_MODULE = "hyper_parallel.distributed.context_parallel.wrappers"
MIXERS_MODULE = "hyper_parallel.distributed.context_parallel.mixers"
GDN_MODULE = "hyper_parallel.models.qwen3_next.gated_deltanet"
MAMBA2_MODULE = "hyper_parallel.distributed.context_parallel.mixers.mamba2"
DSA_MODULE = "hyper_parallel.models.deepseek_v32.dsa"
DOGE_MODULE = "hyper_parallel.models.doge.dynamic_mask"
#: the Mamba2 mixer classes ``mamba2_state_passing`` is exact for -> the model type whose
#: ``hyper_parallel.models.<model_type>.mamba2`` holds the family's ``MAMBA2_SPEC`` (the one list)
MAMBA2_FAMILIES = {
    "FalconH1Mixer": "falcon_h1",
    "BambaMixer": "bamba",
    "NemotronHMamba2Mixer": "nemotron_h",
    "GraniteMoeHybridMambaLayer": "granitemoehybrid",
    "Zamba2MambaMixer": "zamba2",
}
# models whose adapter implements the async handoff protocol (models/<arch>/adapter/distributed/)
ASYNC_ADAPTERS = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe")




def adapter_module(arch: str) -> str:
    """The module of model ``arch``'s async adapter Targets (a public ``_target_`` prefix)."""
    return f"hyper_parallel.models.{arch}.adapter.distributed.context_parallel_async"


def async_entry_name(method: str, arch: Optional[str] = None) -> str:
    """``async_<method>_cp_wrapper`` (generic) or ``<arch>_async_<method>_cp_wrapper`` (adapter)."""
    return f"{arch + '_' if arch else ''}async_{method}_cp_wrapper"


def _async_targets(method: str) -> tuple:
    """The generic async Target of ``method`` (any attention with the handoff protocol) and each
    adapter's named one."""
    return (f"{WRAPPERS_MODULE}.{async_entry_name(method)}",) + tuple(
        f"{adapter_module(a)}.{async_entry_name(method, a)}" for a in ASYNC_ADAPTERS)


@dataclasses.dataclass(frozen=True)
class Style:
    """An attention calling convention a built-in wrapper adapts (one column of the matrix)."""

    name: str            # catalogue key: "hf" | "qkv" | "flex_hf" | "flex_qkv"
    prefix: str          # entry-point / registry-name prefix: "sdpa_hf", ...
    registry_style: str  # WrapperInfo.style: "hf" | "qkv" | "flex"
    primitive: str       # what is intercepted: "hf_any" | "sdpa" | "hf_interface" | "flex_direct"
    forward: str         # the module forward it binds: "hf" (hidden_states) | "qkv" (q, k, v)
    kind: str            # words for messages: "SDPA" | "FlexAttention"
    description: str


STYLES: dict = {s.name: s for s in (
    Style("hf", "sdpa_hf", "hf", "hf_any", "hf", "SDPA",
          "HF attention `forward(hidden_states, ...)`, attn_implementation sdpa/eager"),
    Style("qkv", "sdpa_qkv", "qkv", "sdpa", "qkv", "SDPA",
          "core attention `forward(q, k, v, ...)` calling SDPA"),
    Style("flex_hf", "flex_hf", "flex", "hf_interface", "hf", "FlexAttention",
          "HF attention, attn_implementation flex_attention"),
    Style("flex_qkv", "flex_qkv", "flex", "flex_direct", "qkv", "FlexAttention",
          "core module `forward(q, k, v, block_mask=None, scale=None)` around flex_attention"),
)}


@dataclasses.dataclass(frozen=True)
class Offer:
    """One cell of the matrix: ``entry`` (function name in ``module``) or ``reason`` it is absent."""

    style: str
    entry: Optional[str] = None
    registry_name: Optional[str] = None   # YAML short name; None = usable as a `_target_` only
    reason: Optional[str] = None          # why no entry (the docs print it)
    module: str = WRAPPERS_MODULE

    @property
    def target(self) -> Optional[str]:
        return f"{self.module}.{self.entry}" if self.entry else None


@dataclasses.dataclass(frozen=True)
class CPMethod:
    """One CP method. ``kind`` "attention" (a strategy behind the built-in attention wrappers) or
    "mixer" (a token-mixer method of :mod:`.mixers`, declared on a non-attention module)."""

    name: str
    title: str                       # words for messages and docs
    kind: str = "attention"
    aliases: tuple = ()
    strategy: Optional[str] = None   # class name in .strategies.<strategy_module>
    strategy_module: Optional[str] = None
    batch_policy: str = "all_gather"  # shard_batch_for_cp policy
    layout: str = "contiguous"       # "contiguous": rank r holds tokens [r*S/C, (r+1)*S/C); "head_tail": reordered
    length_factor: int = 1           # S is padded to a multiple of length_factor * cp_size
    head_rule: str = "gqa"           # "gqa": Hq % Hk == 0 | "split": heads split over the degree (ulysses_layout) | "module"
    head_doc: str = ""
    degree: str = "none"             # "none": no degree | "cp": degree == cp_size | "param": named parameter
    degree_param: Optional[str] = None
    degree_doc: str = ""
    async_targets: tuple = ()        # model-specific async variants (`_target_` paths)
    async_reason: str = ""           # why there is none / which models
    async_param: Optional[str] = None  # the async Targets' pipeline-depth parameter (default None)
    async_doc: str = ""              # one line: what the async variant launches and where it waits
    offers: tuple = ()               # Offer per style


_NO_FLEX = ("not offered: no flex entry point has been written and parity-tested for {m} yet (the strategy "
            "itself does not depend on the style); use the {m} wrapper of the sdpa_hf / sdpa_qkv style, or a "
            "custom wrapper")

METHODS: dict = {m.name: m for m in (
    CPMethod(
        name="colossal", title="colossal (AllGather)", aliases=("all_gather",), strategy="AllGatherStrategy",
        strategy_module="all_gather", batch_policy="all_gather", head_rule="gqa",
        head_doc="any GQA ratio (Hq % Hk == 0)",
        degree="none", degree_doc="no degree",
        async_targets=_async_targets("colossal"),
        async_reason="handoff-protocol adapters: " + ", ".join(ASYNC_ADAPTERS), async_param="kv_chunks",
        async_doc="K/V AllGather launched at the K/V handoffs in ``kv_chunks`` sequence chunks, pipelined "
                  "through the attention (LSE merge); ReduceScatter per chunk in backward",
        offers=(Offer("hf", "sdpa_hf_cp_wrapper", "sdpa_hf"), Offer("qkv", "sdpa_qkv_cp_wrapper", "sdpa_qkv"),
                Offer("flex_hf", "flex_hf_cp_wrapper", "flex_hf"),
                Offer("flex_qkv", "flex_qkv_cp_wrapper", "flex_qkv"))),
    CPMethod(
        name="ulysses", title="pure Ulysses", strategy="UlyssesStrategy", strategy_module="ulysses",
        batch_policy="ulysses",
        head_rule="split",
        head_doc="Hq % Hk == 0 and Hq >= cp_size: uneven splits and Hk < cp_size (KV heads replicated) "
                 "accepted",
        degree="cp", degree_doc="ulysses_degree == cp_size (implicit)",
        async_targets=_async_targets("ulysses"),
        async_reason="handoff-protocol adapters: " + ", ".join(ASYNC_ADAPTERS), async_param="q_chunks",
        async_doc="K/V seq->head A2A launched at their handoffs, Q in ``q_chunks`` pipelined sequence chunks, "
                  "each chunk's output head->seq A2A launched after its attention; inverse A2As in backward",
        offers=(Offer("hf", "sdpa_hf_ulysses_cp_wrapper", "sdpa_hf_ulysses"),
                Offer("qkv", "sdpa_qkv_ulysses_cp_wrapper", "sdpa_qkv_ulysses"),
                Offer("flex_hf", "flex_hf_ulysses_cp_wrapper", "flex_hf_ulysses"),
                Offer("flex_qkv", "flex_qkv_ulysses_cp_wrapper", "flex_qkv_ulysses"))),
    CPMethod(
        name="hybrid", title="Hybrid (Ulysses x Colossal)", strategy="HybridStrategy", strategy_module="hybrid",
        batch_policy="hybrid",
        head_rule="split",
        head_doc="Hq % Hk == 0 and Hq >= ulysses_degree: uneven splits and Hk < ulysses_degree (KV heads "
                 "replicated) accepted",
        degree="param", degree_param="ulysses_degree",
        degree_doc="named parameter ulysses_degree: 1 < u < cp_size, cp_size % u == 0",
        async_targets=_async_targets("hybrid"),
        async_reason="handoff-protocol adapters: " + ", ".join(ASYNC_ADAPTERS), async_param="q_chunks",
        async_doc="K/V ulysses A2A chained into the colossal AllGather on the comm thread; Q / output ulysses "
                  "A2A per pipelined ``q_chunks`` chunk; backward mirrors every stage",
        offers=(Offer("hf", "sdpa_hf_hybrid_cp_wrapper"), Offer("qkv", "sdpa_qkv_hybrid_cp_wrapper"),
                Offer("flex_hf", reason=_NO_FLEX.format(m="Hybrid")),
                Offer("flex_qkv", reason=_NO_FLEX.format(m="Hybrid")))),
    CPMethod(
        name="load_balance", title="Head-Tail load balance", aliases=("head_tail",), strategy="HeadTailStrategy",
        strategy_module="head_tail", batch_policy="load_balance", layout="head_tail", length_factor=2,
        head_rule="gqa",        head_doc="any GQA ratio (Hq % Hk == 0)", degree="none", degree_doc="no degree",
        async_targets=_async_targets("load_balance"),
        async_reason="handoff-protocol adapters: " + ", ".join(ASYNC_ADAPTERS), async_param="q_chunks",
        async_doc="K/V AllGather launched at their handoffs; Q of both Head-Tail branches dispatched in "
                  "``q_chunks`` pipelined chunks, each chunk's combine launched after its attention",
        offers=(Offer("hf", "sdpa_hf_load_balance_cp_wrapper"), Offer("qkv", "sdpa_qkv_load_balance_cp_wrapper"),
                Offer("flex_hf", reason=_NO_FLEX.format(m="Head-Tail")),
                Offer("flex_qkv", reason=_NO_FLEX.format(m="Head-Tail")))),
    # token-mixer methods (context_parallel/mixers/, models/<model_type>/): declared on a non-attention module, contiguous
    # layout only; WrapperInfo.method is "custom" and mixer=True
    CPMethod(
        name="sequence_gather", title="sequence gather (any mixer)", kind="mixer", batch_policy="all_gather",
        head_rule="module", head_doc="none (the whole module runs on the gathered sequence)",
        offers=(Offer("hf", "sequence_gather_cp_wrapper", "sequence_gather", module=MIXERS_MODULE),)),
    CPMethod(
        name="short_conv_halo", title="short-conv halo exchange (LFM2)", kind="mixer", batch_policy="all_gather",
        head_rule="module", head_doc="none (kernel - 1 halo tokens from the previous rank)",
        offers=(Offer("hf", "short_conv_halo_cp_wrapper", "short_conv_halo", module=MIXERS_MODULE),)),
    CPMethod(
        name="gated_deltanet_ulysses", title="Gated DeltaNet Ulysses (Qwen3-Next, Qwen3.5)", kind="mixer",
        batch_policy="all_gather", head_rule="module",
        head_doc="linear key and value heads divisible by cp_size",
        offers=(Offer("hf", "gated_deltanet_ulysses_cp_wrapper", "gated_deltanet_ulysses", module=GDN_MODULE),)),
    CPMethod(
        name="gated_deltanet_state_passing", title="Gated DeltaNet state passing (Qwen3-Next, Qwen3.5)", kind="mixer",
        batch_policy="all_gather", head_rule="module",
        head_doc="none (all heads on the local tokens; cp may exceed the linear head counts)",
        offers=(Offer("hf", "gated_deltanet_state_passing_cp_wrapper", "gated_deltanet_state_passing",
                      module=GDN_MODULE),)),
    CPMethod(
        name="mamba2_state_passing", title="Mamba2 state passing (Falcon-H1, Bamba, NemotronH, Granite 4, Zamba2)",
        kind="mixer",
        batch_policy="all_gather", head_rule="module",
        head_doc="none (all heads on the local tokens)",
        offers=(Offer("hf", "mamba2_state_passing_cp_wrapper", "mamba2_state_passing", module=MAMBA2_MODULE),)),
    CPMethod(
        name="dsa_all_gather", title="DeepSeek sparse attention, indexer top-k over the gathered keys (DeepSeek V3.2, "
        "GLM-MoE-DSA)", kind="mixer", batch_policy="all_gather", head_rule="module",
        head_doc="none (all heads on the local queries; K, V and the indexer key gathered)",
        offers=(Offer("hf", "dsa_all_gather_cp_wrapper", "dsa_all_gather", module=DSA_MODULE),)),
    CPMethod(
        name="doge_dynamic_mask", title="Doge dynamic-mask attention, the per-key bias as a key channel over the "
        "gathered keys (Doge)", kind="mixer", batch_policy="all_gather", head_rule="module",
        head_doc="none (all heads on the local queries; K, V gathered); documents <= keep_window_size",
        offers=(Offer("hf", "doge_dynamic_mask_cp_wrapper", "doge_dynamic_mask", module=DOGE_MODULE),)),
)}

_ALIASES = {alias: m.name for m in METHODS.values() for alias in (m.name,) + m.aliases}


def method_names(kind: str = "attention") -> tuple:
    """Canonical names of the rows of ``kind`` in catalogue order."""
    return tuple(m.name for m in METHODS.values() if m.kind == kind)


def attention_methods() -> list:
    return [m for m in METHODS.values() if m.kind == "attention"]


def mixer_methods() -> list:
    return [m for m in METHODS.values() if m.kind == "mixer"]


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
    ``strategies.ulysses_layout.ulysses_head_layout(Hq, Hk, degree)`` decides: any GQA ratio with
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


# ---------------------------------------------------------------------------- docs
def _async_cell(m: CPMethod) -> str:
    """The matrix's async cell: the generic Target, then the adapters' named ones."""
    names = [t.rsplit(".", 1)[1] for t in m.async_targets]
    if not names:
        return m.async_reason
    generic = [n for n in names if n.startswith("async_")]
    adapters = [n for n in names if not n.startswith("async_")]
    return "; ".join(f"`{n}`" for n in generic) + (
        f" + adapters {', '.join(f'`{n}`' for n in adapters)}" if adapters else "")


def entry_table_markdown() -> str:
    """The list of sync entry points docs/wrappers.md prints (regenerate it with this function)."""
    lines = ["| registry name | `_target_` function | method (strategy) | style | named params |",
             "|---|---|---|---|---|"]
    for m, o in offers("attention"):
        required, _ = entry_params(m)
        params = ", ".join(f"`{p}` (required)" for p in required) or (
            "— (degree = cp_size)" if m.degree == "cp" else "—")
        reg = f"`{o.registry_name}`" if o.registry_name else "— (Target only)"
        lines.append(f"| {reg} | `{o.entry}` | {m.name} (`{m.strategy}`) | {STYLES[o.style].description} | "
                     f"{params} |")
    return "\n".join(lines)


def support_matrix_markdown() -> str:
    """The support matrix docs/wrappers.md prints (regenerate it with this function)."""
    cols = list(STYLES.values())
    lines = ["| method (aliases) | batch policy | heads | degree | async | "
             + " | ".join(f"`{s.prefix}*`" for s in cols) + " |",
             "|---|---|---|---|---|" + "---|" * len(cols)]
    notes = []
    for m in attention_methods():
        cells = []
        by_style = {o.style: o for o in m.offers}
        for s in cols:
            o = by_style.get(s.name)
            if o is None or not o.entry:
                notes.append(f"{m.name} x `{s.prefix}*`: {o.reason if o else 'not offered'}")
                cells.append(f"— [{len(notes)}]")
            else:
                cells.append(f"`{o.registry_name}`" if o.registry_name else f"`{o.entry}`")
        name = m.name + (f" ({', '.join(m.aliases)})" if m.aliases else "")
        policy = f"{m.batch_policy} (S % {m.length_factor}*cp)" if m.length_factor > 1 else m.batch_policy
        asyn = _async_cell(m)
        lines.append(f"| {name} | {policy} | {m.head_doc} | {m.degree_doc} | {asyn} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.extend(f"[{i}] {n}" for i, n in enumerate(notes, 1))
    lines.append("")
    lines.append("Token-mixer methods (contiguous layout, batch policy all_gather):")
    lines.append("")
    for m in mixer_methods():
        o = m.offers[0]
        lines.append(f"* `{o.registry_name}` (`{o.module}.{o.entry}`): {m.title}; heads: {m.head_doc}")
    return "\n".join(lines)
