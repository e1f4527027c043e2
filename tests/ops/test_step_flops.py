"""benchmarks/step_flops.py counts what FlopCounterMode counts where both apply (no timing here)."""
import os
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
from step_flops import causal_pairs, llama_step_flops  # noqa: E402

CFG = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=64)


def _counted(attn: str, batch: int, seq: int) -> dict:
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CFG), attn_implementation=attn)
    ids = torch.randint(0, CFG["vocab_size"], (batch, seq))
    with FlopCounterMode(display=False) as fc:
        model(input_ids=ids).logits.square().mean().backward()
    return {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}


def test_eager_attention_step_equals_flop_counter():
    """Eager attention: every product an aten matmul; full S x S scores, backward 2x forward."""
    counts = _counted("eager", 2, 16)
    f = llama_step_flops(CFG, 2, 16, pairs=2 * 16 * 16, attn_bwd_factor=2)
    assert sum(counts.values()) == f.model
    assert counts["aten.bmm"] == 3 * f.attention_fwd


def test_matmuls_without_attention_equal_flop_counter():
    """SDPA's CPU kernel is not counted by FlopCounterMode: the projections, MLP and head are."""
    counts = _counted("sdpa", 1, 24)
    f = llama_step_flops(CFG, 1, 24)
    assert "aten.bmm" not in counts and counts["aten.mm"] == 3 * f.matmul_fwd


def test_causal_pairs_and_recompute():
    assert causal_pairs(4) == 10 and causal_pairs(4, batch=3) == 30
    base = llama_step_flops(CFG, 1, 32)
    ac = llama_step_flops(CFG, 1, 32, recompute_layers=True, recompute_head=True)
    assert base.hardware == base.model and ac.model == base.model
    assert ac.hardware == pytest.approx(base.model + base.matmul_fwd + base.attention_fwd)
    mlp = llama_step_flops(CFG, 1, 32, recompute_mlp=True)
    h, i, n_layers = CFG["hidden_size"], CFG["intermediate_size"], CFG["num_hidden_layers"]
    assert mlp.hardware - mlp.model == 2 * 32 * n_layers * 3 * h * i
