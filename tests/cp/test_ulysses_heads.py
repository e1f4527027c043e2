"""Ulysses and Hybrid for every head layout: KV heads fewer than the degree (MQA / GQA,
replicated, never averaged), head counts the degree does not divide (uneven split), sinks
following their heads, heads per TP rank.

Model parity: a real transformers model class (tiny random Qwen3 / gpt-oss, fp32, train(), dropout
0) through the built-in wrappers (``sdpa_hf_ulysses``, ``flex_hf_ulysses``, Hybrid u=2) on the
batch contract's padding and packed documents (``seq_lens``), against the same weights at CP=1:
logits over valid tokens max |diff| <= ``LOGIT_TOL``, every parameter gradient max |g_cp - g_cp1|
/ the largest |g_cp1| <= ``GRAD_TOL``. Each pool call checks several cases (one model per head
layout). Layout unit checks (single process) pin the per-rank heads and the KV copies sent.
"""
import contextlib

import pytest
import torch

from hyper_parallel.distributed.context_parallel.methods.ulysses.layout import ulysses_head_layout
from tests.wrappers import _workers as W

LOGIT_TOL = 1e-5
GRAD_TOL = 1e-5


# ---------------------------------------------------------------------------- layouts (no ranks)
@pytest.mark.parametrize("hq,hk,u,q,kv", [
    (8, 8, 4, (2, 2, 2, 2), ((0, 1), (2, 3), (4, 5), (6, 7))),     # even: classic split, no copy
    (8, 2, 4, (2, 2, 2, 2), ((0,), (0,), (1,), (1,))),              # GQA Hk = u/2: each KV head to 2 ranks
    (4, 1, 4, (1, 1, 1, 1), ((0,), (0,), (0,), (0,))),              # MQA: the one KV head to every rank
    (6, 2, 4, (2, 1, 2, 1), ((0,), (0,), (1,), (1,))),              # uneven: extra heads placed at group starts
    (6, 6, 4, (2, 2, 1, 1), ((0, 1), (2, 3), (4,), (5,))),          # MHA uneven: no copy
    (10, 5, 4, (3, 3, 2, 2), ((0, 1), (1, 2), (3,), (4,))),         # ranks 0, 1 split KV group 1
])
def test_layout_per_rank_heads(hq, hk, u, q, kv):
    lay = ulysses_head_layout(hq, hk, u)
    assert lay.q_counts == q and lay.kv_heads == kv, lay.describe()
    g = hq // hk
    for r, (a, b) in enumerate(lay.q_ranges):         # every query head's KV head is on its rank
        assert all(h // g in lay.kv_heads[r] for h in range(a, b))
    assert max(lay.q_counts) - min(lay.q_counts) <= 1
    assert f"q per rank {list(q)}" in lay.describe()


def test_layout_sends_each_kv_head_fewest_times():
    """Among all balanced contiguous splits, the chosen one has the fewest KV copies (brute force)."""
    import itertools

    for hq, hk, u in [(6, 2, 4), (12, 3, 8), (10, 5, 4), (9, 3, 4), (14, 2, 4), (7, 7, 3)]:
        g, lo, extra = hq // hk, hq // u, hq % u
        best = min(sum((a + n - 1) // g - a // g + 1 for a, n in zip(
            itertools.accumulate((0,) + sizes[:-1]), sizes))
            for sizes in set(itertools.permutations((lo + 1,) * extra + (lo,) * (u - extra))))
        assert ulysses_head_layout(hq, hk, u).kv_copies == best, (hq, hk, u)


