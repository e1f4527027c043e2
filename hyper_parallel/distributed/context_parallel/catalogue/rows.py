"""The catalogue's table: the calling styles (:data:`STYLES`) and one :class:`CPMethod` row per CP
method (:data:`METHODS`), plus the public module paths the rows name. Pure data; see
:mod:`hyper_parallel.distributed.context_parallel.catalogue` for who reads it."""
from __future__ import annotations

import dataclasses
from typing import Optional

WRAPPERS_MODULE = "hyper_parallel.distributed.context_parallel.wrappers"
MIXERS_MODULE = "hyper_parallel.distributed.context_parallel.mixers"
MAMBA2_MODULE = "hyper_parallel.distributed.context_parallel.mixers.mamba2"
MAMBA1_MODULE = "hyper_parallel.distributed.context_parallel.mixers.mamba1"
#: the model families whose adapter implements the async handoff protocol, in registration order:
#: model type -> the public module path of its async Targets (``models/<model_type>/async_cp.py``
#: registers itself through :func:`add_async_adapter`); read live (a wrapper's ``model_adapter``
#: of the generic async Targets is :data:`ADAPTER_ARCHS` itself)
ASYNC_ADAPTER_MODULES: dict = {}
ADAPTER_ARCHS: list = []


#: the token layouts a batch policy puts a row in (``CPMethod.layout``): contiguous chunks, Head-Tail's
#: head r + tail 2C-1-r, the balanced split's work-balanced permutation
CONTIGUOUS, HEAD_TAIL, BALANCED = "contiguous", "head_tail", "balanced"


def add_async_adapter(arch: str, module: str) -> None:
    """Register model type ``arch``'s async Targets, published at ``module`` (idempotent)."""
    if ASYNC_ADAPTER_MODULES.get(arch, module) != module:
        raise ValueError(f"async adapter {arch!r} is already registered at {ASYNC_ADAPTER_MODULES[arch]!r}")
    if arch not in ASYNC_ADAPTER_MODULES:
        ASYNC_ADAPTER_MODULES[arch] = module
        ADAPTER_ARCHS.append(arch)


def async_entry_name(method: str, arch: Optional[str] = None) -> str:
    """``async_<method>_cp_wrapper`` (generic) or ``<arch>_async_<method>_cp_wrapper`` (adapter)."""
    return f"{arch + '_' if arch else ''}async_{method}_cp_wrapper"


def _async_targets(method: str) -> tuple:
    """The generic async Target of ``method`` (any attention with the handoff protocol); the model
    adapters' named ones are added by :func:`.rules.async_targets` from the registered adapters."""
    return (f"{WRAPPERS_MODULE}.{async_entry_name(method)}",)


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
    strategy: Optional[str] = None   # class name in methods/<strategy_module>/strategy.py
    strategy_module: Optional[str] = None  # the method's folder under methods/
    batch_policy: str = "all_gather"  # shard_batch_for_cp policy
    layout: str = "contiguous"       # "contiguous": rank r holds tokens [r*S/C, (r+1)*S/C); "head_tail" / "balanced": reordered
    length_factor: int = 1           # S is padded to a multiple of length_factor * cp_size
    head_rule: str = "gqa"           # "gqa": Hq % Hk == 0 | "split": heads split over the degree (methods/ulysses/layout.py) | "module"
    head_doc: str = ""
    degree: str = "none"             # "none": no degree | "cp": degree == cp_size | "param": named parameter
    degree_param: Optional[str] = None
    degree_doc: str = ""
    async_targets: tuple = ()        # model-specific async variants (`_target_` paths)
    async_reason: str = ""           # why there is none / which models
    async_param: Optional[str] = None  # the async Targets' pipeline-depth parameter (default None)
    async_doc: str = ""              # one line: what the async variant launches and where it waits
    offers: tuple = ()               # Offer per style
    cost: Optional[str] = None       # "module:ATTR" under context_parallel/: its CostModel (cost_model.py)
    async_plan: Optional[str] = None  # "module:ATTR" under context_parallel/: its async plan builder (async_plan.py)


_NO_FLEX = ("not offered: no flex entry point has been written and parity-tested for {m} yet (the strategy "
            "itself does not depend on the style); use the {m} wrapper of the sdpa_hf / sdpa_qkv style, or a "
            "custom wrapper")

