"""Built-in CP wrappers (public ``_target_`` API, design section 3.1.1).

Every built-in wrapper fixes one CP method (its strategy) and one attention calling convention:

===========================  ===================  =======================================
registry name                ``_target_``         method / style
===========================  ===================  =======================================
``sdpa_hf``                  sdpa_hf_cp_wrapper                 colossal / hf
``sdpa_hf_ulysses``          sdpa_hf_ulysses_cp_wrapper         ulysses / hf
(Target only)                sdpa_hf_hybrid_cp_wrapper          hybrid(ulysses_degree) / hf
(Target only)                sdpa_hf_load_balance_cp_wrapper    load_balance / hf
``sdpa_qkv``                 sdpa_qkv_cp_wrapper                colossal / qkv
``sdpa_qkv_ulysses``         sdpa_qkv_ulysses_cp_wrapper        ulysses / qkv
(Target only)                sdpa_qkv_hybrid_cp_wrapper         hybrid(ulysses_degree) / qkv
(Target only)                sdpa_qkv_load_balance_cp_wrapper   load_balance / qkv
``flex_hf``                  flex_hf_cp_wrapper                 colossal / flex (HF module)
``flex_hf_ulysses``          flex_hf_ulysses_cp_wrapper         ulysses / flex (HF module)
``flex_qkv``                 flex_qkv_cp_wrapper                colossal / flex (core module)
``flex_qkv_ulysses``         flex_qkv_ulysses_cp_wrapper        ulysses / flex (core module)
===========================  ===================  =======================================

How each style hooks in (see :mod:`.interception` and docs/wrappers.md):

* ``sdpa_hf*``: HF ``forward(hidden_states, ...)`` (``attn_implementation`` "sdpa" or
  "eager"); the forward runs unchanged (projections, QK-norm, RoPE, o_proj) and its single
  attention call is replaced by the strategy: through transformers' attention interface (a
  private config naming ``hyper_parallel_cp``, as ``flex_hf*``: the call's ``sliding_window``,
  ``softcap``, ``s_aux`` sinks, ``scaling`` and ``dropout`` are read) when the probe sees the
  module use it, else its direct ``F.scaled_dot_product_attention`` call (scoped
  TorchFunctionMode; the mask is then the only carrier, so windows and additive biases are
  refused).
* ``sdpa_qkv*``: ``forward(q, k, v, ...)`` core attention that calls SDPA; the arguments are
  bound and checked, the forward runs unchanged, the SDPA call is replaced.
* ``flex_hf*``: HF attention built with ``attn_implementation="flex_attention"``; its
  attention-interface call is routed to the strategy (private config naming the additional
  ``hyper_parallel_cp`` interface). The HF BlockMask is local and is ignored; the mask over
  the *global* KV length is the engine's position/document rule from the CP batch meta.
* ``flex_qkv*``: ``forward(q, k, v, ..., block_mask=None, scale=None)`` core module around
  ``flex_attention``: the arguments are bound and the whole body is replaced by the strategy
  (a ``score_mod`` or ``return_lse`` is rejected).

In every style HF's local mask is never trusted: causality, padding and packed documents come
from :func:`~.meta.current_cp_batch_meta` (global positions, key doc ids). K/V that HF already
repeated for GQA (``repeat_kv``) are un-repeated by a strided view (``k_rep[:, ::g] == k``), so
only Hk heads are communicated; ``enable_gqa=True`` K/V are used as given.

Validation (``validate`` hook, at resolution and again in the planner with TP-local heads):
style/signature, ``attn_implementation``, refused inputs (attention dropout > 0, ALiBi, and on
the probe's recorded call: unknown kwargs, non-causal, a window or an additive bias on the SDPA
route), head divisibility for the method, and for HF styles a probe forward (train mode) on a
2-token dummy input that counts attention calls (0 = misfire, >1 = double interception). The
same call checks run again at every real call.

Modes (``apply_sharding_plan(mode=...)``): ``production`` runs the CP path; ``validate`` also
computes a full-sequence reference from the CP-gathered input and raises
:class:`CPValidationError` on every CP rank when they differ by more than
:data:`VALIDATE_TOLERANCE`. HF styles run the original forward on the gathered sequence; an
attention-interface call is computed by the module's own attention function with its own
kwargs and the model's own mask for the layer (transformers' mask functions on the global
sequence, the batch's padding/documents added); SDPA-route calls by the engine; qkv styles
attend this rank's queries to the gathered K/V with the engine (float32 for half inputs). Only
validate mode builds an ``S x S`` mask (the model's own, for its reference); production never
does. Outputs and gradients are those of the CP path in both modes.
"""
from __future__ import annotations

import copy
import inspect
import weakref
from typing import Callable, Optional

import torch
import torch.nn as nn

from ... import platform as P
from .interception import (AttentionCall, CPInterceptionError, InterceptScope, current_apply_context,
                           ensure_hf_interface_registered, install_private_config, intercept_hf_any,
                           intercept_hf_interface, intercept_sdpa, probe_module)
from .meta import CPBatchMeta, current_cp_batch_meta
from .registry import inner_wrapper, register_inner_wrapper

__all__ = [
    "sdpa_hf_cp_wrapper", "sdpa_hf_ulysses_cp_wrapper", "sdpa_hf_hybrid_cp_wrapper",
    "sdpa_hf_load_balance_cp_wrapper", "sdpa_qkv_cp_wrapper", "sdpa_qkv_ulysses_cp_wrapper",
    "sdpa_qkv_hybrid_cp_wrapper", "sdpa_qkv_load_balance_cp_wrapper", "flex_hf_cp_wrapper",
    "flex_hf_ulysses_cp_wrapper", "flex_qkv_cp_wrapper", "flex_qkv_ulysses_cp_wrapper",
    "CPValidationError", "VALIDATE_TOLERANCE", "module_heads", "BUILTIN_NAMES",
]

