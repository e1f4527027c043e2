"""Installation: the CP forward of a built-in wrapper, one route per attention primitive.

* :func:`install` — build the method's strategy (:func:`strategy_for`), check it against the
  module's heads, and return the CP forward for the style's primitive:
  ``hf_any`` (HF forward; the probe picks transformers' attention interface — a private config
  naming ``hyper_parallel_cp`` — or the module's direct SDPA call), ``sdpa`` (direct SDPA call of
  a qkv core), ``hf_interface`` (HF flex_attention models), ``flex_direct`` (the whole body of a
  flex qkv core is replaced);
* :func:`make_handler` — what runs in place of the one intercepted attention call: local-tensor
  and call checks, the packed-documents check against the model's own mask, GQA un-repeat,
  autocast, then ``strategy.attention`` (validate mode adds the comparison).

The returned forward carries ``__hp_undo__`` (config restorers), ``__hp_strategy__`` and
``__wrapped__`` (the original forward).
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, Optional

import torch
import torch.nn as nn

from .. import catalogue
from ..interception import (AttentionCall, CPInterceptionError, InterceptScope, current_apply_context,
                            ensure_hf_interface_registered, install_private_config, intercept_hf_any,
                            intercept_hf_interface, intercept_sdpa)
from ..meta import (AS_TRANSFORMERS, INDEPENDENT, CPBatchMeta, current_cp_batch_meta, documents_semantics,
                    with_attention_chunk)
from ..semantics import attention_chunk_size, mixer_hint, query_position_rescale
from ..methods.factory import build_strategy
from .heads import module_heads, unrepeat_kv
from .preflight import check_call, check_core_call, probe
from .validate_mode import (check_repeat_kv, compare, hf_module_reference, rank_group, valid_query_rows,
                            validate_qkv_attention)

__all__ = ["install", "strategy_for", "make_handler"]


def strategy_for(method: str, mesh, cp_mesh, ulysses_degree=None):
    """The sync strategy of catalogue ``method`` on this wrapper's groups (never creates one):
    a method with a degree parameter (Hybrid) takes its cached sub-groups from the MeshContext
    ``mesh``; the others use the MeshContext's CP mesh, else ``cp_mesh``."""
    row = catalogue.get_method(method)
    if row.degree == "param":
        if mesh is None or not hasattr(mesh, "hybrid_groups"):
            raise ValueError(f"the {row.name} wrapper needs the MeshContext (mesh) to find its cached sub-groups")
        return build_strategy(row.name, mesh, ulysses_degree=ulysses_degree)
    src = mesh if (mesh is not None and hasattr(mesh, "cp_mesh")) else cp_mesh
    return build_strategy(method, src)


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor" or hasattr(t, "_local_tensor")


def _check_model_separates_documents(call: AttentionCall, meta: CPBatchMeta, owner: str) -> None:
    """Packed rows given as restarting position_ids: the model's own local mask must separate the
    documents CP derived. transformers derives them only where the model passes position_ids to
    its mask functions (e.g. gpt-oss does not: at CP=1 its documents see each other), and only
    without a KV cache (``use_cache=False``, training); a model that does not is refused instead
    of computing something else than at CP=1. Checked once per batch per module, on the local chunk."""
    if not getattr(meta, "docs_from_positions", False) or call.source != "hf_interface" or \
            meta.documents == INDEPENDENT:     # declared: each document alone at every CP size, whatever the mask
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
            "else than CP=1 — refused. Declare packed_documents: independent (each document alone at every CP "
            "size, CP=1 included), or do not pack rows for this model")


def carry_module_semantics(q: torch.Tensor, meta, module: nn.Module):
    """``(q, meta)`` for one call of ``module``: Llama 4 chunked attention folded into the meta's
    documents (:func:`~..meta.with_attention_chunk`), and a NoPE layer's temperature tuning moved
    from the module's local row index to the global positions ``meta.position_ids`` (restarting per
    packed document: every document computes as if alone, as the CP=1 reference of the proof does;
    the global row index when the meta has none, or when packed documents are declared
    ``as_transformers``: transformers tunes on the row index). q ``[B, Hq, S_local, D]`` is the
    contiguous chunk ``meta.cp_rank``. Unchanged for any other module."""
    chunk = attention_chunk_size(module)
    if chunk is not None:
        meta = with_attention_chunk(meta, chunk, q.shape[0])
    local = torch.arange(q.shape[2], dtype=torch.int64)[None]
    glob = meta.q_index[None]
    if meta.position_ids is not None:
        glob = meta.position_ids.index_select(1, meta.q_index.to(meta.position_ids.device)).cpu()
    fac = query_position_rescale(module, local, glob)
    if fac is not None and meta.position_ids is not None and \
            documents_semantics(meta, f"module {type(module).__name__}") == AS_TRANSFORMERS:
        fac = query_position_rescale(module, local, meta.q_index[None])      # transformers tunes on the row index
    if fac is not None:
        q = (q * fac.to(q.device)[:, None, :, None]).to(q.dtype)
    return q, meta


