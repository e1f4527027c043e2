"""The balanced split (``sdpa_hf_balanced``, batch policy ``balanced``) under CP through
``ShardingPlanner.plan`` + ``apply_sharding_plan`` (the preflight proof on): logits and every
gradient equal CP=1 (fp32) on packed rows with padding inside document slots and at the row end,
for Llama (causal) and Gemma 3 (sliding-window and global layers alternating), at cp 2 and 4.

The block is 4 tokens here (the default 64 would leave one block per rank on these short rows), so
the permutation really scatters documents over the ranks; the test asserts that it is not the
contiguous split. The reference is CP=1 through transformers with every document its own
right-padded row."""
from __future__ import annotations

import dataclasses

import pytest
import torch

ATTN = {"when": "cp", "region_dispatch": False, "inner_target": "self", "inner_wrapper": "sdpa_hf_balanced"}
TOL = 1e-5          # fp32: max |cp - ref| relative to max |ref| (logits) / to the largest gradient
S = 40


def packed_padded_batch(vocab: int, seed: int):
    """Two rows of packed documents (``seq_lens`` + ``seq_lens_padded``: padding inside slots) with a
    padded row tail; -> (batch, documents [(row, start, length)])."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([[9, 14, 12], [20, 5, 0]])
    slots = torch.tensor([[11, 16, 12], [22, 6, 0]])
    batch = {"input_ids": torch.randint(1, vocab, (2, S), generator=g), "seq_lens": lens, "seq_lens_padded": slots}
    docs = []
    for b in range(2):
        start = 0
        for n, m in zip(lens[b].tolist(), slots[b].tolist()):
            if n:
                docs.append((b, start, n))
            start += m
    return batch, docs


def parity(model, ref, mesh, plan, seed: int) -> dict:
    from tests.wrappers._workers import document_parity

    batch, docs = packed_padded_batch(model.config.vocab_size, seed)
    r = document_parity(model, ref, mesh, plan, batch, docs, seed + 1)
    meta = r.pop("meta")
    perm = meta.perm
    return {**r, "permuted": bool(perm is not None and not torch.equal(perm, torch.arange(perm.numel()))),
            "global_len": meta.global_seq_len}


def case(arch: str, cp: int) -> dict:
    from hyper_parallel.distributed.plan.applier import apply_sharding_plan
    from hyper_parallel.distributed.plan.planner import ShardingPlanner
    from tests.cp.common import mesh_ctx
    from tests.wrappers import _workers as W

    model, ref = W.build_arch(arch)
    mesh = mesh_ctx(cp)
    entry = [{**ATTN, "match": W.ATTN_MATCH.get(arch, "*.self_attn")}]
    plan = ShardingPlanner(plan_overrides=entry).plan(model, mesh, cp_size=cp)
    plan.batch_policy = dataclasses.replace(plan.batch_policy, block=4)
    policy = str(plan.batch_policy)
    model, _ = apply_sharding_plan(model, plan, mesh, fsdp=False)
    return {"case": f"{arch} cp{cp}", "policy": policy, **parity(model, ref, mesh, plan, 11)}


def cases(items: list) -> list:
    return [case(*c) for c in items]


def _check(out):
    for per_rank in zip(*out):
        r0 = per_rank[0]
        rel_l, rel_g = max(r["logits_rel"] for r in per_rank), max(r["grads"] for r in per_rank)
        print(f"{r0['case']} ({r0['policy']}, S padded {r0['global_len']}): logits max abs "
              f"{max(r['logits_abs'] for r in per_rank):.2e} rel {rel_l:.2e}; grads max abs "
              f"{max(r['grads_abs'] for r in per_rank):.2e} rel(largest grad) {rel_g:.2e}; tolerance {TOL:g}")
        assert r0["permuted"], r0
        assert rel_l <= TOL and rel_g <= TOL, r0


def test_balanced_split_cp2_matches_cp1(ranks):
    """Llama (causal) and Gemma 3 (window 5 / global layers) at cp 2."""
    _check(ranks(2).run(cases, [("llama", 2), ("gemma3", 2)], timeout=300.0))


def test_balanced_split_cp4_matches_cp1(ranks):
    """The same at cp 4 (Gemma 3: the mixed-layer profile)."""
    _check(ranks(4).run(cases, [("gemma3", 4)], timeout=300.0))


# ---------------------------------------------------------------- batch contract and refusals (local, no ranks)
def test_balanced_batch_permutes_every_field_after_the_global_shift():
    """Labels are shifted on the global row before the permutation; positions, ids and labels travel
    with their tokens; the ranks' tokens partition the padded row; valid-token counts add up."""
    from hyper_parallel.distributed.context_parallel.balance.split import BalancedSplit
    from hyper_parallel.distributed.context_parallel.batch import shard_batch_for_cp

    batch, _docs = packed_padded_batch(50, 3)
    cp, pol = 4, BalancedSplit(block=2)
    glob = shard_batch_for_cp(batch, (0, 1), "all_gather")             # CP=1: the global fields
    seen, valid = [], 0
    for r in range(cp):
        loc = shard_batch_for_cp(batch, (r, cp), pol)
        idx = loc.meta.q_index
        n = glob["input_ids"].shape[1]
        keep = idx < n
        for key in ("input_ids", "shift_labels", "position_ids"):
            assert torch.equal(loc[key][:, keep], glob[key][:, idx[keep]]), key
        assert bool((loc["shift_labels"][:, ~keep] == -100).all())
        assert int(loc["seq_lens"].sum()) == int((loc.meta.doc_slice(idx) >= 0).sum())
        seen.append(idx)
        valid += loc.num_valid_tokens_local
    perm = torch.cat(seen)
    assert sorted(perm.tolist()) == list(range(perm.numel())) and not torch.equal(perm, torch.arange(perm.numel()))
    assert valid == glob.num_valid_tokens_local


