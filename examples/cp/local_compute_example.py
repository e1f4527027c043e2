"""A ``local_compute_fn`` that takes over a Llama attention's whole local-region compute.

Declared in YAML instead of an ``inner_wrapper`` (see examples/cp/local_compute.yaml). The
framework installs ``forward = partial(fn, module, cp_mesh=<cp mesh>, **named_params)``; the
function reuses the module's projections and HF's RoPE and runs Colossal CP itself
(K/V AllGather through the platform, engine attention with the batch's global positions).
"""
from __future__ import annotations


def llama_colossal_local_compute(module, hidden_states, position_embeddings=None, attention_mask=None, *,
                                 cp_mesh, **kwargs):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from hyper_parallel.distributed.context_parallel import AllGatherStrategy, current_cp_batch_meta

    del attention_mask, kwargs                    # HF's local mask is not used under CP
    meta = current_cp_batch_meta()
    bsz, seqlen, _ = hidden_states.shape
    shape = (bsz, seqlen, -1, module.head_dim)
    q = module.q_proj(hidden_states).view(shape).transpose(1, 2)
    k = module.k_proj(hidden_states).view(shape).transpose(1, 2)
    v = module.v_proj(hidden_states).view(shape).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    out = AllGatherStrategy(cp_mesh).attention(q, k, v, meta=meta, scale=module.scaling)
    return module.o_proj(out.transpose(1, 2).reshape(bsz, seqlen, -1)), None