# |cp - ref| <= atol + rtol * max|ref| over valid query rows (per dtype of the CP output)
VALIDATE_TOLERANCE = {
    torch.float64: (1e-8, 1e-8),
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (1e-2, 1e-2),
}


class CPValidationError(RuntimeError):
    """Validate mode: the CP path and the original path disagree beyond tolerance."""


# ============================================================================ heads & checks
def module_heads(module: nn.Module, tp_size: int = 1) -> tuple[Optional[int], Optional[int]]:
    """(q heads, kv heads) this rank computes for ``module`` (TP-local).

    After TP the applier records ``__hp_local_heads__``; otherwise the counts come from
    ``num_heads``/``num_key_value_heads`` attributes or the HF config, divided by ``tp_size``.
    """
    local = getattr(module, "__hp_local_heads__", None)
    if local is not None:
        return local
    cfg = getattr(module, "config", None)
    hq = None
    for attr in ("num_heads", "num_attention_heads", "n_heads"):
        if isinstance(getattr(module, attr, None), int):
            hq = getattr(module, attr)
            break
    if hq is None and cfg is not None:
        hq = getattr(cfg, "num_attention_heads", None)
    hk = None
    for attr in ("num_key_value_heads", "num_kv_heads", "n_kv_heads"):
        if isinstance(getattr(module, attr, None), int):
            hk = getattr(module, attr)
            break
    if hk is None and cfg is not None:
        hk = getattr(cfg, "num_key_value_heads", None) or hq
    if hk is None and hq is not None:
        groups = getattr(module, "num_key_value_groups", None)
        hk = hq // groups if isinstance(groups, int) and groups > 0 else hq
    if tp_size > 1:
        for name, h in (("num_q_heads", hq), ("num_kv_heads", hk)):
            if h is not None and h % tp_size:
                raise ValueError(f"{name}={h} of {type(module).__name__} is not divisible by tp_size={tp_size}")
        hq = hq // tp_size if hq is not None else None
        hk = hk // tp_size if hk is not None else None
    return hq, hk


def _check_gqa(who, hq, hk):
    from .strategies.base import check_gqa

    check_gqa(who, hq, hk)


def _check_heads(method: str, module: nn.Module, cp_size: int, tp_size: int, ulysses_degree, who: str):
    from .strategies.ulysses import check_head_split

    hq, hk = module_heads(module, tp_size)
    if method == "hybrid":
        u = ulysses_degree
        if isinstance(u, bool) or not isinstance(u, int):
            raise ValueError(f"{who}: ulysses_degree must be an integer, got {u!r}")
        if not 1 < u < cp_size or cp_size % u:
            raise ValueError(
                f"{who}: Hybrid needs 1 < ulysses_degree < cp_size and cp_size % ulysses_degree == 0, got "
                f"ulysses_degree={u}, cp_size={cp_size} (use the Ulysses wrapper for ulysses_degree == cp_size, "
                "the colossal wrapper for 1)")
    if hq is None or hk is None:
        return  # heads unknown here: the strategy checks the real tensors at apply/run time
    tp_note = f" (per TP rank, tp_size={tp_size})" if tp_size > 1 else ""
    try:
        if method in ("colossal", "load_balance"):
            _check_gqa(who, hq, hk)
        elif method == "ulysses":
            check_head_split(who, hq, hk, cp_size, "cp_size (ulysses_degree)")
        elif method == "hybrid":
            check_head_split(who, hq, hk, ulysses_degree, "ulysses_degree")
    except ValueError as exc:
        raise ValueError(f"{exc}{tp_note}") from None


_HF_PARAM = "hidden_states"
_QKV_NAMES = (("q", "query", "q_states", "query_states"), ("k", "key", "k_states", "key_states"),
              ("v", "value", "v_states", "value_states"))


def _forward_params(module: nn.Module) -> list:
    return list(inspect.signature(module.forward).parameters.values())


def _check_style(style: str, module: nn.Module, who: str) -> None:
    if getattr(module, "__hp_cp_wrapped__", None):
        raise ValueError(f"{who}: {type(module).__name__} already carries CP wrapper "
                         f"{module.__hp_cp_wrapped__}; one attention takes exactly one wrapper")
    params = _forward_params(module)
    names = [p.name for p in params]
    if style == "hf":
        if _HF_PARAM not in names:
            raise ValueError(
                f"{who}: {type(module).__name__}.forward{tuple(names)} has no 'hidden_states' parameter, so it is "
                "not an HF attention forward; use the *_qkv wrapper for forward(q, k, v, ...) modules or point "
                "inner_target at the HF attention module")
    else:
        pos = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:3]
        ok = len(pos) == 3 and all(p.name in allowed for p, allowed in zip(pos, _QKV_NAMES))
        if not ok:
            raise ValueError(
                f"{who}: {type(module).__name__}.forward{tuple(names)} does not start with (q, k, v) / "
                "(query, key, value); the *_qkv wrappers bind a forward(q, k, v, ...) core attention — use the "
                "*_hf wrapper for HF forward(hidden_states, ...) modules")


