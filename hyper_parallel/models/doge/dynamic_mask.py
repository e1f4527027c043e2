"""Doge's dynamic mask attention (``DogeAttention``) under CP: ``doge_dynamic_mask``.

Doge adds to every score ``scale * q.k`` a per-key, per-KV-head bias ``dt = exp(A * softplus(dt_proj(v)))``
computed from the key's value states, and keeps per query only the ``keep_window_size`` keys with
the largest bias. Both live only in the mask it passes to the attention call (which the generic CP
wrappers do not use), so this method re-runs the module's lines (transformers 5.24):

1. q, k, v, RoPE (global positions from the applier) and ``dt [B, Hk, L]`` on the local tokens;
2. the bias folded into one more key channel: ``q' = [q, 1/scale]``, ``k' = [k, dt]`` so that
   ``scale * q'.k' = scale * q.k + dt`` (one fp32 rounding; the gradient reaches ``A`` / ``dt_proj``
   through ``k'``);
3. ONE AllGather of ``[k' | v]`` along the sequence (Colossal; backward ReduceScatter) and the
   engine's causal attention on global positions with the batch's documents and padding, and
   ``config.sliding_window`` when set (the model then builds a sliding-window mask); no mask is built;
4. ``o_proj``.

The top-``keep_window_size`` selection is a no-op while no query sees more than
``keep_window_size`` keys (no document, or sliding window, longer: every visible key is kept); a batch with a longer document is refused at the
call, before any collective and on every rank alike (the meta is global). The forward carries
``__hp_ignores_model_mask__``: under CP the base model builds no ``[B, 1, L, L]`` mask
(:mod:`~hyper_parallel.distributed.context_parallel.interception.model_mask`). Training only (no cache).
docs/wrappers.md, "Doge".
"""
from __future__ import annotations

import inspect
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...distributed.context_parallel.collectives import all_gather_seq
from ...distributed.context_parallel.interception.model_mask import IGNORES_MODEL_MASK
from ...distributed.context_parallel.mixers import register_catalogue_names
from ...distributed.context_parallel.mixers.rows import CPMixerError, bound_call, current_fqn, require_class
from ...distributed.context_parallel.registry import inner_wrapper
from ...distributed.context_parallel.strategies import engine_attention

__all__ = ["DOGE_CLASSES", "doge_dynamic_mask_cp_wrapper", "longest_document"]

DOGE_CLASSES = ("DogeAttention",)


def longest_document(meta) -> int:
    """Length of the longest document of the CP batch (the unpadded row when there are none)."""
    if meta.key_doc is None:
        return int(meta.seq_len if meta.seq_len is not None else meta.global_seq_len)
    kd = meta.key_doc
    idx = torch.arange(kd.shape[1], device=kd.device).expand_as(kd)
    new_run = torch.ones_like(kd, dtype=torch.bool)
    new_run[:, 1:] = kd[:, 1:] != kd[:, :-1]
    start = torch.where(new_run, idx, torch.zeros_like(idx)).cummax(dim=1).values
    length = torch.where(kd >= 0, idx - start + 1, torch.zeros_like(idx))
    return int(length.max()) if length.numel() else 0


def validate_doge(target_module: nn.Module, *, cp_size: int, tp_size: int = 1) -> None:
    del cp_size
    what = "doge_dynamic_mask_cp_wrapper"
    require_class(what, target_module, tp_size, DOGE_CLASSES, "re-runs the forward of DogeAttention")
    p = float(getattr(target_module, "attention_dropout", 0.0) or 0.0)
    if p > 0:
        raise ValueError(f"{what}: DogeAttention has attention_dropout={p}; the CP attention computes no "
                         "dropout — set attention_dropout: 0.0")


@inner_wrapper(method="custom", style="hf", mixer=True, validate=validate_doge)
def doge_dynamic_mask_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Doge's attention with its dynamic mask under CP (module docstring): the per-key bias as an
    extra key channel, one AllGather of ``[k' | v]``, the engine on global positions and documents.
    Forward: 1 AllGather; backward: 1 ReduceScatter. Refused (before any collective) when a
    document is longer than ``keep_window_size`` (the dynamic top-k would then drop keys)."""
    del mesh, tp_mesh, ep_mesh
    what = "doge_dynamic_mask_cp_wrapper"
    m = target_module
    original = m.forward
    fqn = current_fqn()
    hf = sys.modules[type(m).__module__]
    sig = inspect.signature(type(m).forward)

    def forward(*args, **kwargs):
        entry = bound_call(what, fqn, sig, m, cp_mesh, args, kwargs)
        if entry is None:
            return original(*args, **kwargs)
        meta, a, hs = entry
        window = getattr(m.config, "sliding_window", None)     # the model's mask is then a sliding window
        longest = longest_document(meta)
        if min(longest, window or longest) > m.keep_window_size:
            raise CPMixerError(
                f"{what} on '{fqn}': Doge's dynamic mask keeps only the keep_window_size={m.keep_window_size} keys "
                f"with the largest bias per query, and this batch has a document of {longest} tokens, so the "
                "selection would drop keys; CP does not carry that selection — use documents of at most "
                "keep_window_size tokens (seq_len / packing), or accelerator.cp_size: 1")
        B, L, _ = hs.shape
        shape = (B, L, -1, m.head_dim)
        q = m.q_norm(m.q_proj(hs).view(shape)).transpose(1, 2)
        k = m.k_norm(m.k_proj(hs).view(shape)).transpose(1, 2)
        v = m.v_proj(hs).view(shape).transpose(1, 2)
        cos, sin = a["position_embeddings"]
        q, k = hf.apply_rotary_pos_emb(q, k, cos, sin)
        dt = m.dt_proj(v.transpose(1, 2).reshape(B, L, -1))
        dt = torch.exp(m.A * F.softplus(dt)).transpose(-1, -2)                    # [B, Hk, L]
        q1 = torch.cat([q, q.new_full((*q.shape[:-1], 1), 1.0 / m.scaling)], dim=-1)
        k1 = torch.cat([k, dt.unsqueeze(-1).to(k.dtype)], dim=-1)                 # [B, Hk, L, D + 1]
        D1 = k1.shape[-1]
        g = all_gather_seq(torch.cat([k1, v], dim=-1).contiguous(), cp_mesh, dim=2, tag="cp.doge_kv")
        out = engine_attention(q1, g[..., :D1], g[..., D1:], q_pos=meta.q_index, k_pos=meta.k_index, meta=meta,
                               scale=m.scaling, window=window)                    # [B, Hq, L, D]
        out = m.o_proj(out.transpose(1, 2).reshape(B, L, -1).contiguous())
        return out, None

    forward.__wrapped__ = original
    forward.__hp_mixer__ = what
    setattr(forward, IGNORES_MODEL_MASK, True)      # causal, documents, padding: from the batch meta only
    return forward


register_catalogue_names(__name__, globals())
