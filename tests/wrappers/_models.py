"""Tiny models for the wrapper tests (importable inside rank workers; nothing is downloaded).

* ``build(cfg_path, overrides)``: the YAML's HF model (Llama / Qwen3, sdpa or flex_attention).
* ``to_qkv(model, core)``: the same weights with each ``self_attn`` delegating the attention
  to a ``core_attention`` child with ``forward(q, k, v, ...)`` — SDPA (``SDPACore``) or
  FlexAttention (``FlexCore``) — the calling convention of the ``*_qkv`` wrappers.
* Misbehaving attention modules for the fail-fast tests.
"""
from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_cfg(cfg_path: str, overrides=()):
    from hyper_parallel.trainer.config import TrainerConfig

    path = cfg_path if os.path.isabs(cfg_path) else os.path.join(ROOT, cfg_path)
    cwd = os.getcwd()
    os.chdir(ROOT)            # model.config_file paths are relative to the repository root
    try:
        cfg = TrainerConfig.from_yaml(path, overrides)
    finally:
        os.chdir(cwd)
    return cfg


def build_hf(model_cfg, attn_implementation: str | None = None):
    import dataclasses

    from hyper_parallel.trainer.model import build_model

    if attn_implementation is not None:
        model_cfg = dataclasses.replace(model_cfg, attn_implementation=attn_implementation)
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return build_model(model_cfg)
    finally:
        os.chdir(cwd)


class SDPACore(nn.Module):
    """``forward(q, k, v, scale=None)`` core attention calling SDPA (GQA via enable_gqa)."""

    def __init__(self, num_heads: int, num_key_value_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.num_key_value_heads = num_key_value_heads

    def forward(self, q, k, v, scale=None):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)


class RepeatSDPACore(SDPACore):
    """Like SDPACore but passes repeat_kv'ed K/V (Hq heads) — the HF repeat_kv path."""

    def forward(self, q, k, v, scale=None):
        g = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(g, dim=1)
        v = v.repeat_interleave(g, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    @property
    def num_key_value_groups(self):
        return self.num_heads // self.num_key_value_heads


class FlexCore(nn.Module):
    """``forward(q, k, v, block_mask=None, scale=None)`` causal core attention around flex_attention:
    without a ``block_mask`` it builds the causal one (flex_attention alone is full attention) — what
    the ``flex_qkv*`` wrappers compute, so the preflight proof's reference (this forward) agrees."""

    def __init__(self, num_heads: int, num_key_value_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.num_key_value_heads = num_key_value_heads

    def forward(self, q, k, v, block_mask=None, scale=None):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if block_mask is None:
            block_mask = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, q.shape[2], k.shape[2],
                                           device=q.device)
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


def _qkv_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    out = self.core_attention(q, k, v, scale=self.scaling)           # [B, H, S, D]
    out = out.transpose(1, 2).reshape(*input_shape, -1).contiguous()
    return self.o_proj(out), None


_QKV_CLASSES: dict = {}


def _qkv_class(base):
    if base not in _QKV_CLASSES:
        _QKV_CLASSES[base] = type(f"QKV{base.__name__}", (base,), {"forward": _qkv_forward})
    return _QKV_CLASSES[base]


def to_qkv(model, core: str = "sdpa"):
    """In place: every self_attn computes attention through ``self_attn.core_attention``."""
    cls = {"sdpa": SDPACore, "sdpa_repeat": RepeatSDPACore, "flex": FlexCore}[core]
    cfg = model.config
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.__class__ = _qkv_class(type(attn))
        attn.core_attention = cls(cfg.num_attention_heads, cfg.num_key_value_heads)
    return model


# ------------------------------------------------------------------ misbehaving attention
class NoSDPAAttention(nn.Module):
    """An attention boundary whose forward(hidden_states) never calls SDPA (misfire)."""

    def __init__(self, hidden: int = 64, heads: int = 4):
        super().__init__()
        self.q_proj = nn.Linear(hidden, hidden)
        self.head_dim = hidden // heads
        self.num_heads = heads
        self.num_key_value_heads = heads

    def forward(self, hidden_states, attention_mask=None):
        return self.q_proj(hidden_states), None


class TwoSDPAAttention(NoSDPAAttention):
    """forward(hidden_states) calling SDPA twice (double interception)."""

    def forward(self, hidden_states, attention_mask=None):
        B, S, H = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        b = F.scaled_dot_product_attention(a, q, q, is_causal=True)
        return b.transpose(1, 2).reshape(B, S, H), None


class ToyLayer(nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.self_attn = attn
        self.mlp = nn.Linear(64, 64)


class ToyModel(nn.Module):
    def __init__(self, attn_cls):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([ToyLayer(attn_cls()) for _ in range(2)])


def extra_kwarg_attention(model, name: str = "foo_bias", value=1.0):
    """In place: every ``self_attn`` passes one more kwarg to its attention interface (an input the
    CP attention does not understand)."""
    for layer in model.model.layers:
        attn = layer.self_attn
        base = type(attn)

        def forward(self, hidden_states, position_embeddings=None, attention_mask=None, _base=base, **kwargs):
            return _base.forward(self, hidden_states, position_embeddings, attention_mask, **{name: value},
                                 **kwargs)

        attn.__class__ = type(f"ExtraKwarg{base.__name__}", (base,), {"forward": forward})
    return model