def _check_impl(primitive: str, module: nn.Module, who: str, wrapper_kind: str) -> None:
    cfg = getattr(module, "config", None)
    impl = getattr(cfg, "_attn_implementation", None) if cfg is not None else None
    if impl is None:
        return
    # sdpa_hf*: SDPA models, and eager models whose attention goes through transformers' attention
    # interface (Gemma2 softcap, gpt-oss sinks: transformers refuses SDPA for them) — the probe
    # then proves the module really calls the interface (an eager matmul attention misfires).
    allowed = ("sdpa", "eager") if primitive == "hf_any" else (
        ("sdpa",) if primitive == "sdpa" else ("flex_attention",))
    if impl not in allowed:
        want = allowed[0]
        other = "flex_hf" if impl == "flex_attention" else ("sdpa_hf" if impl in ("sdpa", "eager") else None)
        hint = (f"declare the {other}* wrapper instead" if other else
                f"build the model with attn_implementation='{want}'")
        raise ValueError(
            f"{who}: {wrapper_kind} wrappers need attn_implementation='{want}', but "
            f"{type(module).__name__} uses attn_implementation='{impl}'; {hint}")


def _dropout_p(obj) -> float:
    if isinstance(obj, nn.Dropout):
        return float(obj.p)
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        return float(obj)
    return 0.0


def _check_features(module: nn.Module, who: str) -> None:
    """Static refusals: attention-probability dropout > 0 and ALiBi (an additive position bias).

    Sliding windows, softcap and sinks are read from the attention call itself (the HF
    interface kwargs) and carried to the engine; a module that calls SDPA directly cannot
    carry them and is refused by the probe / at the call (:func:`_check_call`).
    """
    cfg = getattr(module, "config", None)
    name = type(module).__name__
    for attr in ("attention_dropout", "attn_dropout", "attn_pdrop", "attention_probs_dropout_prob"):
        for owner, where in ((module, name), (cfg, "config")):
            val = getattr(owner, attr, None) if owner is not None else None
            p = _dropout_p(val)
            if p > 0:
                raise ValueError(
                    f"{who}: {where}.{attr}={val} ({name}): attention dropout > 0 is not supported by the CP "
                    f"attention (no dropout in the engine); set attention_dropout: 0.0 (attn_pdrop for GPT-2)")
    takes_alibi = "alibi" in inspect.signature(module.forward).parameters
    if (cfg is not None and getattr(cfg, "alibi", False) is True) or (
            takes_alibi and (cfg is None or not hasattr(cfg, "alibi"))):   # Bloom: always ALiBi
        raise ValueError(f"{who}: {name} uses ALiBi: its additive position bias arrives in "
                         "the attention mask, which CP does not carry (the engine refuses alibi_slopes); "
                         "ALiBi is not supported")


def _check_core_features(module: nn.Module, who: str) -> None:
    """qkv styles bind q/k/v only: a window or softcap on the module cannot be carried."""
    cfg = getattr(module, "config", None)
    if getattr(module, "sliding_window", None) is not None:
        raise ValueError(f"{who}: sliding-window attention (sliding_window={module.sliding_window}) is not "
                         "carried by the *_qkv wrappers; use the *_hf wrapper on the HF attention module")
    soft = getattr(cfg, "attn_logit_softcapping", None) if cfg is not None else None
    if soft:
        raise ValueError(f"{who}: attention logit softcapping ({soft}) is not carried by the *_qkv wrappers; "
                         "use the *_hf wrapper on the HF attention module")


def _check_call(call: AttentionCall, module: nn.Module, who: str, *, at: str) -> None:
    """Refuse what a call carries that CP would not compute exactly; ``at`` names where (probe/run)."""
    name = type(module).__name__
    if call.extra:
        raise ValueError(f"{who}: {name}'s attention call passes {sorted(call.extra)} ({at}), which the CP "
                         "attention does not understand; refused rather than dropped")
    if call.dropout_p and (call.module_training or call.source == "sdpa"):
        raise ValueError(f"{who}: {name}'s attention call passes dropout={call.dropout_p} in training ({at}); "
                         "attention dropout > 0 is not supported by the CP attention")
    if not call.is_causal and call.source == "hf_interface":
        raise ValueError(f"{who}: {name} is non-causal (is_causal=False, {at}); the built-in CP wrappers "
                         "compute causal decoder attention only")
    if call.window is not None and (isinstance(call.window, bool) or not isinstance(call.window, int)
                                    or call.window < 1):
        raise ValueError(f"{who}: {name}'s attention call passes sliding_window={call.window!r} ({at}); "
                         "expected an int >= 1 or None")
    if call.source == "sdpa":
        win = getattr(module, "sliding_window", None)
        if win is not None:
            raise ValueError(f"{who}: {name} (sliding_window={win}) calls SDPA directly, so the window exists "
                             f"only inside its mask ({at}); CP cannot read it from the call. Route the module "
                             "through transformers' attention interface (ALL_ATTENTION_FUNCTIONS)")
        m = call.attn_mask
        if isinstance(m, torch.Tensor) and m.dtype.is_floating_point:
            bias = torch.isfinite(m) & (m != 0) & (m > torch.finfo(m.dtype).min / 2)
            if bool(bias.any()):
                raise ValueError(f"{who}: {name} passes SDPA an additive float mask with finite non-zero "
                                 f"values ({at}), e.g. ALiBi or a relative position bias; CP computes only "
                                 "causal + padding + documents + window and refuses the bias")


_PROBE_CACHE: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def _probe(primitive: str, module: nn.Module, who: str):
    cache = _PROBE_CACHE.setdefault(module, {})
    if primitive not in cache:
        cache[primitive] = probe_module(module, primitive, owner=who)
    return cache[primitive]


