"""HF checkpoints shard by shard: ``save_hf`` after sharded training reloads in plain
transformers with the trained model's logits; ``model.path`` loads each rank's slices (dtype cast,
tied embeddings, a vocabulary resized for the tokenizer); a checkpoint that does not match the
config fails before the first step naming the tensor, identically on every rank.

Tolerances: logits of the reloaded export vs the trained model (its full parameters put into the
ordinary build) <= 1e-5 x max|logits| (the same fp32 weights; the bound only absorbs kernel
order); loaded parameters vs transformers' own load of the same files: exactly equal.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from . import _data_workers as D
from . import _meta_workers as MW
from . import _workers as W

ROOT = W.ROOT


def _export_case(ranks, n, tmp_path, label, **kw):
    out = str(tmp_path / "export")
    cfg = W.make_cfg("llama", out_dir=str(tmp_path / "run"), steps=2, **kw)
    res = ranks(n).run(MW.train_then_export, cfg, out, D.TOKENIZER, timeout=300)
    r0 = res[0]
    rel = r0["max_abs"] / r0["scale"]
    print(f"{label}: reloaded logits max abs {r0['max_abs']:.3e} (relative {rel:.2e}), files {r0['files']}")
    assert rel <= 1e-5, r0
    assert r0["loaded_class"] == "LlamaForCausalLM" and r0["use_cache"] is True
    assert "model.safetensors.index.json" in r0["files"] and "config.json" in r0["files"]
    assert "tokenizer.json" in r0["files"] and r0["tokenizer_len"] == D.VOCAB
    assert sum(f.endswith(".safetensors") for f in r0["files"]) == n     # one output file per rank
    assert not any(f.startswith(".hp_sharded") for f in r0["files"])
    assert all(r["losses"] == r0["losses"] for r in res)
    return out


def test_save_hf_after_cp2_fsdp_reloads_in_plain_transformers(ranks, tmp_path):
    out = _export_case(ranks, 2, tmp_path, "CP=2 + FSDP2", cp=2)
    index = json.loads(open(os.path.join(out, "model.safetensors.index.json")).read())
    assert "lm_head.weight" in index["weight_map"] and "model.embed_tokens.weight" in index["weight_map"]


def test_save_hf_after_tp2_cp2_reloads_in_plain_transformers(ranks, tmp_path):
    _export_case(ranks, 4, tmp_path, "TP=2 x CP=2", cp=2, tp=2)


def _hf_checkpoint(tmp_path, *, dtype=torch.float32, tie=False, edit=None, max_shard_size=None) -> str:
    """A local HF checkpoint written by plain transformers (random tiny Llama), then edited."""
    import transformers

    d = W.make_cfg("llama")
    import yaml

    kwargs = yaml.safe_load(open(d["model"]["config_file"]))
    cfg = transformers.LlamaConfig(**{**kwargs, "tie_word_embeddings": tie})
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    path = tmp_path / "hf_checkpoint"
    model.save_pretrained(str(path), **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if edit:
        f = str(path / "model.safetensors")
        sd = load_file(f)
        edit(sd)
        save_file(sd, f, metadata={"format": "pt"})
    return str(path)


def _path_cfg(tmp_path, ckpt: str, **kw) -> dict:
    cfg = W.make_cfg("llama", out_dir=str(tmp_path / "run"), steps=1, **kw)
    cfg["model"] = {"path": ckpt, "seed": 0}
    return cfg


@pytest.mark.parametrize("dtype,tie,shard", [(torch.bfloat16, False, "40KB"), (torch.float32, True, None)],
                         ids=["bf16-ckpt-sharded-index", "tied-single-file"])
def test_model_path_loads_each_ranks_slices(ranks, tmp_path, dtype, tie, shard):
    ckpt = _hf_checkpoint(tmp_path, dtype=dtype, tie=tie, max_shard_size=shard)
    n_files = len([f for f in os.listdir(ckpt) if f.endswith(".safetensors")])
    assert (n_files > 1) == (shard is not None) and os.path.exists(os.path.join(ckpt, "model.safetensors.index.json")) \
        == (shard is not None), os.listdir(ckpt)
    res = ranks(2).run(MW.load_report, _path_cfg(tmp_path, ckpt, cp=2), ckpt, timeout=240)
    for rank, r in enumerate(res):
        worst = max(r["diffs"].values())
        print(f"{dtype} tied={tie} rank {rank}: max |loaded - transformers| = {worst:.3e}, loss {r['loss']:.5f}")
        assert worst == 0.0, r["diffs"]
        assert r["tied"] is tie
        for n, (full, local) in r["local"].items():
            if ".layers." in n and len(full) >= 2:
                assert local[0] * 2 == full[0], (n, full, local)      # FSDP2 shard, never the whole
    assert res[0]["loss"] == res[1]["loss"]


def test_model_path_vocab_resized_for_the_tokenizer(ranks, tmp_path):
    ckpt = _hf_checkpoint(tmp_path)                  # vocab 256
    docs = D.short_docs_jsonl(str(tmp_path / "docs.jsonl"), n_docs=40)
    cfg = D.trainer_cfg(D.data_cfg(docs, str(tmp_path / "cache")), cp=2, out_dir=str(tmp_path / "run"), steps=1)
    cfg["model"] = {"path": ckpt, "seed": 0}
    res = ranks(2).run(MW.load_report, cfg, ckpt, timeout=240)
    for r in res:
        assert r["vocab"] == D.VOCAB
        old_rows = {k: v for k, v in r["diffs"].items() if "rows std" not in k}
        assert max(old_rows.values()) == 0.0, old_rows
        for k in ("model.embed_tokens.weight[new rows std]", "lm_head.weight[new rows std]"):
            assert 0.015 < r["diffs"][k] < 0.025, (k, r["diffs"][k])    # the model's init (std 0.02)
    assert res[0]["loss"] == res[1]["loss"]


def _drop(name):
    return lambda sd: sd.pop(name)


def _add(sd):
    sd["model.layers.0.self_attn.extra_bias"] = torch.zeros(4)


def _reshape(sd):
    sd["model.layers.1.mlp.up_proj.weight"] = sd["model.layers.1.mlp.up_proj.weight"][:-1].contiguous()


def _int(sd):
    sd["model.norm.weight"] = torch.ones_like(sd["model.norm.weight"], dtype=torch.int32)


@pytest.mark.parametrize("edit,expect", [
    (_drop("model.layers.1.self_attn.k_proj.weight"), "tensor model.layers.1.self_attn.k_proj.weight of the model is missing"),
    (_add, "has tensor model.layers.0.self_attn.extra_bias that the model does not"),
    (_reshape, "tensor model.layers.1.mlp.up_proj.weight has shape [127, 64] in the checkpoint but [128, 64]"),
    (_int, "tensor model.norm.weight is I32 in the checkpoint and cannot be cast"),
], ids=["missing", "extra", "shape", "dtype"])
def test_mismatching_checkpoint_fails_before_the_first_step(ranks, tmp_path, edit, expect):
    ckpt = _hf_checkpoint(tmp_path, edit=edit)
    errs = ranks(2).run(W.build_error, _path_cfg(tmp_path, ckpt, cp=2), timeout=240)
    print(errs[0])
    for err in errs:
        assert err is not None and err[0] == "CPConfigError", err
        assert "[model.path]" in err[1] and expect in err[1], err
    assert errs[0] == errs[1]



def test_sharded_checkpoint_with_a_missing_file_fails_naming_it(ranks, tmp_path):
    ckpt = _hf_checkpoint(tmp_path, max_shard_size="40KB")
    index = json.loads(open(os.path.join(ckpt, "model.safetensors.index.json")).read())["weight_map"]
    gone = sorted(set(index.values()))[-1]
    os.remove(os.path.join(ckpt, gone))
    errs = ranks(2).run(W.build_error, _path_cfg(tmp_path, ckpt, cp=2), timeout=240)
    for err in errs:
        assert err is not None and err[0] == "CPConfigError" and f"to {gone}, which does not exist" in err[1], err
    assert errs[0] == errs[1]
