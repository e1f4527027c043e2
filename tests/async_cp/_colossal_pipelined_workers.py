"""Rank functions of tests/async_cp/test_async_colossal_pipelined.py (module-level for the warm gloo pool).

The K/V pipeline depth G of async Colossal is passed as the YAML parameter ``kv_chunks`` of the
model adapters' Targets (``<arch>_async_colossal_cp_wrapper``) and of the generic
``async_colossal_cp_wrapper``; every case installs its own wrappers, so nothing global changes.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from tests.async_cp._workers import ADAPTERS, SYNC, _apply, _err, _grads, build, compare_async
from tests.wrappers._workers import attention_batch, cp_forward_backward, mesh_ctx


def colossal_cases(cases) -> list:
    """[(arch, kind, S, G, cp)] on this rank -> one dict per case: logits and every gradient
    (summed over CP) of the async Colossal adapter with ``kv_chunks=G`` vs the sync
    ``sdpa_hf_cp_wrapper`` and vs CP=1 (max abs and relative to the reference's largest |logit| /
    |gradient|), the handles pending after forward+backward and the per-name trace counts."""
    out = []
    for i, (arch, kind, S, G, cp) in enumerate(cases):
        mesh = mesh_ctx(cp)
        model_a, model_s, ref = build(arch, 3)
        model_a, plan_a = _apply(model_a, mesh, cp, ADAPTERS[arch] + "colossal_cp_wrapper", {"kv_chunks": G})
        model_s, plan_s = _apply(model_s, mesh, cp, SYNC + "sdpa_hf_cp_wrapper", {})
        out.append({"case": f"{arch}/colossal/{kind}/S={S}/G={G}/cp={cp}",
                    **compare_async(model_a, plan_a, model_s, plan_s, ref, mesh, kind, S, seed=i)})
    return out


def colossal_trace(arch: str, G: int, S: int = 64) -> dict:
    """One forward+backward of the async Colossal adapter with ``kv_chunks=G`` on a padded batch:
    the ``async_trace`` ``(event, name)`` list, the handles pending afterwards, the local length."""
    from hyper_parallel.distributed.context_parallel.async_collectives import async_trace
    from hyper_parallel.platform import pending_handles

    mesh = mesh_ctx(2)
    [model] = build(arch, 1)
    model, plan = _apply(model, mesh, 2, ADAPTERS[arch] + "colossal_cp_wrapper", {"kv_chunks": G})
    batch, _ref, valid = attention_batch("padding", S, model.config.vocab_size)
    with async_trace() as trace:
        _full, _w, meta = cp_forward_backward(model, mesh, plan, batch, valid, seed=0, use_cache=False)
    return {"trace": [(e, n) for e, n, _t in trace], "pending": pending_handles(),
            "local_seq_len": meta.local_seq_len, "layers": model.config.num_hidden_layers}


# ----------------------------------------------------------------------------- sinks (generic wrapper)
def _sink_attention_class():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as sink_eager

    from examples.cp.async_custom_adapter_example import TinyAttention

    class SinkAttention(TinyAttention):
        """The worked example's attention with gpt-oss style per-head sinks (``s_aux``): the CP
        interface receives them as ``s_aux``; the eager reference (gpt-oss's
        ``eager_attention_forward``) reads ``module.sinks``."""

        def __init__(self, config):
            super().__init__(config)
            self.sinks = nn.Parameter(torch.randn(config.num_attention_heads,
                                                  generator=torch.Generator().manual_seed(11)))

        def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
            from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

            shape = (*hidden_states.shape[:-1], -1, self.head_dim)
            cos, sin = position_embeddings

            def rope(x):
                return apply_rotary_pos_emb(x, x[:, :0], cos, sin)[0]

            k = self.cp_k_handoff(rope(self.k_proj(hidden_states).view(shape).transpose(1, 2)))
            v = self.cp_v_handoff(self.v_proj(hidden_states).view(shape).transpose(1, 2))
            q = self.cp_q_handoff(rope(self.q_proj(hidden_states).view(shape).transpose(1, 2)))
            q, k, v = self.cp_attn_wait(q, k, v)
            attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, sink_eager)
            out, weights = attention(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
                                     s_aux=self.sinks, **kwargs)
            return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), weights

    return SinkAttention


def sinks_parity(Gs, S: int = 32) -> list:
    """The generic ``async_colossal_cp_wrapper`` with ``kv_chunks=G`` on an attention with sinks at
    cp 2 (fp32): output and every gradient (summed over CP, sinks included) vs the same module on
    the whole sequence in float64 (gpt-oss's eager sink softmax, a causal additive mask; the CP=1
    reference) and vs the same wrapper at G = 1 (the unpipelined order). One dict per G."""
    import copy

    import transformers as T

    from hyper_parallel.distributed.context_parallel.batch import shard_batch_for_cp
    from hyper_parallel.distributed.context_parallel.meta import cp_batch_context
    from hyper_parallel.distributed.context_parallel.wrappers import async_colossal_cp_wrapper
    from hyper_parallel.platform import all_gather, all_reduce, pending_handles

    cls = _sink_attention_class()
    cfg = T.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    base = cls(cfg)
    rope = T.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    mesh = mesh_ctx(2)
    h = torch.randn(2, S, 64, generator=torch.Generator().manual_seed(3))
    dout = torch.randn(2, S, 64, generator=torch.Generator().manual_seed(4))
    pos = torch.arange(S)[None].expand(2, -1)

    ref = copy.deepcopy(base).double()
    ref.config = copy.deepcopy(cfg)
    ref.config._attn_implementation = "eager"
    causal = torch.full((S, S), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    cos, sin = rope(h, pos)
    out_ref, _ = ref(h.double(), (cos.double(), sin.double()), attention_mask=causal)
    out_ref.backward(dout.double())
    gref = {n: p.grad for n, p in ref.named_parameters()}
    gmax = max(g.abs().max().item() for g in gref.values())

    local = shard_batch_for_cp({"input_ids": torch.zeros(2, S, dtype=torch.long)}, mesh.cp_mesh, "all_gather")
    lo, L = local.meta.cp_rank * local.meta.local_seq_len, local.meta.local_seq_len
    hl = h[:, lo:lo + L]
    results, first = [], None
    for G in Gs:
        attn = copy.deepcopy(base)
        async_colossal_cp_wrapper.__hp_inner_wrapper__.validate(attn, cp_size=2, kv_chunks=G)
        attn.forward = async_colossal_cp_wrapper(attn, mesh, None, mesh.cp_mesh, None, kv_chunks=G)
        with cp_batch_context(local.meta):
            out, _ = attn(hidden_states=hl, position_embeddings=rope(hl, local["position_ids"]))
            out.backward(dout[:, lo:lo + L])
        pending = pending_handles()
        full = all_gather(out.detach(), mesh.cp_group, dim=1)
        g = {n: all_reduce(p.grad, mesh.cp_group) for n, p in attn.named_parameters()}
        if first is None:
            first = (full, g)
        o_abs = (full.double() - out_ref.detach()).abs().max().item()
        g_abs = max((g[n].double() - gref[n]).abs().max().item() for n in g)
        o_g1 = (full - first[0]).abs().max().item()
        g_g1 = max((g[n] - first[1][n]).abs().max().item() for n in g)
        results.append({"G": G, "out_abs_cp1": o_abs, "out_rel_cp1": o_abs / out_ref.abs().max().item(),
                        "grads_abs_cp1": g_abs, "grads_rel_cp1": g_abs / gmax,
                        "sinks_grad_rel_cp1": (g["sinks"].double() - gref["sinks"]).abs().max().item()
                        / gref["sinks"].abs().max().item(),
                        "out_rel_g1": o_g1 / out_ref.abs().max().item(), "grads_rel_g1": g_g1 / gmax,
                        "pending": pending})
    return results
