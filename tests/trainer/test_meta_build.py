"""Meta-device build: the model is built on ``meta``, the plan (TP -> CP -> AC -> FSDP2)
is applied to the empty model, and each rank materializes only its own shards.

Asserted on 2 gloo ranks (one worker call per topology, several checks each):
* every parameter equals the ordinary, unsharded build at the same seed (max abs diff 0), names too;
* at materialization every tensor was still on ``meta`` and every decoder-layer weight matrix is a
  shard of every decoder-layer weight matrix (local numel < full numel);
* no tensor of the full shape of a sharded decoder-layer weight matrix is allocated on the device from the
  build to the end of materialization (host-side unit twins excluded by design, see model.py);
* one training step runs and gives the same loss on both ranks.
"""
from __future__ import annotations

import math

import pytest

from . import _meta_workers as MW
from . import _workers as W


def _check(results, label):
    for rank, r in enumerate(results):
        worst = max(r["diffs"].values())
        print(f"{label} rank {rank}: max |sharded - ordinary| = {worst:.3e} over {len(r['diffs'])} params, "
              f"{r['n_allocs']} device allocations recorded, loss {r['loss']:.6f}")
        assert r["names"] == r["ref_names"], label
        assert worst == 0.0, {k: v for k, v in r["diffs"].items() if v}
        assert r["meta_at_materialize"] is True
        assert r["full_layer_allocs"] == [], r["full_layer_allocs"]
        # decoder-layer weight matrices (norm vectors stay replicated under TP)
        layer_params = {n: v for n, v in r["local"].items() if ".layers." in n and len(v[0]) >= 2}
        assert layer_params
        for n, (full, local) in layer_params.items():
            assert math.prod(local) < math.prod(full), (n, full, local)   # a shard, never the whole tensor
        if r["tied_in_trainer"] is not None:
            assert r["tied_in_trainer"] is True
    assert results[0]["loss"] == results[1]["loss"]


@pytest.mark.parametrize("arch,kw", [
    ("llama", dict(cp=2)),                                      # CP=2 + FSDP2
    ("qwen3_moe", dict(cp=2, ac=True)),                         # MoE experts, activation checkpointing
    ("llama", dict(tp=2, plan=False)),                          # TP=2 (DTensor shards, no FSDP)
], ids=["llama-cp2-fsdp", "qwen3moe-cp2-ac", "llama-tp2"])
def test_meta_build_equals_ordinary_build_and_materializes_only_shards(ranks, tmp_path, arch, kw):
    cfg = W.make_cfg(arch, out_dir=str(tmp_path), steps=1, **kw)
    _check(ranks(2).run(MW.meta_build_report, cfg, timeout=240), f"{arch} {kw}")


def test_meta_build_tied_embeddings_stay_tied(ranks, tmp_path):
    cfg = W.make_cfg("llama", out_dir=str(tmp_path), steps=1, cp=2)
    cfg["model"]["config"] = {"tie_word_embeddings": True}
    _check(ranks(2).run(MW.meta_build_report, cfg, timeout=240), "llama tied cp2")


def test_buffers_a_parent_init_writes_come_from_the_constructor():
    """Falcon-H1's ``mup_vector`` (non-persistent, per layer) is written by the *model's*
    ``_init_weights``, not the layer's: the meta build takes it from a parameter-less construction
    and equals transformers' own build; every buffer of the model is checked."""
    import torch
    import transformers

    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.model import HyperAutoModel

    hf = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
              mamba_d_state=8, ssm_in_multiplier=0.5, mlp_multipliers=[1.0, 0.5])
    ours = HyperAutoModel.from_config(TrainerConfig.from_dict({"model": {"architecture": "falcon_h1",
                                                                         "config": hf}}).model)
    ref = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("falcon_h1", **hf))
    ref_buffers = dict(ref.named_buffers())
    assert any("mup_vector" in n for n in ref_buffers)
    for name, buf in ours.named_buffers():
        assert torch.equal(buf, ref_buffers[name]), name
    assert all(bool(torch.isfinite(p).all()) for p in ours.parameters())