def test_other_strategies_refuse_a_permuted_batch_and_balanced_needs_one():
    from hyper_parallel.distributed.context_parallel.batch import shard_batch_for_cp
    from hyper_parallel.distributed.context_parallel.strategies import AllGatherStrategy
    from hyper_parallel.distributed.context_parallel.strategies import BalancedStrategy

    batch, _ = packed_padded_batch(50, 3)
    meta = shard_batch_for_cp(batch, (0, 1), "balanced").meta
    meta.perm = torch.arange(meta.global_seq_len)
    q = torch.zeros(2, 2, meta.local_seq_len, 4)
    with pytest.raises(ValueError, match="only the 'balanced' CP method computes"):
        AllGatherStrategy(None).check_inputs(q, q, q, meta, cp_size=1, cp_rank=0)
    BalancedStrategy(None).check_inputs(q, q, q, meta, cp_size=1, cp_rank=0)


def test_balanced_with_a_token_mixer_is_planned_and_with_another_method_refused():
    """A token mixer (GDN state passing) next to the balanced split is planned (its tokens move to the
    contiguous layout and back; parity in tests/cp/test_mixers_balanced.py); mixing the balanced split
    with another attention method is refused."""
    from hyper_parallel.distributed.errors import CPConfigError
    from tests.cp.test_mixer_cp import MIXER, MIXER_FQN, _plan

    base = {"when": "cp", "region_dispatch": False, "inner_target": "self"}
    plan = _plan("qwen3_next", [{**base, "match": "*.self_attn", "inner_wrapper": "sdpa_hf_balanced"},
                                {**base, "match": MIXER_FQN["qwen3_next"], "inner_wrapper": MIXER["gdn_sp"]}])
    assert plan.batch_policy.name == "balanced"
    from hyper_parallel.distributed.plan.planner import ShardingPlanner
    from tests.wrappers._workers import build_arch

    mixed = [{**base, "match": "*.0.self_attn", "inner_wrapper": "sdpa_hf_balanced"},
             {**base, "match": "*.1.self_attn", "inner_wrapper": "sdpa_hf"}]
    with pytest.raises(CPConfigError, match="reorders the whole sequence"):
        ShardingPlanner(plan_overrides=mixed).plan(build_arch("llama")[0], None, cp_size=2)


