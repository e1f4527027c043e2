"""Validate mode (``apply_sharding_plan(mode="validate")``): compare every CP call with a reference.

The CP path's outputs and gradients are unchanged; next to it a full-sequence reference is
computed from the CP-gathered input and :class:`CPValidationError` is raised on every CP rank
when they differ by more than :data:`VALIDATE_TOLERANCE`:

* HF styles (:func:`hf_module_reference`): the module's original forward on the gathered
  sequence; an attention-interface call is computed by the module's own attention function
  with the model's own mask for the layer, an SDPA-route call by the engine;
* qkv styles (:func:`validate_qkv_attention`): this rank's queries attend to the gathered K/V with
  the engine (float32 for half inputs);
* :func:`check_repeat_kv`: K/V that reach attention with Hq heads really are ``repeat_kv`` copies.

Only validate mode builds an ``S x S`` mask (the model's own, for its reference); production
never does. The gathers (``tag="cp.validate"``) and the agreement flag run on the CP group.
"""
from __future__ import annotations

import copy
import inspect
from typing import Callable, Optional

import torch
import torch.nn as nn

from .... import platform as P
from ..comm import resolve_group
from ..interception import AttentionCall, intercept_hf_interface, intercept_sdpa
from ..meta import CPBatchMeta
from ..methods.base import engine_attention
from .heads import unrepeat_kv

__all__ = ["CPValidationError", "VALIDATE_TOLERANCE", "rank_group", "valid_query_rows", "compare",
           "full_sequence_attention", "validate_qkv_attention", "check_repeat_kv", "hf_module_reference"]

# |cp - ref| <= atol + rtol * max|ref| over valid query rows (per dtype of the CP output)
VALIDATE_TOLERANCE = {
    torch.float64: (1e-8, 1e-8),
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (1e-2, 1e-2),
}


class CPValidationError(RuntimeError):
    """Validate mode: the CP path and the original path disagree beyond tolerance."""


def rank_group(cp_mesh):
    """The CP process group of ``cp_mesh`` (mesh, group, or None for cp 1)."""
    return resolve_group(cp_mesh)


def _gather_seq(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    if P.group_size(group) == 1:
        return x
    return P.all_gather(x.detach().contiguous(), group, dim=dim, tag="cp.validate")


def valid_query_rows(meta: CPBatchMeta, B: int) -> Optional[torch.Tensor]:
    doc = meta.doc_slice(meta.q_index)
    return None if doc is None else (doc >= 0)       # [B, S_local]


def compare(out: torch.Tensor, ref: torch.Tensor, rows: Optional[torch.Tensor], seq_dim: int, group,
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


def full_sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_pos: torch.Tensor,
                         meta: CPBatchMeta, scale, window=None, softcap=None, sinks=None) -> torch.Tensor:
    """Validate mode's reference: queries at global ``q_pos`` over the *whole* key sequence.

    k/v ``[B, Hk, S, D]`` hold every key (global positions ``0..S-1``, ``S ==
    meta.global_seq_len``); q ``[B, Hq, len(q_pos), D]``. Runs the engine
    (:func:`hyper_parallel.ops.attention`, global positions and the doc ids of ``meta``, no
    mask is built) in float32 for half-precision inputs (float64 stays float64) and returns q's
    dtype. Called under ``no_grad``; local only (no collective).
    """
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = engine_attention(q.to(acc), k.to(acc), v.to(acc), q_pos=q_pos, k_pos=meta.k_index, meta=meta,
                           scale=scale, window=window, softcap=softcap,
                           sinks=None if sinks is None else sinks.detach().to(acc))
    return out.to(q.dtype)


def validate_qkv_attention(out, q, k, v, call: AttentionCall, meta: CPBatchMeta, cp_mesh, owner: str) -> None:
    """qkv styles: compare the CP output with this rank's queries attending to the gathered K/V."""
    group = rank_group(cp_mesh)
    kf, vf = (_gather_seq(t, group, 2) for t in (k, v))     # [B, Hk, S, D]: every key
    with torch.no_grad():
        ref = full_sequence_attention(q.detach(), kf, vf, q_pos=meta.q_index, meta=meta, scale=call.scale,
                                       window=call.window, softcap=call.softcap, sinks=call.sinks)
    compare(out, ref, valid_query_rows(meta, out.shape[0]), 2, group, owner, "attention output")


def check_repeat_kv(call: AttentionCall, owner: str) -> None:
    """Validate mode: the un-repeat assumption (k_rep[:, h*g + j] == k_rep[:, h*g])."""
    g = call.kv_groups
    k = call.k
    if call.enable_gqa or g <= 1 or k.shape[1] != call.q.shape[1]:
        return
    kk = k.detach().unflatten(1, (k.shape[1] // g, g))
    if not torch.equal(kk, kk[:, :, :1].expand_as(kk)):
        raise CPValidationError(f"module '{owner}': K/V heads reach SDPA with Hq heads but are not a repeat_kv "
                                f"copy (groups={g}); declare num_key_value_groups correctly or pass enable_gqa")


def hf_module_reference(original: Callable, module: nn.Module, primitive: str, args, kwargs,
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
    lo = meta.cp_rank * meta.local_seq_len            # rank order of the gather (= the permuted row, balanced)
    return out[:, lo:lo + meta.local_seq_len]


def _model_mask(module: nn.Module, cfg, call: AttentionCall, hidden: torch.Tensor, meta: CPBatchMeta, impl: str):
    """The mask the model itself builds for this layer, on the global sequence.

    transformers' own mask function for the layer's type (``config.layer_types[layer_idx]``, else
    the config's ``sliding_window``: Mistral-style models), evaluated with the original
    attention implementation's mask format on the gathered (padded) sequence; padding and packed
    documents of the batch (``meta.key_doc``) enter as an ``and_mask_function``; bidirectional blocks
    (``meta.key_block``) as transformers' Gemma 3 masks compose them: window AND (causal OR block).
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

    if meta.key_block is not None:
        from transformers.masking_utils import and_masks, blockwise_overlay, sliding_window_overlay

        window_fn = sliding_window_overlay(cfg.sliding_window) if sliding else None
        extra = [f for f in (and_fn, window_fn) if f is not None]
        return create_causal_mask(config=mask_cfg, inputs_embeds=hidden, attention_mask=None, cache=None,
                                  position_ids=None, or_mask_function=blockwise_overlay(meta.key_block.to(hidden.device)),
                                  and_mask_function=and_masks(*extra) if extra else None, allow_is_causal_skip=False)
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
            # they are not compared (valid_query_rows)
            return out.transpose(1, 2).to(call.q.dtype)
        k, v = unrepeat_kv(call)
        return full_sequence_attention(call.q, k, v, q_pos=meta.k_index, meta=meta, scale=call.scale,
                                        window=call.window, softcap=call.softcap, sinks=call.sinks)

    ctx = intercept_sdpa if primitive == "sdpa" else intercept_hf_interface
    with ctx(f"{owner} (validate reference)", module, ref_handler):
        return original(**kwargs)