METHODS: dict = {m.name: m for m in (
    CPMethod(
        name="colossal", title="colossal (AllGather)", aliases=("all_gather",), strategy="AllGatherStrategy",
        strategy_module="colossal", batch_policy="all_gather", head_rule="gqa", cost="methods.colossal.cost:COST",
        async_plan="methods.colossal.async_:async_plan",
        head_doc="any GQA ratio (Hq % Hk == 0)",
        degree="none", degree_doc="no degree",
        async_targets=_async_targets("colossal"),
        async_param="kv_chunks",
        async_doc="K/V AllGather launched at the K/V handoffs in ``kv_chunks`` sequence chunks, pipelined "
                  "through the attention (LSE merge); ReduceScatter per chunk in backward",
        offers=(Offer("hf", "sdpa_hf_cp_wrapper", "sdpa_hf"), Offer("qkv", "sdpa_qkv_cp_wrapper", "sdpa_qkv"),
                Offer("flex_hf", "flex_hf_cp_wrapper", "flex_hf"),
                Offer("flex_qkv", "flex_qkv_cp_wrapper", "flex_qkv"))),
    CPMethod(
        name="ulysses", title="pure Ulysses", strategy="UlyssesStrategy", strategy_module="ulysses",
        cost="methods.ulysses.cost:COST", async_plan="methods.ulysses.async_:async_plan",
        batch_policy="ulysses",
        head_rule="split",
        head_doc="Hq % Hk == 0 and Hq >= cp_size: uneven splits and Hk < cp_size (KV heads replicated) "
                 "accepted",
        degree="cp", degree_doc="ulysses_degree == cp_size (implicit)",
        async_targets=_async_targets("ulysses"),
        async_param="q_chunks",
        async_doc="K/V seq->head A2A launched at their handoffs, Q in ``q_chunks`` pipelined sequence chunks, "
                  "each chunk's output head->seq A2A launched after its attention; inverse A2As in backward",
        offers=(Offer("hf", "sdpa_hf_ulysses_cp_wrapper", "sdpa_hf_ulysses"),
                Offer("qkv", "sdpa_qkv_ulysses_cp_wrapper", "sdpa_qkv_ulysses"),
                Offer("flex_hf", "flex_hf_ulysses_cp_wrapper", "flex_hf_ulysses"),
                Offer("flex_qkv", "flex_qkv_ulysses_cp_wrapper", "flex_qkv_ulysses"))),
    CPMethod(
        name="hybrid", title="Hybrid (Ulysses x Colossal)", strategy="HybridStrategy", strategy_module="hybrid",
        cost="methods.hybrid.cost:COST", async_plan="methods.hybrid.async_:async_plan",
        batch_policy="hybrid",
        head_rule="split",
        head_doc="Hq % Hk == 0 and Hq >= ulysses_degree: uneven splits and Hk < ulysses_degree (KV heads "
                 "replicated) accepted",
        degree="param", degree_param="ulysses_degree",
        degree_doc="named parameter ulysses_degree: 1 < u < cp_size, cp_size % u == 0",
        async_targets=_async_targets("hybrid"),
        async_param="q_chunks",
        async_doc="K/V ulysses A2A chained into the colossal AllGather on the comm thread; Q / output ulysses "
                  "A2A per pipelined ``q_chunks`` chunk; backward mirrors every stage",
        offers=(Offer("hf", "sdpa_hf_hybrid_cp_wrapper"), Offer("qkv", "sdpa_qkv_hybrid_cp_wrapper"),
                Offer("flex_hf", reason=_NO_FLEX.format(m="Hybrid")),
                Offer("flex_qkv", reason=_NO_FLEX.format(m="Hybrid")))),
    CPMethod(
        name="load_balance", title="Head-Tail load balance", aliases=("head_tail",), strategy="HeadTailStrategy",
        strategy_module="head_tail", batch_policy="load_balance", layout="head_tail", length_factor=2,
        cost="methods.head_tail.cost:COST", async_plan="methods.head_tail.async_:async_plan",
        head_rule="gqa",        head_doc="any GQA ratio (Hq % Hk == 0)", degree="none", degree_doc="no degree",
        async_targets=_async_targets("load_balance"),
        async_param="q_chunks",
        async_doc="K/V AllGather launched at their handoffs; Q of both Head-Tail branches dispatched in "
                  "``q_chunks`` pipelined chunks, each chunk's combine launched after its attention",
        offers=(Offer("hf", "sdpa_hf_load_balance_cp_wrapper"), Offer("qkv", "sdpa_qkv_load_balance_cp_wrapper"),
                Offer("flex_hf", reason=_NO_FLEX.format(m="Head-Tail")),
                Offer("flex_qkv", reason=_NO_FLEX.format(m="Head-Tail")))),
    CPMethod(
        name="balanced", title="balanced split (Colossal on a work-balanced permutation)",
        aliases=("balanced_split",), strategy="BalancedStrategy", strategy_module="balanced",
        cost="methods.balanced.cost:COST", async_plan="methods.balanced.async_:async_plan",
        batch_policy="balanced", layout="balanced", length_factor=64, head_rule="gqa",
        head_doc="any GQA ratio (Hq % Hk == 0)", degree="none", degree_doc="no degree",
        async_targets=_async_targets("balanced"),
        async_param="kv_chunks",
        async_doc="the async Colossal pipeline on the permuted row: K/V AllGather launched at the K/V handoffs "
                  "in ``kv_chunks`` slot chunks (keys at ``meta.perm`` of their slots, queries at "
                  "``meta.q_index``), pipelined through the attention (LSE merge); ReduceScatter per chunk in "
                  "backward",
        offers=(Offer("hf", "sdpa_hf_balanced_cp_wrapper", "sdpa_hf_balanced"),
                Offer("qkv", "sdpa_qkv_balanced_cp_wrapper", "sdpa_qkv_balanced"),
                Offer("flex_hf", reason=_NO_FLEX.format(m="the balanced split")),
                Offer("flex_qkv", reason=_NO_FLEX.format(m="the balanced split")))),
    CPMethod(
        name="hybrid_balanced", title="Hybrid on the balanced split (Ulysses x Colossal, work-balanced permutation)",
        strategy="BalancedHybridStrategy", strategy_module="balanced", batch_policy="balanced", layout="balanced",
        cost="methods.balanced.cost:HYBRID_COST",
        async_plan="methods.balanced.async_:hybrid_async_plan",
        length_factor=64, head_rule="split",
        head_doc="Hq % Hk == 0 and Hq >= ulysses_degree: uneven splits and Hk < ulysses_degree (KV heads "
                 "replicated) accepted",
        degree="param", degree_param="ulysses_degree",
        degree_doc="named parameter ulysses_degree: 1 < u < cp_size, cp_size % u == 0",
        async_targets=_async_targets("hybrid_balanced"),
        async_param="q_chunks",
        async_doc="async Hybrid on the permuted row: K/V ulysses A2A chained into the colossal AllGather on the "
                  "comm thread; Q / output ulysses A2A per pipelined ``q_chunks`` chunk (queries at ``perm`` of "
                  "the u-group's slots); backward mirrors every stage",
        offers=(Offer("hf", "sdpa_hf_hybrid_balanced_cp_wrapper"), Offer("qkv", "sdpa_qkv_hybrid_balanced_cp_wrapper"),
                Offer("flex_hf", reason=_NO_FLEX.format(m="Hybrid on the balanced split")),
                Offer("flex_qkv", reason=_NO_FLEX.format(m="Hybrid on the balanced split")))),
    # token-mixer methods with a generic core (context_parallel/mixers/; the model families add theirs, and the
    # classes these cores are exact for, from models/<model_type>/): declared on a non-attention module, run on
    # the contiguous layout (next to "balanced" the applier moves their tokens there and back,
    # mixers.layout.on_contiguous_layout); WrapperInfo.method is "custom" and mixer=True
    CPMethod(
        name="sequence_gather", title="sequence gather (any mixer)", kind="mixer", batch_policy="all_gather",
        cost="mixers.cost:SEQUENCE_GATHER",
        head_rule="module", head_doc="none (the whole module runs on the gathered sequence)",
        offers=(Offer("hf", "sequence_gather_cp_wrapper", "sequence_gather", module=MIXERS_MODULE),)),
    CPMethod(
        name="short_conv_halo", title="short-conv halo exchange (LFM2)", kind="mixer", batch_policy="all_gather",
        cost="mixers.cost:HALO",
        head_rule="module", head_doc="none (kernel - 1 halo tokens from the previous rank)",
        offers=(Offer("hf", "short_conv_halo_cp_wrapper", "short_conv_halo", module=MIXERS_MODULE),)),
    CPMethod(
        name="mamba2_state_passing", title="Mamba2 state passing (Falcon-H1, Bamba, NemotronH, Granite 4, Zamba2)",
        cost="mixers.cost:MAMBA2_STATE_PASSING",
        kind="mixer",
        batch_policy="all_gather", head_rule="module",
        head_doc="none (all heads on the local tokens)",
        offers=(Offer("hf", "mamba2_state_passing_cp_wrapper", "mamba2_state_passing", module=MAMBA2_MODULE),)),
    CPMethod(
        name="mamba1_state_passing", title="Mamba1 state passing (Jamba, Falcon-Mamba)", kind="mixer",
        cost="mixers.cost:STATE_PASSING",
        batch_policy="all_gather", head_rule="module", head_doc="none (all channels on the local tokens)",
        offers=(Offer("hf", "mamba1_state_passing_cp_wrapper", "mamba1_state_passing", module=MAMBA1_MODULE),)),
)}

_ALIASES = {alias: m.name for m in METHODS.values() for alias in (m.name,) + m.aliases}


def add_rows(*rows: CPMethod) -> None:
    """Add rows to the catalogue (a model family's token-mixer methods, at its import; an extension's
    method): ValueError, nothing added, when a name or alias is taken by another row."""
    for row in rows:
        taken = [n for n in (row.name,) + row.aliases if n in _ALIASES and METHODS[_ALIASES[n]] is not row]
        if taken:
            raise ValueError(f"CP method {row.name!r}: name(s) {taken} are already in the catalogue")
    for row in rows:
        METHODS[row.name] = row
        _ALIASES.update({n: row.name for n in (row.name,) + row.aliases})


def remove_row(name: str) -> None:
    """Remove the row ``name`` and its aliases (an extension's method leaving)."""
    row = METHODS.pop(name, None)
    for n in ((row.name,) + row.aliases) if row is not None else ():
        _ALIASES.pop(n, None)
