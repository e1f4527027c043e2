"""Worked example (docs/async_cp.md): async CP for an attention of your own through the handoff protocol.

1. The attention owns four parameter-free handoff modules and returns them from
   ``get_async_cp_handoffs()``; its forward computes K and V first, passes each tensor through its
   handoff right after its last safe point (projection, norm, RoPE: the ``[B, H, S, D]`` layout the
   attention consumes), computes the Q branch (the compute the K/V collectives overlap), passes Q
   through ``cp_q_handoff``, then ``cp_attn_wait(q, k, v)``, then ONE call of transformers' attention
   interface (``ALL_ATTENTION_FUNCTIONS``) and ``o_proj``.
2. A thin ``@inner_wrapper`` names the model it is written for (``model_adapter`` = the config's
   ``model_type``) and calls the generic installation; the preflight hook is the generic one.

Declare it in YAML like any Target::

    inner_wrapper: {_target_: examples.cp.async_custom_adapter_example.tiny_async_colossal_cp_wrapper}
"""
from __future__ import annotations

import torch
import torch.nn as nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward

from hyper_parallel.distributed.context_parallel.registry import inner_wrapper
from hyper_parallel.distributed.context_parallel.wrappers.async_handoff import (AttnWait, HandoffPoint,
                                                                                 install_async, validate_async)


class TinyAttention(nn.Module):
    """GQA attention with RoPE (position_embeddings = (cos, sin) from the model's rotary embedding)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = 0.0
        self.is_causal = True
        h, hq, hk = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(h, hq * self.head_dim)
        self.k_proj = nn.Linear(h, hk * self.head_dim)
        self.v_proj = nn.Linear(h, hk * self.head_dim)
        self.o_proj = nn.Linear(hq * self.head_dim, h)
        # the protocol: four handoff modules owned by this attention (no parameters)
        self.cp_q_handoff, self.cp_k_handoff, self.cp_v_handoff = HandoffPoint("q"), HandoffPoint("k"), HandoffPoint("v")
        self.cp_attn_wait = AttnWait()

    def get_async_cp_handoffs(self) -> dict:
        return {"q": self.cp_q_handoff, "k": self.cp_k_handoff, "v": self.cp_v_handoff, "wait": self.cp_attn_wait}

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        cos, sin = position_embeddings

        def rope(x):                                   # the model's RoPE on one tensor
            return apply_rotary_pos_emb(x, x[:, :0], cos, sin)[0]

        k = self.cp_k_handoff(rope(self.k_proj(hidden_states).view(shape).transpose(1, 2)))   # launch K
        v = self.cp_v_handoff(self.v_proj(hidden_states).view(shape).transpose(1, 2))         # launch V
        q = self.cp_q_handoff(rope(self.q_proj(hidden_states).view(shape).transpose(1, 2)))   # overlaps K, V
        q, k, v = self.cp_attn_wait(q, k, v)                                                  # wait
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, weights = attention(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), weights


def _validate(target_module, *, cp_size, tp_size=1, probe=True):
    validate_async(target_module, "colossal", "tiny_async_colossal_cp_wrapper", cp_size=cp_size, tp_size=tp_size,
                   probe=probe)


@inner_wrapper(method="colossal", style="model", is_async=True, model_adapter="tiny", validate=_validate)
def tiny_async_colossal_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Async Colossal for TinyAttention: K/V AllGather launched at the K/V handoffs, waited at cp_attn_wait."""
    return install_async("colossal", target_module, mesh, cp_mesh, "tiny_async_colossal_cp_wrapper")


__all__ = ["TinyAttention", "tiny_async_colossal_cp_wrapper"]
_ = torch  # (torch is what users will need next to this file)
