"""Tiny random Kimi Linear (``kimi_linear``: KDA + MLA), MiniMax (``minimax``: lightning attention +
softmax attention), Jamba (``jamba``: Mamba1 ``mamba`` + attention) and Falcon-Mamba (``falcon_mamba``:
Mamba1 ``mixer`` only), RecurrentGemma (``recurrent_gemma``: RG-LRU + local attention, both
``temporal_block``) for the CP parity tests: layer 0 the linear mixer, layer 1 the softmax
attention (Kimi Linear and MiniMax name both ``self_attn``), fp32, nothing downloaded."""
from __future__ import annotations

import torch

#: the plan matches of the two mixers (both families name every token mixer ``self_attn``)
LINEAR_FQN = "model.layers.0.self_attn"
ATTN_FQN = "model.layers.1.self_attn"


def build_linear_attention(arch: str):
    import transformers as T

    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, attn_implementation="sdpa",
                  layer_types=["linear_attention", "full_attention"])
    if arch == "kimi_linear":
        cfg = T.KimiLinearConfig(**common, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16,
                                 qk_nope_head_dim=16, linear_head_dim=16, linear_num_heads=4,
                                 linear_conv_kernel_dim=4, mlp_layer_types=["dense", "dense"],
                                 num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 pad_token_id=0, bos_token_id=1, eos_token_id=2)
    elif arch == "minimax":
        cfg = T.MiniMaxConfig(**common, head_dim=16, num_local_experts=4, num_experts_per_tok=2, block_size=16)
    elif arch == "jamba":
        common.pop("layer_types")
        cfg = T.JambaConfig(**common, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                            expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8,
                            mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, use_mamba_kernels=False)
    elif arch == "falcon_mamba":
        cfg = T.FalconMambaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  state_size=8, conv_kernel=4, time_step_rank=8)
    elif arch == "recurrent_gemma":
        cfg = T.RecurrentGemmaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=1, lru_width=64, conv1d_width=4,
                                     attention_window_size=1024, block_types=["recurrent", "attention"],
                                     attn_implementation="sdpa")
    else:
        raise ValueError(arch)
    model = T.AutoModelForCausalLM.from_config(cfg)
    if arch == "kimi_linear":      # default init forgets within a token (decay ~exp(-50)): a slow decay
        with torch.no_grad():      # so a test can tell whether the state crossed a rank edge
            gate = model.model.layers[0].self_attn.forget_gate
            gate.A_log.fill_(-0.6931)
            gate.dt_bias.fill_(-2.0)
    return model