def test_kv_map_args_give_every_query_head_its_kv_head():
    """For every layout up to 16 heads and degree 8: the engine map of ``kv_map_args(i)`` (or its
    plain GQA when empty) sends each local query head to the local index of KV head ``h // (Hq/Hk)``
    among ``kv_heads[i]`` — and the map is empty exactly when plain GQA already does that."""
    from hyper_parallel.ops.attention import kv_head_map

    checked = mapped = 0
    for hq in range(1, 17):
        for hk in (d for d in range(1, hq + 1) if hq % d == 0):
            for u in range(1, min(hq, 8) + 1):
                lay = ulysses_head_layout(hq, hk, u)
                for i in range(u):
                    a, b = lay.q_ranges[i]
                    kv = lay.kv_heads[i]
                    want = [kv.index(h // (hq // hk)) for h in range(a, b)]
                    args = lay.kv_map_args(i)
                    group, offset = kv_head_map(b - a, len(kv), **args)   # raises if the map is malformed
                    got = [(h + offset) // group for h in range(b - a)]
                    assert got == want, (hq, hk, u, i, args)
                    nq, nk = b - a, len(kv)
                    plain = nq % nk == 0 and want == [h // (nq // nk) for h in range(nq)]
                    assert bool(args) != plain, (hq, hk, u, i, args)     # a map only where GQA is wrong
                    checked += 1
                    mapped += bool(args)
    assert mapped > 0 and checked > mapped, (checked, mapped)


def test_layout_refusals_name_the_numbers():
    with pytest.raises(ValueError, match=r"num_q_heads=2 < ulysses_degree=4 .*ulysses_degree in \[2\]"):
        ulysses_head_layout(2, 1, 4, cp_size=8)
    with pytest.raises(ValueError, match=r"num_q_heads=3 < ulysses_degree=4 .*colossal"):
        ulysses_head_layout(3, 3, 4, cp_size=4)
    with pytest.raises(ValueError, match="num_q_heads=6 must be a positive multiple of num_kv_heads=4"):
        ulysses_head_layout(6, 4, 2)


def test_head_exchange_checks_heads_before_any_collective():
    """``heads=`` must give every rank of the group a non-empty set of valid heads; the output
    split must be disjoint and cover every head (checked locally, before any collective)."""
    from hyper_parallel.distributed.context_parallel.collectives import (CPCollectiveError, ulysses_head_to_seq,
                                                                        ulysses_seq_to_head)

    x = torch.zeros(1, 2, 4, 3)
    with pytest.raises(CPCollectiveError, match=r"heads=\[\(0,\), \(1,\)\] must give each of the 1 ranks"):
        ulysses_seq_to_head(x, None, heads=[(0,), (1,)])
    with pytest.raises(CPCollectiveError, match=r"in \[0, 2\)"):
        ulysses_seq_to_head(x, None, heads=[(0, 2)])
    with pytest.raises(CPCollectiveError, match="disjoint and covering every head"):
        ulysses_head_to_seq(x, None, heads=[(0, 0)])
    assert ulysses_seq_to_head(x, None, heads=[(0, 1)]) is x        # size-1 group: identity


# ---------------------------------------------------------------------------- model parity (ranks)
WRAPPERS = {"ulysses": "sdpa_hf_ulysses", "flex": "flex_hf_ulysses",
            "hybrid": {"_target_": "hyper_parallel.distributed.context_parallel.wrappers.sdpa_hf_hybrid_cp_wrapper",
                       "ulysses_degree": 2}}


def _build(arch: str, hq: int, hk: int, impl: str):
    import transformers as T

    c = dict(W._COMMON, num_attention_heads=hq, num_key_value_heads=hk, head_dim=16 if arch == "gpt_oss" else 8)
    if arch == "gpt_oss":          # sinks (+ window on one layer type), eager through the attention interface
        cfg = T.GptOssConfig(sliding_window=W.WINDOW, num_local_experts=4, num_experts_per_tok=2,
                             layer_types=["sliding_attention", "full_attention"], **c)
    else:
        cfg = T.Qwen3Config(**c)   # head_dim explicit: any head count (Llama needs hidden % heads == 0)
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg).float().train()
    if arch == "gpt_oss":          # default init leaves the sinks at 0: make them matter per head
        for m in model.modules():
            if hasattr(m, "sinks"):
                m.sinks.data.copy_(torch.linspace(-1.0, 1.5, m.sinks.numel()))
    cfg_ref = type(cfg).from_dict(cfg.to_dict())
    cfg_ref._attn_implementation = "eager" if arch == "gpt_oss" else "sdpa"
    ref = T.AutoModelForCausalLM.from_config(cfg_ref).float().train()
    ref.load_state_dict(model.state_dict())
    return model, ref


def _batch(kind: str, S: int, vocab: int):
    """(CP batch, CP=1 reference inputs, valid): ``padding`` (right padding, attention_mask) or
    ``packed`` (the batch contract's seq_lens; the reference gets the same documents as
    restarting position_ids, which transformers separates without a KV cache)."""
    if kind == "padding":
        return W.attention_batch("padding", S, vocab)
    ids = torch.randint(3, vocab, (2, S), generator=torch.Generator().manual_seed(S))
    lens = [[S // 3, S // 4, S - S // 3 - S // 4], [7, S - 13, 6]]
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lens])
    return ({"input_ids": ids, "seq_lens": torch.tensor(lens)},
            {"input_ids": ids, "position_ids": pos, "use_cache": False}, torch.ones(2, S, dtype=torch.bool))


def heads_parity(cp: int, cases) -> list:
    """cases: [(method, arch, Hq, Hk, kinds, S)] -> one dict per (case, kind) on this rank."""
    from hyper_parallel.distributed.plan.applier import apply_sharding_plan
    from hyper_parallel.distributed.plan.planner import ShardingPlanner

    out = []
    for i, (method, arch, hq, hk, kinds, S) in enumerate(cases):
        mesh = W.mesh_ctx(cp, hybrid=(2,) if method == "hybrid" else ())
        impl = "flex_attention" if method == "flex" else ("eager" if arch == "gpt_oss" else "sdpa")
        model, ref = _build(arch, hq, hk, impl)
        entry = [{"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self",
                  "inner_wrapper": WRAPPERS[method]}]
        plan = ShardingPlanner(plan_overrides=entry).plan(model, mesh, cp_size=cp)
        # flex: the proof's reference is HF's flex path, compiled per shape on CPU (slow); parity below
        model, _ = apply_sharding_plan(model, plan, mesh, fsdp=False, preflight_proof=method != "flex")
        for kind in kinds:
            batch, ref_inputs, valid = _batch(kind, S, model.config.vocab_size)
            res = W.parity_errors(model, ref, mesh, plan, batch, ref_inputs, valid, seed=10 * i + len(out),
                                  use_cache=False)
            out.append({"case": f"{method}/{arch} cp{cp} Hq={hq} Hk={hk} {kind} S={S}", **res,
                        "summary": plan.summary()})
    return out


def replica_grads() -> dict:
    """The KV exchange on 2 ranks with one KV head sent to both (MQA): forward copies, backward sums.

    x [1, 1, L, 2] (this rank's chunk of the one head, heads=[(0,), (0,)]); each rank receives the
    whole sequence; rank j backpropagates dout_j = (j + 1) * ones. The owner's gradient must be
    the sum over receivers (1 + 2 = 3), not their mean (1.5) nor one copy."""
    from hyper_parallel.distributed.context_parallel.collectives import ulysses_head_to_seq, ulysses_seq_to_head

    ctx = W.mesh_ctx(2)
    r = ctx.cp_rank
    x = torch.arange(8, dtype=torch.float32).reshape(1, 1, 4, 2).add(100 * r).requires_grad_(True)
    y = ulysses_seq_to_head(x, ctx.cp_mesh, heads=[(0,), (0,)])
    y.backward(torch.full_like(y, float(r + 1)))
    full = torch.cat([torch.arange(8, dtype=torch.float32).reshape(1, 1, 4, 2).add(100 * s) for s in range(2)], 2)
    # the explicit adjoint (what a hand-written backward calls): each rank's chunk back from both copies, summed
    back = ulysses_head_to_seq(y.detach(), ctx.cp_mesh, heads=[(0,), (0,)], num_heads=1)
    return {"fwd": torch.equal(y.detach(), full), "grad": x.grad.unique().tolist(),
            "adjoint": torch.equal(back, 2 * x.detach())}


def test_replicated_kv_gradients_are_summed(ranks):
    for r, res in enumerate(ranks(2).run(replica_grads)):
        assert res == {"fwd": True, "grad": [3.0], "adjoint": True}, (r, res)


def saved_full_sequence_heads(cp: int, method: str, hq: int, hk: int) -> dict:
    """The strategy's attention on random local q/k/v ([1, H, S/C, 8], S = 32). Pure Ulysses: every
    tensor autograd saves that spans the whole sequence, by ``"{heads}x{rows}"``. Hybrid: no hook of
    ours (the regather acts only where no other saved-tensor hooks are in force); the regather
    exchanges of the backward. -> {"saved",
    "regathers", "nq", "nk", "mapped": whether this rank runs the engine with a head map, ...}."""
    from hyper_parallel import platform as P
    from hyper_parallel.distributed.context_parallel.meta import CPBatchMeta
    from hyper_parallel.distributed.context_parallel.strategies import build_strategy

    u = 2 if method == "hybrid" else cp
    ctx = W.mesh_ctx(cp, hybrid=(u,) if method == "hybrid" else ())
    strategy = build_strategy(method, ctx, ulysses_degree=u if method == "hybrid" else None)
    S, D = 32, 8
    L = S // cp
    meta = CPBatchMeta(cp_rank=ctx.cp_rank, cp_size=cp, global_seq_len=S, local_seq_len=L, key_doc=None,
                       policy=strategy.name)
    g = torch.Generator().manual_seed(ctx.cp_rank)
    q, k, v = (torch.randn(1, h, L, D, generator=g).requires_grad_(True) for h in (hq, hk, hk))
    span = S if method == "ulysses" else S * u // cp      # the query rows of this rank's group chunk
    saved: dict = {}

    def pack(t):
        if t.dim() == 4 and t.shape[2] in (S, span) and t.shape[3] == D:
            key = f"{t.shape[1]}x{t.shape[2]}"
            saved[key] = saved.get(key, 0) + 1
        return t

    hooks = (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if method == "ulysses"
             else contextlib.nullcontext())
    with hooks:
        out = strategy.attention(q, k, v, meta=meta)
    with P.comm_counter() as bwd:
        out.sum().backward()
    lay = ulysses_head_layout(hq, hk, u)
    i = ctx.cp_rank % u
    return {"saved": saved, "nq": lay.q_counts[i], "nk": lay.kv_counts[i], "S": S, "span": span,
            "mapped": bool(lay.kv_map_args(i)), "grads": all(t.grad is not None for t in (q, k, v)),
            "regathers": sorted(c.tag for c in bwd if "regather" in c.tag)}


@pytest.mark.parametrize("cp,method,hq,hk", [(2, "ulysses", 6, 3), (4, "hybrid", 6, 3)])
def test_uneven_split_saves_the_received_kv_not_a_copy_per_query_head(ranks, cp, method, hq, hk):
    """6 query / 3 KV heads over a Ulysses degree of 2: each rank has 3 query heads over 2 KV heads
    (its range starts or ends inside a KV group). The engine runs with its head map
    (``kv_map_args``) and reads the received K/V in place. Pure Ulysses: the tensors saved for
    backward are q and out with 3 heads and K, V with their 2 (an ``index_select`` copy per query
    head would be two more 3-head tensors and no 2-head one). Hybrid: what the engine saves is the
    gathered K/V itself, so the regather recognises it and gathers K and V again in backward (a copy
    would be kept, with no regather)."""
    for r, res in enumerate(ranks(cp).run(saved_full_sequence_heads, cp, method, hq, hk)):
        print(f"{method} cp {cp} rank {r}: saved tensors by heads x rows {res['saved']}, regathers "
              f"{res['regathers']} (nq {res['nq']}, nk {res['nk']}, head map {res['mapped']})")
        assert res["mapped"] and res["nq"] == 3 and res["nk"] == 2 and res["grads"], res
        if method == "ulysses":
            assert res["saved"] == {"2x32": 2, "3x32": 2}, res     # K, V in place; q, out
            assert not res["regathers"], res
        else:
            assert res["regathers"] == ["cp.allgather.regather_k", "cp.allgather.regather_v"], res


def check(results) -> None:
    rows = [r for per_rank in results for r in per_rank]
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == case]
        print(f"{case}: logits max abs {max(r['logits'] for r in mine):.2e} (tol {LOGIT_TOL:g}); grads max abs "
              f"{max(r['grads_abs'] for r in mine):.2e} rel {max(r['grads'] for r in mine):.2e} "
              f"(tol {GRAD_TOL:g} x largest |grad|)")
    bad = [r for r in rows if r["logits"] > LOGIT_TOL or r["grads"] > GRAD_TOL]
    assert not bad, bad


BOTH = ("padding", "packed")
CP2 = [  # degree 2
    ("ulysses", "qwen3", 4, 1, BOTH, 27),      # MQA
    ("ulysses", "qwen3", 9, 3, BOTH, 27),      # Hq, Hk not divisible by 2: 5/4 query heads, a KV group split
    ("flex", "qwen3", 3, 1, BOTH, 32),         # flex Ulysses wrapper: MQA and uneven (2/1)
    ("ulysses", "gpt_oss", 3, 1, ("padding",), 27),   # sinks follow their (uneven) query heads
]
CP4 = [  # degree 4 (pure Ulysses) and Hybrid u=2 at cp 4
    ("ulysses", "qwen3", 4, 1, BOTH, 30),      # MQA (Hk = u/4)
    ("ulysses", "qwen3", 8, 2, BOTH, 30),      # GQA Hk = u/2
    ("ulysses", "qwen3", 6, 2, BOTH, 30),      # Hq = 6 not divisible by 4: 2/1/2/1, KV replicated
    ("ulysses", "qwen3", 10, 5, ("packed",), 32),   # 3/3/2/2 over 5 KV heads: local GQA map is uneven
    ("hybrid", "qwen3", 4, 1, BOTH, 30),       # Hybrid's Ulysses sub-group: MQA
    ("hybrid", "qwen3", 3, 3, BOTH, 30),       # Hybrid u=2 with 3 heads: 2/1
]


def test_ulysses_heads_parity_cp2(ranks):
    check(ranks(2).run(heads_parity, 2, CP2, timeout=600))


def test_ulysses_heads_parity_cp4(ranks):
    res = ranks(4).run(heads_parity, 4, CP4, timeout=600)
    check(res)
    summary = {r["case"]: r["summary"] for r in res[0]}
    assert ("ulysses ulysses heads (Hq=6, Hk=2, degree=4, KV replicated): q per rank [2, 1, 2, 1], kv per rank "
            "[1, 1, 1, 1]") in summary["ulysses/qwen3 cp4 Hq=6 Hk=2 padding S=30"]
    assert "hybrid ulysses heads (Hq=3, Hk=3, degree=2, uneven): q per rank [2, 1]" in \
        summary["hybrid/qwen3 cp4 Hq=3 Hk=3 padding S=30"]


def test_ulysses_mqa_per_tp_rank(ranks):
    """TP 2 leaves 2 query / 1 KV head per rank (Llama 4/2): Ulysses cp 2 replicates the KV head."""
    res = ranks(4).run(W.cp_parity, "examples/cp/colossal.yaml", ("accelerator.tp_size=2",),
                       plan_overrides=[{"match": "*.self_attn", "when": "cp", "region_dispatch": False,
                                        "inner_target": "self", "inner_wrapper": "sdpa_hf_ulysses"}],
                       grads=True, padding=True, timeout=600)
    print(f"tp2 x ulysses cp2 (2/1 heads per TP rank): logits max abs {max(r['logits'] for r in res):.2e}, "
          f"grads rel {max(r['grads'] for r in res):.2e}")
    for r in res:
        assert r["logits"] <= LOGIT_TOL and r["grads"] <= GRAD_TOL, r


def test_qkv_core_wrappers_replicate_kv(ranks):
    """The core-module styles at cp 4 on the tiny Llama (4 q / 2 kv heads, KV replicated to 2 ranks
    each): flex_qkv_ulysses, and sdpa_qkv_ulysses on a core that receives HF's repeat_kv copies
    (un-repeated to the 2 distinct KV heads before the exchange)."""
    for wrapper, kind in (("flex_qkv_ulysses", "flex_qkv"), ("sdpa_qkv_ulysses", "qkv_repeat")):
        res = ranks(4).run(W.cp_parity, "examples/cp/colossal.yaml", ("accelerator.cp_size=4",), model_kind=kind,
                           plan_overrides=[{"match": "*.self_attn", "when": "cp", "region_dispatch": False,
                                            "inner_target": "core_attention", "inner_wrapper": wrapper}],
                           grads=True, padding=True, timeout=600)
        print(f"{wrapper} ({kind}) cp4 Hq=4 Hk=2: logits max abs {max(r['logits'] for r in res):.2e}, "
              f"grads rel {max(r['grads'] for r in res):.2e}")
        for r in res:
            assert r["logits"] <= LOGIT_TOL and r["grads"] <= GRAD_TOL, (wrapper, r)
        assert "kv per rank [1, 1, 1, 1] [0; 0; 1; 1]" in res[0]["summary"], res[0]["summary"]
