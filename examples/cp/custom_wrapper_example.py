"""Worked example of a custom CP wrapper (see docs/custom_wrapper.md; tested by tests/wrappers).

``my_allgather_cp_wrapper`` implements Colossal CP (K/V AllGather) for HF Llama/Qwen-style
attention by *replacing* ``target_module.forward`` in place (the design 3.4 contract) instead
of intercepting SDPA: it reuses the module's projections and RoPE, gathers K/V over the CP
group with the differentiable ``flex_cp_allgather`` (backward = reduce-scatter), and runs the
position-masked attention engine with the global positions / key doc ids of the CP batch.

Use it from YAML by import path (no registration needed)::

    plan_overrides:
      - match: "*.self_attn"
        when: cp
        region_dispatch: false
        inner_target: self
        inner_wrapper:
          _target_: examples.cp.custom_wrapper_example.my_allgather_cp_wrapper

or by the registry name ``my_allgather`` once this module is imported.
"""
from __future__ import annotations

import torch.nn as nn

from hyper_parallel import ops
from hyper_parallel.distributed.context_parallel import inner_wrapper, register_inner_wrapper
from hyper_parallel.distributed.context_parallel.collectives import flex_cp_allgather
from hyper_parallel.distributed.context_parallel.meta import current_cp_batch_meta


def validate_my_allgather(target_module: nn.Module, *, cp_size: int) -> None:
    """Runs at resolution, before any step: raise ValueError to reject the declaration."""
    missing = [n for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim") if not hasattr(target_module, n)]
    if missing:
        raise ValueError(f"my_allgather needs an HF Llama-style attention; {type(target_module).__name__} "
                         f"has no {missing}")
    cfg = target_module.config
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(f"num_attention_heads={cfg.num_attention_heads} is not a multiple of "
                         f"num_key_value_heads={cfg.num_key_value_heads}")


@inner_wrapper(method="colossal", style="hf", validate=validate_my_allgather)
def my_allgather_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Replace ``target_module.forward`` in place; Colossal CP written out explicitly."""
    del mesh, tp_mesh, ep_mesh                 # this method only needs the CP group
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = target_module

    def cp_forward(hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        del attention_mask, kwargs             # HF's *local* mask is never trusted under CP
        meta = current_cp_batch_meta()         # global positions + key doc ids of this step
        B, S, _ = hidden_states.shape          # S = local sequence length
        shape = (B, S, -1, attn.head_dim)
        q = attn.q_proj(hidden_states).view(shape).transpose(1, 2)     # [B, Hq, S, D]
        k = attn.k_proj(hidden_states).view(shape).transpose(1, 2)     # [B, Hk, S, D]
        v = attn.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = position_embeddings         # built by HF from the *global* position_ids
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k_all, v_all = flex_cp_allgather(k, v, 2, cp_mesh)              # [B, Hk, S_global, D]
        q_doc, k_doc = meta.doc_slice(meta.q_index), meta.doc_slice(meta.k_index)
        out = ops.attention(q, k_all, v_all, q_pos=meta.q_index, k_pos=meta.k_index, causal=meta.causal,
                            q_doc=q_doc, k_doc=k_doc, scale=attn.scaling)  # [B, Hq, S, D]
        out = out.transpose(1, 2).reshape(B, S, -1)
        return attn.o_proj(out), None

    target_module.forward = cp_forward         # in place: the wrapper returns None


register_inner_wrapper("my_allgather", my_allgather_cp_wrapper, overwrite=True)


# ---------------------------------------------------------------------------------------------
# Shortcut (docs/custom_wrapper.md section 3): keep the module's forward, swap only the method by
# intercepting its single SDPA call and handing q/k/v to a strategy.
from hyper_parallel.distributed.context_parallel.interception import intercept_sdpa  # noqa: E402
from hyper_parallel.distributed.context_parallel.strategies import build_strategy  # noqa: E402


@inner_wrapper(method="colossal", style="hf")
def my_sdpa_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    strategy = build_strategy("colossal", mesh)
    original = target_module.forward

    def handler(call):                         # call.q / call.k / call.v: [B, H, S_local, D]
        return strategy.attention(call.q, call.k, call.v, meta=current_cp_batch_meta(), scale=call.scale)

    def forward(*args, **kwargs):
        with intercept_sdpa("my_sdpa_wrapper", target_module, handler):   # raises on 0 or 2 calls
            return original(*args, **kwargs)

    return forward
