"""Every rejection fails fast with a message naming what does not fit, before any collective."""
import dataclasses

import pytest
import torch

from hyper_parallel import platform as P
from hyper_parallel.distributed.context_parallel.batch import CPBatchError, shard_batch_for_cp
from hyper_parallel.distributed.context_parallel.meta import CPBatchMeta
from hyper_parallel.distributed.context_parallel.strategies import (AllGatherStrategy, HeadTailStrategy,
                                                                   HybridStrategy, UlyssesStrategy,
                                                                   build_strategy)
from hyper_parallel.distributed.mesh import MeshConfigError
from tests.cp.common import mesh_ctx


def _qkv(hq, hk, s, b=1, d=4):
    return torch.zeros(b, hq, s, d), torch.zeros(b, hk, s, d), torch.zeros(b, hk, s, d)


def strategy_rejections():
    ctx = mesh_ctx(4, (2,))
    meta = CPBatchMeta(cp_rank=ctx.cp_rank, cp_size=4, global_seq_len=16, local_seq_len=4, key_doc=None)
    uly, hyb = build_strategy("ulysses", ctx), build_strategy("hybrid", ctx, ulysses_degree=2)
    ag, ht = build_strategy("colossal", ctx), build_strategy("load_balance", ctx)
    cases = {
        # uneven heads and KV heads fewer than the degree are split (tests/cp/test_ulysses_heads.py);
        # what still has no exact split: fewer query heads than the degree, or not GQA
        "uly_q_heads": lambda: uly.attention(*_qkv(3, 3, 4), meta=meta),
        "uly_mqa_few_q": lambda: uly.attention(*_qkv(2, 1, 4), meta=meta),
        "uly_validate": lambda: uly.validate(num_q_heads=6, num_kv_heads=4, cp_size=4),
        "hyb_heads": lambda: hyb.attention(*_qkv(1, 1, 4), meta=meta),
        "hyb_cp_not_multiple": lambda: hyb.validate(num_q_heads=4, num_kv_heads=2, cp_size=5),
        "hyb_not_gqa": lambda: hyb.validate(num_q_heads=4, num_kv_heads=3, cp_size=4),
        "hyb_u_eq_cp": lambda: build_strategy("hybrid", mesh_ctx(4, (4,)), ulysses_degree=4),
        "hyb_u_missing": lambda: build_strategy("hybrid", ctx),
        "hyb_undeclared": lambda: build_strategy("hybrid", ctx, ulysses_degree=3),
        "ag_gqa": lambda: ag.attention(*_qkv(4, 3, 4), meta=meta),
        "ag_cp_mismatch": lambda: ag.validate(num_q_heads=4, num_kv_heads=2, cp_size=2),
        "ag_seq_mismatch": lambda: ag.attention(*_qkv(4, 2, 5), meta=meta),
        "ag_meta_rank": lambda: ag.attention(*_qkv(4, 2, 4), meta=dataclasses.replace(
            meta, cp_rank=(ctx.cp_rank + 1) % 4)),
        "ht_with_ulysses": lambda: build_strategy("load_balance", ctx, ulysses_degree=2),
        "ht_with_hybrid": lambda: build_strategy("head_tail", ctx, ulysses_degree=4),
        "ht_policy": lambda: ht.attention(*_qkv(4, 2, 3), meta=dataclasses.replace(
            meta, global_seq_len=12, local_seq_len=3, policy="all_gather")),
        "uly_degree": lambda: build_strategy("ulysses", ctx, ulysses_degree=2),
        "colossal_degree": lambda: build_strategy("colossal", ctx, ulysses_degree=2),
        "unknown_method": lambda: build_strategy("ring", ctx),
    }
    out = {}
    with P.comm_counter() as recs:
        for name, fn in cases.items():
            try:
                fn()
                out[name] = None
            except (ValueError, MeshConfigError) as exc:
                out[name] = f"{type(exc).__name__}: {exc}"
    return out, len(recs)