def _check_probe(primitive: str, module: nn.Module, who: str) -> None:
    res = _probe(primitive, module, who)
    what = {"sdpa": "torch.nn.functional.scaled_dot_product_attention",
            "hf_interface": "its HF attention interface",
            "hf_any": "torch.nn.functional.scaled_dot_product_attention"}[primitive]
    if res is None:
        return
    if res.count == 0:
        extra = " call (nor an HF attention-interface call)" if primitive == "hf_any" else " call"
        raise ValueError(
            f"{who}: a probe forward of {type(module).__name__} made no {what}{extra}, so the wrapper would "
            "never run (misfire); check attn_implementation and inner_target")
    if res.count > 1:
        raise ValueError(
            f"{who}: a probe forward of {type(module).__name__} made {res.count} {what} calls; the wrapper "
            "replaces exactly one (double interception) — use a model-specific wrapper or a narrower inner_target")
    for call in res.calls:
        _check_call(call, module, who, at="preflight probe, train mode")


def _make_validate(name: str, method: str, style: str, primitive: str):
    kind = {"sdpa": "SDPA", "hf_any": "SDPA", "hf_interface": "FlexAttention",
            "flex_direct": "FlexAttention"}[primitive]

    def validate(target_module: nn.Module, *, cp_size: int, tp_size: int = 1, ulysses_degree=None,
                 probe: bool = True) -> None:
        who = name
        _check_style("hf" if style in ("hf", "flex_hf") else "qkv", target_module, who)
        if style in ("hf", "flex_hf"):
            _check_impl(primitive, target_module, who, kind)
        _check_features(target_module, who)
        if style in ("qkv", "flex_qkv"):
            _check_core_features(target_module, who)
        _check_heads(method, target_module, cp_size, tp_size, ulysses_degree, who)
        if probe and style in ("hf", "flex_hf"):
            _check_probe(primitive, target_module, who)

    validate.__qualname__ = f"validate[{name}]"
    return validate


# ============================================================================ runtime
def _strategy(method: str, mesh, cp_mesh, ulysses_degree=None):
    from .strategies import build_strategy

    if method == "hybrid":
        if mesh is None or not hasattr(mesh, "hybrid_groups"):
            raise ValueError("the hybrid wrapper needs the MeshContext (mesh) to find its cached sub-groups")
        return build_strategy("hybrid", mesh, ulysses_degree=ulysses_degree)
    src = mesh if (mesh is not None and hasattr(mesh, "cp_mesh")) else cp_mesh
    return build_strategy(method, src)


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor" or hasattr(t, "_local_tensor")


def _unrepeat(call: AttentionCall):
    q, k, v = call.q, call.k, call.v
    g = call.kv_groups
    if not call.enable_gqa and g > 1 and k.shape[1] == q.shape[1] and q.shape[1] % g == 0:
        # repeat_kv output: head h*g + j is a copy of kv head h -> a strided view, no gather of copies
        return k[:, ::g], v[:, ::g]
    return k, v