def make_handler(strategy, owner: str, validate_attention: bool, cp_group, check_repeat: bool = False,
                  module: Optional[nn.Module] = None, core: bool = False):
    """The handler of one wrapped module. ``module``: an HF-style module (its calls are checked with
    :func:`check_call`); ``core``: a ``*_qkv`` SDPA core (:func:`check_core_call`: a mask is refused,
    ``is_causal`` is carried — False runs full attention over the global keys)."""
    checked = [None]      # the meta whose documents were checked against the model's mask

    def handler(call: AttentionCall) -> torch.Tensor:
        meta = current_cp_batch_meta()
        for name, t in (("q", call.q), ("k", call.k), ("v", call.v)):
            if not isinstance(t, torch.Tensor) or _is_dtensor(t):
                raise TypeError(f"module '{owner}': the intercepted attention got a {type(t).__name__} {name}; "
                                "CP wrappers need local tensors (TP plans must use use_local_output=True)")
        if module is not None:
            check_call(call, module, f"module '{owner}'", at="at the call")
        elif core:
            if not check_core_call(call, f"module '{owner}'", at="at the call") and meta.causal:
                meta = dataclasses.replace(meta, causal=False)     # this call only: full attention
        else:
            if call.dropout_p:
                raise ValueError(f"module '{owner}': attention dropout_p={call.dropout_p} is not supported by CP")
            if call.extra:
                raise ValueError(f"module '{owner}': {sorted(call.extra)} are not supported by the CP attention")
        if module is not None and id(meta) != checked[0]:
            checked[0] = id(meta)
            _check_model_separates_documents(call, meta, owner)
        if validate_attention or check_repeat:
            check_repeat_kv(call, owner)
        k, v = unrepeat_kv(call)
        q = call.q
        if module is not None:
            q, meta = carry_module_semantics(q, meta, module)
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
            validate_qkv_attention(out, q, k, v, call, meta, cp_group, owner)
        return out

    return handler


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
        res = probe(primitive, target_module, owner)
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
    group = rank_group(cp_mesh)
    cp_size = strategy.cp_size
    handler = make_handler(strategy, owner, validate_mode and style == "qkv", cp_mesh, check_repeat=validate_mode,
                            module=target_module if catalogue.STYLES[style].forward == "hf" else None,
                            core=style == "qkv" and primitive == "sdpa")
    interceptor = {"sdpa": intercept_sdpa, "hf_interface": intercept_hf_interface,
                   "hf_any": intercept_hf_any}[primitive]
    sig = inspect.signature(original)

    def cp_forward(*args, **kwargs):
        if style == "qkv":
            try:
                sig.bind(*args, **kwargs)
            except TypeError as exc:
                raise TypeError(f"module '{owner}': {name} could not bind forward(q, k, v, ...): {exc}") from None
        scope = None
        try:
            with interceptor(owner, target_module, handler) as scope:
                out = original(*args, **kwargs)
        except CPInterceptionError as exc:
            if style != "hf" or scope is None or scope.count:
                raise
            # misfire of an HF-style module: most often a token mixer named like attention
            raise CPInterceptionError(f"{exc}; {mixer_hint(target_module, cp_size, owner)}") from None
        if validate_mode and catalogue.STYLES[style].forward == "hf":
            meta = current_cp_batch_meta()
            ref = hf_module_reference(original, target_module, route, args, kwargs, meta, group, owner,
                                       orig_cfg)
            got = out[0] if isinstance(out, tuple) else out
            compare(got, ref, valid_query_rows(meta, got.shape[0]), 1, group, owner, "module output")
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
    handler = make_handler(strategy, owner, validate_mode, cp_mesh)
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


def install(name: str, method: str, style: str, target_module, mesh, cp_mesh, ulysses_degree=None) -> Callable:
    """Install entry point ``name`` (catalogue ``method`` x ``style``) on ``target_module``; return
    the CP forward (the applier installs it). The strategy is built from the cached groups and
    checked against the module's heads first (no collective before a refusal)."""
    primitive = catalogue.STYLES[style].primitive
    strategy = strategy_for(method, mesh, cp_mesh, ulysses_degree)
    hq, hk = module_heads(target_module)
    if hq is not None and hk is not None:
        strategy.validate(num_q_heads=hq, num_kv_heads=hk, cp_size=strategy.cp_size)
    if primitive == "flex_direct":
        return _install_flex_direct(target_module, strategy, cp_mesh, name)
    return _install_intercepting(target_module, strategy, primitive, style, cp_mesh, name)