EXPECT = {
    "uly_q_heads": ["num_q_heads=3 < cp_size (ulysses_degree)=4", "num_kv_heads=3", "at least one query head"],
    "uly_mqa_few_q": ["num_q_heads=2 < cp_size (ulysses_degree)=4", "num_kv_heads=1", "Ulysses degree <= 2"],
    "uly_validate": ["num_q_heads=6 must be a positive multiple of num_kv_heads=4"],
    "hyb_heads": ["num_q_heads=1 < ulysses_degree=2", "colossal"],
    "hyb_cp_not_multiple": ["cp_size % ulysses_degree == 0", "ulysses_degree=2, cp_size=5"],
    "hyb_not_gqa": ["num_q_heads=4 must be a positive multiple of num_kv_heads=3"],
    "hyb_u_eq_cp": ["1 < ulysses_degree < cp_size", "ulysses_degree=4, cp_size=4"],
    "hyb_u_missing": ["needs ulysses_degree"],
    "hyb_undeclared": ["MeshConfigError", "ulysses_degree=3"],
    "ag_gqa": ["num_q_heads=4 must be a positive multiple of num_kv_heads=3"],
    "ag_cp_mismatch": ["cp_size=2", "has size 4", "num_q_heads=4", "num_kv_heads=2"],
    "ag_seq_mismatch": ["local sequence length 5 != meta.local_seq_len 4"],
    "ag_meta_rank": ["meta was built for cp rank"],
    "ht_with_ulysses": ["Head-Tail", "ulysses_degree=2", "not supported"],
    "ht_with_hybrid": ["Head-Tail", "ulysses_degree=4"],
    "ht_policy": ["not a multiple of 2*cp_size=8", "policy='load_balance'"],
    "uly_degree": ["ulysses_degree == cp_size=4", "got ulysses_degree=2"],
    "colossal_degree": ["colossal (AllGather) CP takes no ulysses_degree"],
    "unknown_method": ["unknown CP method 'ring'"],
}


def test_strategy_rejections_before_any_collective(ranks):
    for r, (msgs, n_comm) in enumerate(ranks(4).run(strategy_rejections)):
        assert n_comm == 0, f"rank {r}: a rejection issued {n_comm} collectives first"
        for name, needles in EXPECT.items():
            assert msgs[name] is not None, f"{name} was not rejected"
            for needle in needles:
                assert needle in msgs[name], f"{name}: {needle!r} not in {msgs[name]!r}"


def test_validate_messages_single_process():
    from hyper_parallel.distributed.context_parallel.methods.ulysses.strategy import check_head_split
    with pytest.raises(ValueError, match=r"num_q_heads=2 < ulysses_degree=3 .*use ulysses_degree in \[2\]"):
        check_head_split("HybridStrategy", 2, 2, 3, "ulysses_degree", cp_size=6)
    assert check_head_split("HybridStrategy", 4, 4, 3, "ulysses_degree").q_counts == (2, 1, 1)   # uneven: split
    AllGatherStrategy(None).validate(num_q_heads=4, num_kv_heads=1, cp_size=1)       # MQA is fine
    HeadTailStrategy(None).validate(num_q_heads=6, num_kv_heads=3, cp_size=1)
    UlyssesStrategy(None).validate(num_q_heads=6, num_kv_heads=3, cp_size=1)
    with pytest.raises(ValueError, match="1 < ulysses_degree < cp_size"):
        HybridStrategy(None, None)


def test_batch_rejections():
    ids = torch.ones(2, 8, dtype=torch.long)
    cases = {
        "past_key_values": ({"input_ids": ids, "past_key_values": object()}, "past_key_values"),
        "use_cache": ({"input_ids": ids, "use_cache": True}, "use_cache=True"),
        "mask_4d": ({"input_ids": ids, "attention_mask": torch.ones(2, 1, 8, 8)}, "4-D tensor"),
        "unknown": ({"input_ids": ids, "pixel_values": torch.ones(2, 3)}, "unknown batch field 'pixel_values'"),
        "shape": ({"input_ids": ids, "labels": torch.ones(2, 7, dtype=torch.long)}, "expected [B=2, S=8]"),
        "lens_overflow": ({"input_ids": ids, "seq_lens": torch.tensor([[5, 4], [1, 1]])}, "need 9 tokens"),
        "padded_alone": ({"input_ids": ids, "seq_lens_padded": torch.tensor([[8], [8]])}, "needs seq_lens"),
        "policy": ({"input_ids": ids}, "unknown CP padding policy 'zigzag'"),
        "no_seq": ({"attention_mask": torch.ones(2, 8)}, "needs input_ids"),
    }
    for name, (batch, needle) in cases.items():
        with P.comm_counter() as recs, pytest.raises(CPBatchError) as ei:
            shard_batch_for_cp(batch, (0, 2), "zigzag" if name == "policy" else "all_gather")
        assert needle in str(ei.value), f"{name}: {ei.value}"
        assert recs == []
    with pytest.raises(CPBatchError, match="names CP-sharded fields"):
        shard_batch_for_cp({"input_ids": ids}, (0, 2), passthrough=("labels",))
    out = shard_batch_for_cp({"input_ids": ids, "pixel_values": torch.ones(2, 3), "use_cache": False},
                             (1, 2), passthrough=("pixel_values",))
    assert torch.equal(out["pixel_values"], torch.ones(2, 3)) and out["use_cache"] is False