def _check_repeat(call: AttentionCall, owner: str) -> None:
    """Validate mode: the un-repeat assumption (k_rep[:, h*g + j] == k_rep[:, h*g])."""
    g = call.kv_groups
    k = call.k
    if call.enable_gqa or g <= 1 or k.shape[1] != call.q.shape[1]:
        return
    kk = k.detach().unflatten(1, (k.shape[1] // g, g))
    if not torch.equal(kk, kk[:, :, :1].expand_as(kk)):
        raise CPValidationError(f"module '{owner}': K/V heads reach SDPA with Hq heads but are not a repeat_kv "
                                f"copy (groups={g}); declare num_key_value_groups correctly or pass enable_gqa")


def _check_model_separates_documents(call: AttentionCall, meta: CPBatchMeta, owner: str) -> None:
    """Packed rows given as restarting position_ids: the model's own local mask must separate the
    documents CP derived. transformers derives them only where the model passes position_ids to
    its mask functions (e.g. gpt-oss does not: at CP=1 its documents see each other), and only
    without a KV cache (``use_cache=False``, training); a model that does not is refused instead
    of computing something else than at CP=1. Checked once per batch per module, on the local chunk."""
    if not getattr(meta, "docs_from_positions", False) or call.source != "hf_interface":
        return
    if call.hf_kwargs.get("use_cache"):
        return      # with a KV cache transformers never derives documents from the positions: nothing to compare
    doc = meta.doc_slice(meta.q_index)
    if doc is None or (call.window is not None and call.window < 2):
        return
    L = doc.shape[1]
    # O(boundaries): the first token of a document must not see the last token of the previous one
    cut = (doc[:, 1:] != doc[:, :-1]) & (doc[:, 1:] >= 0) & (doc[:, :-1] >= 0)        # [B, L-1]
    if not bool(cut.any()):
        return
    b_idx, t = cut.nonzero(as_tuple=True)
    t = t + 1                                                                          # first token of the new doc
    m = call.attn_mask
    if m is None:
        allowed = torch.ones(len(t), dtype=torch.bool)
    elif isinstance(m, torch.Tensor) and m.dim() == 4 and tuple(m.shape[-2:]) == (L, L):
        pair = m[b_idx.to(m.device) if m.shape[0] > 1 else torch.zeros_like(b_idx).to(m.device), :,
                 t.to(m.device), (t - 1).to(m.device)]                                  # [n, H]
        allowed = pair if pair.dtype == torch.bool else pair > torch.finfo(pair.dtype).min / 2
        allowed = allowed.reshape(len(t), -1).any(dim=1)
    else:
        return          # a mask format this check cannot read (e.g. a BlockMask): the proof decides
    if bool(allowed.any()):
        raise ValueError(
            f"module '{owner}': the batch packs documents as restarting position_ids, but the model's own "
            "mask lets them see each other (this model builds its mask without position_ids, so at CP=1 "
            "transformers treats the row as one sequence); CP would separate them and compute something "
            "else than CP=1 — refused. Pass the documents as seq_lens (and an explicit attention "
            "boundary at CP=1), or do not pack rows for this model")


def _make_handler(strategy, owner: str, validate_attention: bool, cp_group, check_repeat: bool = False,
                  module: Optional[nn.Module] = None):
    checked = [None]      # the meta whose documents were checked against the model's mask

    def handler(call: AttentionCall) -> torch.Tensor:
        meta = current_cp_batch_meta()
        for name, t in (("q", call.q), ("k", call.k), ("v", call.v)):
            if not isinstance(t, torch.Tensor) or _is_dtensor(t):
                raise TypeError(f"module '{owner}': the intercepted attention got a {type(t).__name__} {name}; "
                                "CP wrappers need local tensors (TP plans must use use_local_output=True)")
        if module is not None:
            _check_call(call, module, f"module '{owner}'", at="at the call")
        else:
            if call.dropout_p:
                raise ValueError(f"module '{owner}': attention dropout_p={call.dropout_p} is not supported by CP")
            if call.extra:
                raise ValueError(f"module '{owner}': {sorted(call.extra)} are not supported by the CP attention")
        if module is not None and id(meta) != checked[0]:
            checked[0] = id(meta)
            _check_model_separates_documents(call, meta, owner)
        if validate_attention or check_repeat:
            _check_repeat(call, owner)
        k, v = _unrepeat(call)
        q = call.q
        sinks = call.sinks
        device_type = q.device.type
        if torch.is_autocast_enabled(device_type):
            # autocast casts SDPA's inputs to its fast dtype; the engine is a custom op that
            # autocast does not see, so apply the same cast here (q/k/v may arrive mixed).
            dt = torch.get_autocast_dtype(device_type)
            q, k, v = q.to(dt), k.to(dt), v.to(dt)
        if sinks is not None and sinks.dtype != q.dtype:
            sinks = sinks.to(q.dtype)
        out = strategy.attention(q, k, v, meta=meta, scale=call.scale, window=call.window, softcap=call.softcap,
                                 sinks=sinks)
        if validate_attention:
            _validate_attention(out, q, k, v, call, meta, cp_group, owner)
        return out

    return handler


# ---------------------------------------------------------------------- validate mode
def _rank_group(cp_mesh):
    from .collectives import resolve_group

    return resolve_group(cp_mesh)


def _gather_seq(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    if P.group_size(group) == 1:
        return x
    return P.all_gather(x.detach().contiguous(), group, dim=dim, tag="cp.validate")


def _valid_query_rows(meta: CPBatchMeta, B: int) -> Optional[torch.Tensor]:
    doc = meta.doc_slice(meta.q_index)
    return None if doc is None else (doc >= 0)       # [B, S_local]


def _compare(out: torch.Tensor, ref: torch.Tensor, rows: Optional[torch.Tensor], seq_dim: int, group,
             owner: str, what: str) -> None:
    atol, rtol = VALIDATE_TOLERANCE.get(out.dtype, (1e-4, 1e-4))
    a, b = out.detach().to(torch.float64), ref.detach().to(torch.float64)
    diff = (a - b).abs()
    if rows is not None:
        shape = [1] * diff.dim()
        shape[0], shape[seq_dim] = rows.shape
        m = rows.reshape(shape).to(diff.device)
        diff = torch.where(m, diff, torch.zeros_like(diff))
        b = torch.where(m, b, torch.zeros_like(b))
    diff = torch.nan_to_num(diff, nan=float("inf"))
    err = diff.max().item() if diff.numel() else 0.0
    tol = atol + rtol * (b.abs().max().item() if b.numel() else 0.0)
    bad = torch.tensor([1.0 if err > tol else 0.0, err], dtype=torch.float64)
    if P.group_size(group) > 1:
        flags = P.all_gather(bad.reshape(1, 2), group, dim=0, tag="cp.validate.flag")
    else:
        flags = bad.reshape(1, 2)
    if flags[:, 0].max().item() > 0:
        worst = int(flags[:, 1].argmax().item())
        raise CPValidationError(
            f"module '{owner}': validate mode — CP {what} differs from the original path: max |diff| "
            f"{flags[:, 1].max().item():.3e} on cp rank {worst} (this rank {err:.3e}, tolerance "
            f"atol={atol:g} + rtol={rtol:g} * max|ref|)")


def _full_sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_pos: torch.Tensor,
                         meta: CPBatchMeta, scale, window=None, softcap=None, sinks=None) -> torch.Tensor:
    """Validate mode's reference: queries at global ``q_pos`` over the *whole* key sequence.

    k/v ``[B, Hk, S, D]`` hold every key (global positions ``0..S-1``, ``S ==
    meta.global_seq_len``); q ``[B, Hq, len(q_pos), D]``. Runs the engine
    (:func:`hyper_parallel.ops.attention`, global positions and the doc ids of ``meta``, no
    mask is built) in float32 for half-precision inputs (float64 stays float64) and returns q's
    dtype. Called under ``no_grad``; local only (no collective).
    """
    from .strategies.base import engine_attention

    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = engine_attention(q.to(acc), k.to(acc), v.to(acc), q_pos=q_pos, k_pos=meta.k_index, meta=meta,
                           scale=scale, window=window, softcap=softcap,
                           sinks=None if sinks is None else sinks.detach().to(acc))
    return out.to(q.dtype)


def _validate_attention(out, q, k, v, call: AttentionCall, meta: CPBatchMeta, cp_mesh, owner: str) -> None:
    """qkv styles: compare the CP output with this rank's queries attending to the gathered K/V."""
    group = _rank_group(cp_mesh)
    kf, vf = (_gather_seq(t, group, 2) for t in (k, v))     # [B, Hk, S, D]: every key
    with torch.no_grad():
        ref = _full_sequence_attention(q.detach(), kf, vf, q_pos=meta.q_index, meta=meta, scale=call.scale,
                                       window=call.window, softcap=call.softcap, sinks=call.sinks)
    _compare(out, ref, _valid_query_rows(meta, out.shape[0]), 2, group, owner, "attention output")


def _hf_module_reference(original: Callable, module: nn.Module, primitive: str, args, kwargs,
                         meta: CPBatchMeta, group, owner: str, orig_cfg=None):
    """Run the original forward on the CP-gathered full sequence; return this rank's output slice.

    The module's own projections/norms/RoPE run unchanged on the full sequence (KV cache None,
    HF's local ``attention_mask`` None); its attention call is computed by
    :func:`_run_with_reference_attention`: the module's own attention function with the model's
    own mask (interface route) or the engine at global positions (SDPA route).
    """
    sig = inspect.signature(original)
    bound = sig.bind(*args, **kwargs)
    hs = bound.arguments["hidden_states"]
    new = dict(bound.arguments)
    new["hidden_states"] = _gather_seq(hs, group, 1)
    pe = bound.arguments.get("position_embeddings")
    if pe is not None:
        new["position_embeddings"] = tuple(_gather_seq(t, group, 1) for t in pe)
    var_kw = next((p.name for p in sig.parameters.values() if p.kind == p.VAR_KEYWORD), None)
    if var_kw and var_kw in new:
        extra = dict(new.pop(var_kw))
        for key, val in list(extra.items()):
            if isinstance(val, torch.Tensor) and val.dim() >= 2 and val.shape[-1] == meta.local_seq_len:
                extra[key] = _gather_seq(val, group, val.dim() - 1)   # e.g. position_ids
        new.update(extra)
    if "attention_mask" in new or "attention_mask" in sig.parameters:
        new["attention_mask"] = None      # local mask: meaningless on the full sequence, never used
    for key in ("cache", "past_key_values", "past_key_value", "layer_past"):
        if key in new:
            new[key] = None               # the step's KV cache holds local keys: never extend it
    with torch.no_grad():
        res = _run_with_reference_attention(original, module, primitive, new, meta, owner, orig_cfg)
    out = res[0] if isinstance(res, tuple) else res
    lo = meta.cp_rank * meta.local_seq_len
    return out[:, lo:lo + meta.local_seq_len]


def _model_mask(module: nn.Module, cfg, call: AttentionCall, hidden: torch.Tensor, meta: CPBatchMeta, impl: str):
    """The mask the model itself builds for this layer, on the global sequence.

    transformers' own mask function for the layer's type (``config.layer_types[layer_idx]``, else
    the config's ``sliding_window``: Mistral-style models), evaluated with the original
    attention implementation's mask format on the gathered (padded) sequence; padding and packed
    documents of the batch (``meta.key_doc``) enter as an ``and_mask_function``.
    """
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    layer_types = getattr(cfg, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if layer_types is not None and isinstance(idx, int) and idx < len(layer_types):
        sliding = layer_types[idx] in ("sliding_attention", "chunked_attention") and \
            getattr(cfg, "sliding_window", None) is not None
    else:
        sliding = getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True)
    mask_cfg = copy.copy(cfg)
    mask_cfg.__dict__["_attn_implementation_internal"] = impl
    docs = meta.key_doc
    and_fn = None
    if docs is not None:
        docs = docs.to(hidden.device)

        def and_fn(b, h, q_idx, kv_idx):
            return (docs[b, q_idx] == docs[b, kv_idx]) & (docs[b, kv_idx] >= 0)

    fn = create_sliding_window_causal_mask if sliding else create_causal_mask
    return fn(config=mask_cfg, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=None,
              and_mask_function=and_fn, allow_is_causal_skip=False)


def _original_attention(module: nn.Module, impl: str):
    """The attention function the module would call with its own config (``impl``)."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if impl != "eager" and impl in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[impl]
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as fn
    return fn


def _run_with_reference_attention(original, module, primitive, kwargs, meta, owner, orig_cfg=None):
    hidden = kwargs.get("hidden_states")

    def ref_handler(call: AttentionCall):
        if call.q.shape[2] != meta.global_seq_len:
            raise CPValidationError(f"module '{owner}': validate reference saw {call.q.shape[2]} query tokens "
                                    f"after gathering, expected the global length {meta.global_seq_len}")
        impl = getattr(orig_cfg, "_attn_implementation", None) if orig_cfg is not None else None
        if call.source == "hf_interface" and impl in ("sdpa", "eager"):
            # the module's own attention function, its own kwargs, the model's own mask
            acc = torch.float64 if call.q.dtype == torch.float64 else torch.float32
            q, k, v = (t.to(acc) for t in (call.q, call.k, call.v))
            mask_impl = "eager" if impl == "eager" else "sdpa"
            mask = _model_mask(module, orig_cfg, call, hidden.to(acc), meta, mask_impl)
            kw = dict(call.hf_kwargs)
            if call.sinks is not None:
                kw["s_aux"] = call.sinks.detach().to(acc)
            out, _ = _original_attention(module, impl)(module, q, k, v, mask, scaling=call.scale, dropout=0.0,
                                                       **kw)
            # rows that see no key (padding queries): the CP output is defined as 0 there, and
            # they are not compared (_valid_query_rows)
            return out.transpose(1, 2).to(call.q.dtype)
        k, v = _unrepeat(call)
        return _full_sequence_attention(call.q, k, v, q_pos=meta.k_index, meta=meta, scale=call.scale,
                                        window=call.window, softcap=call.softcap, sinks=call.sinks)

    ctx = intercept_sdpa if primitive == "sdpa" else intercept_hf_interface
    with ctx(f"{owner} (validate reference)", module, ref_handler):
        return original(**kwargs)


# ---------------------------------------------------------------------- installers
def _install_intercepting(target_module: nn.Module, strategy, primitive: str, style: str, cp_mesh,
                          name: str) -> Callable:
    ctx = current_apply_context()
    owner = ctx.fqn or type(target_module).__name__
    validate_mode = ctx.mode == "validate"
    original = target_module.forward
    undo: list = []
    route = primitive
    if primitive == "hf_any":
        # the probe found which route this module's attention takes; unprobeable modules with a
        # config get the interface route (every attention of transformers >= 5 goes through it)
        res = _probe(primitive, target_module, owner)
        route = res.route if res is not None and res.count else (
            "hf_interface" if getattr(target_module, "config", None) is not None else "sdpa")
    orig_cfg = getattr(target_module, "config", None)
    if route == "hf_interface":
        ensure_hf_interface_registered()
        try:
            undo.append(install_private_config(target_module))
        except CPInterceptionError:
            if primitive != "hf_any":
                raise
            route = "sdpa"            # no routable HF config: only a direct SDPA call can be caught
    group = _rank_group(cp_mesh)
    handler = _make_handler(strategy, owner, validate_mode and style == "qkv", cp_mesh, check_repeat=validate_mode,
                            module=target_module if style in ("hf", "flex_hf") else None)
    interceptor = {"sdpa": intercept_sdpa, "hf_interface": intercept_hf_interface, "hf_any": intercept_hf_any}[primitive]
    sig = inspect.signature(original)

    def cp_forward(*args, **kwargs):
        if style == "qkv":
            try:
                sig.bind(*args, **kwargs)
            except TypeError as exc:
                raise TypeError(f"module '{owner}': {name} could not bind forward(q, k, v, ...): {exc}") from None
        with interceptor(owner, target_module, handler):
            out = original(*args, **kwargs)
        if validate_mode and style in ("hf", "flex_hf"):
            meta = current_cp_batch_meta()
            ref = _hf_module_reference(original, target_module, route, args, kwargs, meta, group, owner,
                                       orig_cfg)
            got = out[0] if isinstance(out, tuple) else out
            _compare(got, ref, _valid_query_rows(meta, got.shape[0]), 1, group, owner, "module output")
        return out

    cp_forward.__hp_undo__ = undo
    cp_forward.__hp_strategy__ = strategy
    cp_forward.__wrapped__ = original
    return cp_forward


def _install_flex_direct(target_module: nn.Module, strategy, cp_mesh, name: str) -> Callable:
    ctx = current_apply_context()
    owner = ctx.fqn or type(target_module).__name__
    validate_mode = ctx.mode == "validate"
    original = target_module.forward
    sig = inspect.signature(original)
    pos_names = [p.name for p in sig.parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:3]
    handler = _make_handler(strategy, owner, validate_mode, cp_mesh)
    groups = getattr(target_module, "num_key_value_groups", 1)

    def cp_forward(*args, **kwargs):
        try:
            b = sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"module '{owner}': {name} could not bind forward(q, k, v, ...): {exc}") from None
        a = dict(b.arguments)
        for p in sig.parameters.values():
            if p.kind == p.VAR_KEYWORD and p.name in a:
                a.update(a.pop(p.name))
        for bad in ("score_mod",):
            if a.get(bad) is not None:
                raise ValueError(f"module '{owner}': {name} does not support {bad} (the CP engine applies the "
                                 "causal/document rule of the CP batch); write a custom wrapper")
        if a.get("return_lse") or a.get("return_aux") is not None:
            raise ValueError(f"module '{owner}': {name} does not return the LSE")
        q, k, v = (a[n] for n in pos_names)
        scale = a.get("scale", a.get("scaling", a.get("softmax_scale")))
        call = AttentionCall(q=q, k=k, v=v, scale=scale, attn_mask=a.get("block_mask"),
                             enable_gqa=bool(a.get("enable_gqa", k.shape[1] != q.shape[1])),
                             kv_groups=groups if isinstance(groups, int) else 1, source="flex")
        scope = InterceptScope(owner, target_module, handler, "flex_attention")
        return scope.dispatch(call)

    cp_forward.__hp_undo__ = []
    cp_forward.__hp_strategy__ = strategy
    cp_forward.__wrapped__ = original
    return cp_forward


def _install(name: str, method: str, style: str, primitive: str, target_module, mesh, cp_mesh,
             ulysses_degree=None) -> Callable:
    strategy = _strategy(method, mesh, cp_mesh, ulysses_degree)
    hq, hk = module_heads(target_module)
    if hq is not None and hk is not None:
        strategy.validate(num_q_heads=hq, num_kv_heads=hk, cp_size=strategy.cp_size)
    if primitive == "flex_direct":
        return _install_flex_direct(target_module, strategy, cp_mesh, name)
    return _install_intercepting(target_module, strategy, primitive, style, cp_mesh, name)


# ============================================================================ the wrappers
_SPECS = {
    # function name: (registry name or None, method, style, primitive)
    "sdpa_hf_cp_wrapper": ("sdpa_hf", "colossal", "hf", "hf_any"),
    "sdpa_hf_ulysses_cp_wrapper": ("sdpa_hf_ulysses", "ulysses", "hf", "hf_any"),
    "sdpa_hf_hybrid_cp_wrapper": (None, "hybrid", "hf", "hf_any"),
    "sdpa_hf_load_balance_cp_wrapper": (None, "load_balance", "hf", "hf_any"),
    "sdpa_qkv_cp_wrapper": ("sdpa_qkv", "colossal", "qkv", "sdpa"),
    "sdpa_qkv_ulysses_cp_wrapper": ("sdpa_qkv_ulysses", "ulysses", "qkv", "sdpa"),
    "sdpa_qkv_hybrid_cp_wrapper": (None, "hybrid", "qkv", "sdpa"),
    "sdpa_qkv_load_balance_cp_wrapper": (None, "load_balance", "qkv", "sdpa"),
    "flex_hf_cp_wrapper": ("flex_hf", "colossal", "flex_hf", "hf_interface"),
    "flex_hf_ulysses_cp_wrapper": ("flex_hf_ulysses", "ulysses", "flex_hf", "hf_interface"),
    "flex_qkv_cp_wrapper": ("flex_qkv", "colossal", "flex_qkv", "flex_direct"),
    "flex_qkv_ulysses_cp_wrapper": ("flex_qkv_ulysses", "ulysses", "flex_qkv", "flex_direct"),
}
BUILTIN_NAMES = {reg: fn for fn, (reg, *_rest) in _SPECS.items() if reg}


def _meta(fn_name: str) -> dict:
    reg, method, style, primitive = _SPECS[fn_name]
    reg_style = {"hf": "hf", "qkv": "qkv", "flex_hf": "flex", "flex_qkv": "flex"}[style]
    return dict(method=method, style=reg_style, is_async=False, communicates=True,
                validate=_make_validate(fn_name, method, style, primitive))


def _args(fn_name: str):
    _reg, method, style, primitive = _SPECS[fn_name]
    return fn_name, method, style, primitive


@inner_wrapper(**_meta("sdpa_hf_cp_wrapper"))
def sdpa_hf_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Sync Colossal (K/V AllGather) for HF ``forward(hidden_states)`` + SDPA attention."""
    return _install(*_args("sdpa_hf_cp_wrapper"), target_module, mesh, cp_mesh)


@inner_wrapper(**_meta("sdpa_hf_ulysses_cp_wrapper"))
def sdpa_hf_ulysses_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Sync Pure Ulysses (ulysses_degree == cp_size) for HF SDPA attention."""
    return _install(*_args("sdpa_hf_ulysses_cp_wrapper"), target_module, mesh, cp_mesh)


@inner_wrapper(**_meta("sdpa_hf_hybrid_cp_wrapper"))
def sdpa_hf_hybrid_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh, ulysses_degree):
    """Sync Hybrid (Ulysses A2A in groups of ``ulysses_degree`` + Colossal K/V AllGather) for HF SDPA."""
    return _install(*_args("sdpa_hf_hybrid_cp_wrapper"), target_module, mesh, cp_mesh, ulysses_degree)


@inner_wrapper(**_meta("sdpa_hf_load_balance_cp_wrapper"))
def sdpa_hf_load_balance_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Sync Colossal with Head-Tail load balance for HF SDPA (batch policy 'load_balance')."""
    return _install(*_args("sdpa_hf_load_balance_cp_wrapper"), target_module, mesh, cp_mesh)


@inner_wrapper(**_meta("sdpa_qkv_cp_wrapper"))
def sdpa_qkv_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Sync Colossal for ``forward(q, k, v, ...)`` core attention calling SDPA."""
    return _install(*_args("sdpa_qkv_cp_wrapper"), target_module, mesh, cp_mesh)


@inner_wrapper(**_meta("sdpa_qkv_ulysses_cp_wrapper"))
def sdpa_qkv_ulysses_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Sync Pure Ulysses for ``forward(q, k, v, ...)`` core attention calling SDPA."""
    return _install(*_args("sdpa_qkv_ulysses_cp_wrapper"), target_module, mesh, cp_mesh)


@inner_wrapper(**_meta("sdpa_qkv_hybrid_cp_wrapper"))
def sdpa_qkv_hybrid_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh, ulysses_degree):
    """Sync Hybrid for ``forward(q, k, v, ...)`` core attention calling SDPA."""
    return _install(*_args("sdpa_qkv_hybrid_cp_wrapper"), target_module, mesh, cp_mesh, ulysses_degree)


@inner_wrapper(**_meta("sdpa_qkv_load_balance_cp_wrapper"))
def sdpa_qkv_load_balance_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Sync Colossal Head-Tail load balance for ``forward(q, k, v, ...)`` core attention calling SDPA."""
    return _install(*_args("sdpa_qkv_load_balance_cp_wrapper"), target_module, mesh, cp_mesh)


@inner_wrapper(**_meta("flex_hf_cp_wrapper"))
def flex_hf_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Sync Colossal for HF attention built with attn_implementation='flex_attention'."""
    return _install(*_args("flex_hf_cp_wrapper"), target_module, mesh, cp_mesh)


@inner_wrapper(**_meta("flex_hf_ulysses_cp_wrapper"))
def flex_hf_ulysses_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Sync Pure Ulysses for HF FlexAttention attention."""
    return _install(*_args("flex_hf_ulysses_cp_wrapper"), target_module, mesh, cp_mesh)


@inner_wrapper(**_meta("flex_qkv_cp_wrapper"))
def flex_qkv_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Sync Colossal for a ``forward(q, k, v, block_mask=None, scale=None)`` FlexAttention core module."""
    return _install(*_args("flex_qkv_cp_wrapper"), target_module, mesh, cp_mesh)


@inner_wrapper(**_meta("flex_qkv_ulysses_cp_wrapper"))
def flex_qkv_ulysses_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Sync Pure Ulysses for a FlexAttention core module."""
    return _install(*_args("flex_qkv_ulysses_cp_wrapper"), target_module, mesh, cp_mesh)


for _fn_name, _reg in [(fn, spec[0]) for fn, spec in _SPECS.items() if spec[0]]:
    register_inner_wrapper(_reg, globals()[_fn_name])
del _fn_name, _reg