def test_example_yaml_plans_the_balanced_split_on_the_main_job_data(tmp_path):
    """examples/train_long_cp4_balanced.yaml parses and plans at cp 4 (no 4-rank 32k training here):
    the plan's batch policy is the balanced split with the model's profile, and the first batch of
    the main job's data is split into 4 x 8192 tokens with slowest/mean work <= 1.01."""
    import os

    from hyper_parallel.distributed.context_parallel.balance.split import BalancedSplit, split_report
    from hyper_parallel.distributed.context_parallel.batch import shard_batch_for_cp
    from hyper_parallel.distributed.plan.planner import ShardingPlanner
    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.data import build_data_stream
    from hyper_parallel.trainer.model import HyperAutoModel

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    slice_ = os.path.join(root, "examples", "data", "stdlib_small.jsonl")   # the shipped slice of the main job's data
    cfg = TrainerConfig.from_yaml(os.path.join(root, "examples", "train_long_cp4_balanced.yaml"),
                                  [f"data.files=[{slice_}]", f"data.cache_dir={tmp_path}"])
    assert cfg.accelerator.cp_size == 4 and cfg.data.seq_len == 32768
    model = HyperAutoModel.from_config(cfg.model)
    plan = ShardingPlanner(plan_overrides=cfg.plan_overrides).plan(model, None, cp_size=4)
    assert isinstance(plan.batch_policy, BalancedSplit), plan.batch_policy
    assert plan.batch_policy.profile.kinds[0].layers == model.config.num_hidden_layers
    stream, _ = build_data_stream(cfg.data, dp_rank=0, dp_size=1, vocab_size=model.config.vocab_size)
    batch = stream.next_micro_batches(1)[0]
    assert batch["seq_lens"].shape[1] > 1, "the row packs several documents"
    loc = shard_batch_for_cp(batch, (1, 4), plan.batch_policy)
    assert loc["input_ids"].shape[1] == 8192
    rep = split_report(loc.meta.key_doc, batch["input_ids"].shape[0], loc.meta.global_seq_len, 4,
                       plan.batch_policy, loc.meta.perm)
    ht = shard_batch_for_cp(batch, (1, 4), "load_balance").meta
    print(f"main job first batch, cp 4: balanced max/mean {rep['max_over_mean']:.4f}, contiguous "
          f"{rep['contiguous']:.3f}, split {rep['seconds'] * 1e3:.1f} ms")
    assert ht.global_seq_len == loc.meta.global_seq_len
    assert rep["max_over_mean"] <= 1.01


def test_router_loss_mask_follows_the_balanced_split():
    """MoE router statistics count this rank's real input tokens: under the balanced split those are
    the permuted slots (``meta.q_index``), not a contiguous slice."""
    from types import SimpleNamespace

    from hyper_parallel.distributed.context_parallel.balance.split import BalancedSplit
    from hyper_parallel.distributed.context_parallel.batch import shard_batch_for_cp
    from hyper_parallel.trainer.router_loss import valid_input_mask

    batch, _ = packed_padded_batch(50, 3)
    for r in range(4):
        loc = shard_batch_for_cp(batch, (r, 4), BalancedSplit(block=2))
        got = valid_input_mask(SimpleNamespace(local=loc), "cpu")
        want = (loc.meta.key_doc.index_select(1, loc.meta.q_index) >= 0).reshape(-1).float()
        assert torch.equal(got, want)
        assert int(got.sum()) == int(loc["seq_lens"].sum())
