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
    from hyper_parallel import platform as P
    from tests.wrappers._workers import cp_forward_backward

    batch, docs = packed_padded_batch(model.config.vocab_size, seed)
    valid = torch.zeros(2, S, dtype=torch.bool)
    for b, s, n in docs:
        valid[b, s:s + n] = True
    full, w_valid, meta = cp_forward_backward(model, mesh, plan, batch, valid, seed + 1)
    for p in ref.parameters():
        p.grad = None
    n_max = max(n for _b, _s, n in docs)
    ids = torch.zeros(len(docs), n_max, dtype=torch.int64)
    mask = torch.zeros(len(docs), n_max, dtype=torch.int64)
    for r, (b, s, n) in enumerate(docs):
        ids[r, :n] = batch["input_ids"][b, s:s + n]
        mask[r, :n] = 1
    ref_logits = ref(input_ids=ids, attention_mask=mask).logits
    rows = torch.tensor([r for r, (_b, _s, n) in enumerate(docs) for _ in range(n)])
    cols = torch.tensor([j for _b, _s, n in docs for j in range(n)])
    gb = torch.tensor([b for b, _s, n in docs for _ in range(n)])
    gs = torch.tensor([s + j for _b, s, n in docs for j in range(n)])
    ref_tok = ref_logits[rows, cols]
    (ref_tok * w_valid[gb, gs]).sum().backward()
    diff = (full[gb, gs] - ref_tok.detach()).abs().max().item()
    gmax = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
    ref_params, gerr = dict(ref.named_parameters()), 0.0
    for n, p in model.named_parameters():
        g = P.all_reduce((p.grad if p.grad is not None else torch.zeros_like(p)).contiguous(),
                         mesh.cp_mesh.get_group())
        rg = ref_params[n].grad if ref_params[n].grad is not None else torch.zeros_like(p)
        gerr = max(gerr, (g - rg).abs().max().item())
    perm = meta.perm
    return {"logits_abs": diff, "logits_rel": diff / ref_tok.abs().max().item(), "grads_abs": gerr,
            "grads": gerr / gmax, "permuted": bool(perm is not None and not torch.equal(perm, torch.arange(perm.numel()))),
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
    policy = str(plan.batch_policy)
    plan.batch_policy = dataclasses.replace(plan.batch_policy, block=4)
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
