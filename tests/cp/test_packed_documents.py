"""One declared meaning of packed rows, computed at every CP size (docs/wrappers.md, "Packed documents").

For each hybrid family (real transformers classes, tiny random configs, fp32, train(), dropout 0), a
row packing three documents, under each declared ``packed_documents``:

* ``independent``: logits and every gradient equal running each document alone (its own row) with
  plain transformers — at cp_size 1 (the declared methods run as a CP group of one) and at CP=2;
* ``as_transformers``: logits and every gradient equal plain transformers on the packed row
  (restarting ``position_ids``, no mask: its recurrent mixers run across the boundaries, its
  attention keeps the documents apart, Llama 4 tunes its NoPE layers' temperature on the row index,
  RecurrentGemma's RG-LRU restarts where ``position_ids`` is 0 but its conv does not) — at cp_size 1
  (plain transformers) and at CP=2.

So CP=2 equals CP=1 under either. Also: the two references differ on every family here (the
declaration matters), an undeclared packed row is refused naming the field, and the planner refuses
``packed_rows`` without a declaration for a model whose result depends on it.
"""
from __future__ import annotations

import pytest
import torch

from tests.cp.test_mixer_cp import build, entries, make_batch

TOL = 2e-5            # fp32, relative to the reference's largest |logit| / |grad| (rounding only)
S = 30
CASES = [("qwen3_next", "gdn_sp"), ("qwen3_next", "gdn_ulysses"), ("qwen3_5", "gdn_sp"), ("lfm2", "halo"),
         ("lfm2", "gather"), ("falcon_h1", "m2_sp"), ("nemotron_h", "m2_sp"), ("jamba", "m1_sp"),
         ("kimi_linear", "kda_sp"), ("minimax", "lightning_sp"), ("recurrent_gemma", "rglru_sp"),
         ("llama4", None)]    # Llama 4 text: chunked attention + temperature tuning on NoPE layers (no mixer)
ATTENTION_ONLY = [{"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self",
                   "inner_wrapper": "sdpa_hf"}]


def _build(arch: str):
    if arch == "llama4":
        from tests.cp.test_llama4_cp import build as build_llama4
        return build_llama4()
    return build(arch)
SEMANTICS = ("independent", "as_transformers")


def _references(ref, batch: dict, docs: list, position_ids, w):
    """(logits, grads) of plain transformers: each document alone, and the packed row as it is; both
    backpropagate ``sum(logits * w)`` over the documents' tokens."""
    out = {}
    for sem in SEMANTICS:
        for p in ref.parameters():
            p.grad = None
        if sem == "independent":
            logits = torch.zeros(*batch["input_ids"].shape, ref.config.vocab_size)
            for b, s, n in docs:
                one = ref(input_ids=batch["input_ids"][b:b + 1, s:s + n], use_cache=False).logits[0]
                logits[b, s:s + n] = one
                (one * w[b, s:s + n]).sum().backward()
        else:
            logits = ref(input_ids=batch["input_ids"], position_ids=position_ids, use_cache=False).logits
            (logits * w).sum().backward()
        out[sem] = (logits.detach(), {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                                      for n, p in ref.named_parameters()})
    return out


def semantics_case(arch: str, mixer: str, cp: int, semantics: str, seed: int = 5) -> dict:
    """The declared model at ``cp`` against both references (this rank's errors; cp 1 in-process)."""
    from hyper_parallel import platform as P
    from hyper_parallel.distributed.context_parallel.batch import gather_from_cp, shard_batch_for_cp
    from hyper_parallel.distributed.context_parallel.meta import cp_batch_context
    from hyper_parallel.distributed.plan.applier import apply_sharding_plan
    from hyper_parallel.distributed.plan.planner import ShardingPlanner

    from tests.wrappers._workers import mesh_ctx

    model, ref = _build(arch).float().train(), _build(arch).float().train()
    ref.load_state_dict(model.state_dict())
    mesh = mesh_ctx(cp) if cp > 1 else None
    overrides = ATTENTION_ONLY if mixer is None else entries(arch, "colossal", mixer)
    plan = ShardingPlanner(overrides, packed_documents=semantics).plan(
        model, mesh, cp_size=cp, packed_rows=True)
    model, _ = apply_sharding_plan(model, plan, mesh, fsdp=False, preflight_proof=cp > 1)
    batch, docs = make_batch("packed", S, model.config.vocab_size, seed)
    local = shard_batch_for_cp(batch, mesh.cp_mesh if cp > 1 else (0, 1), plan.batch_policy or "all_gather",
                               packed_documents=semantics)
    meta = local.meta
    w = torch.randn(2, meta.global_seq_len, model.config.vocab_size, generator=torch.Generator().manual_seed(seed))
    w[:, S:] = 0
    with cp_batch_context(meta):
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
        (logits * w.index_select(1, meta.q_index)).sum().backward()
    full = gather_from_cp(logits.detach().contiguous(), mesh.cp_mesh, dim=1) if cp > 1 else logits.detach()
    refs = _references(ref, batch, docs, meta.position_ids[:, :S], w[:, :S])
    out = {"case": f"{arch}/{mixer}/cp{cp}/{semantics}", "installed": len(plan.cp_targets)}
    for sem, (rl, rg) in refs.items():
        gerr = 0.0
        for n, p in model.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            if cp > 1:
                g = P.all_reduce(g.contiguous(), mesh.cp_mesh.get_group())
            gerr = max(gerr, (g - rg[n]).abs().max().item())
        gmax = max(g.abs().max().item() for g in rg.values())
        out[sem] = {"logits": (full[:, :S] - rl).abs().max().item() / rl.abs().max().item(), "grads": gerr / gmax}
    return out


def semantics_cases(cases: list) -> list:
    return [semantics_case(*c) for c in cases]


def _check(results: list) -> None:
    for r in results:
        own, other = r[r["case"].rsplit("/", 1)[1]], [v for k, v in r.items() if k in SEMANTICS and
                                                        k != r["case"].rsplit("/", 1)[1]][0]
        print(f"{r['case']}: declared reference logits {own['logits']:.2e} grads {own['grads']:.2e} (tol {TOL:g}); "
              f"the other reference logits {other['logits']:.2e}")
        assert own["logits"] <= TOL and own["grads"] <= TOL, r
        assert other["logits"] > 10 * TOL, f"{r['case']}: both references agree, the declaration is not tested"


def test_packed_documents_at_cp1_follow_the_declaration():
    _check(semantics_cases([(a, m, 1, sem) for a, m in CASES for sem in SEMANTICS]))


def test_packed_documents_at_cp2_follow_the_declaration(ranks):
    for res in ranks(2).run(semantics_cases, [(a, m, 2, sem) for a, m in CASES for sem in SEMANTICS],
                            timeout=900.0):
        _check(res)


def test_undeclared_packed_rows_are_refused_naming_the_field():
    from hyper_parallel.distributed.context_parallel.batch import shard_batch_for_cp
    from hyper_parallel.distributed.context_parallel.meta import cp_batch_context
    from hyper_parallel.distributed.errors import CPConfigError
    from hyper_parallel.distributed.plan.applier import apply_sharding_plan
    from hyper_parallel.distributed.plan.planner import ShardingPlanner

    model = build("qwen3_next").float().train()
    with pytest.raises(CPConfigError, match=r"data\.packed_documents.*model\.layers\.0\.linear_attn|"
                                            r"data\.packed_documents.*linear_attn"):
        ShardingPlanner(entries("qwen3_next", "colossal", "gdn_sp")).plan(model, None, cp_size=1, packed_rows=True)
    with pytest.raises(CPConfigError, match="packed_documents"):
        ShardingPlanner(entries("qwen3_next", "colossal", "gdn_sp"), packed_documents="alone")
    # rows without packing, or a model whose result does not depend on it, need no declaration
    ShardingPlanner(entries("qwen3_next", "colossal", "gdn_sp")).plan(model, None, cp_size=1)
    llama = build("llama").float().train()
    ShardingPlanner([{"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self",
                      "inner_wrapper": "sdpa_hf"}]).plan(llama, None, cp_size=1, packed_rows=True)
    # independent at cp 1 runs the declared methods as a CP group of one: an async wrapper is refused by name
    async_llama = [{"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self",
                    "inner_wrapper": {"_target_": "hyper_parallel.models.llama.adapter.distributed."
                                                  "context_parallel_async.llama_async_colossal_cp_wrapper"}}]
    with pytest.raises(CPConfigError, match=r"plan_overrides\[0\]\.inner_wrapper.*is async.*sync wrapper"):
        ShardingPlanner(async_llama, packed_documents="independent").plan(llama, None, cp_size=1, packed_rows=True)
    hybrid = [{**async_llama[0], "inner_wrapper": {"_target_": "hyper_parallel.distributed.context_parallel.wrappers."
                                                              "sdpa_hf_hybrid_cp_wrapper", "ulysses_degree": 2}}]
    with pytest.raises(CPConfigError, match=r"ulysses_degree < cp_size.*independent.*colossal or Ulysses"):
        ShardingPlanner(hybrid, packed_documents="independent").plan(llama, None, cp_size=1, packed_rows=True)
    local_fn = [{"match": "*.self_attn", "when": "cp", "region_dispatch": False,
                 "local_compute_fn": {"_target_": "examples.cp.local_compute_example.llama_colossal_local_compute"}}]
    with pytest.raises(CPConfigError, match=r"local_compute_fn.*not run there"):
        ShardingPlanner(local_fn, packed_documents="independent").plan(llama, None, cp_size=1, packed_rows=True)
    # the library API: a packed batch under an undeclared meta is refused by the mixer, naming the field
    plan = ShardingPlanner(entries("qwen3_next", "colossal", "gdn_sp"), packed_documents="independent").plan(
        model, None, cp_size=1, packed_rows=True)
    model, _ = apply_sharding_plan(model, plan, None, fsdp=False)
    batch, _docs = make_batch("packed", S, model.config.vocab_size, 1)
    local = shard_batch_for_cp(batch, (0, 1), "all_gather")
    with pytest.raises(Exception, match=r"data\.packed_documents: independent \| as_transformers"):
        with cp_batch_context(local.meta):
            model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False)


@pytest.mark.parametrize("wrapper", ["sdpa_hf", "sdpa_hf_ulysses", "sdpa_hf_balanced",
                                     {"_target_": "hyper_parallel.distributed.context_parallel.wrappers."
                                                  "sdpa_hf_load_balance_cp_wrapper"}])
def test_every_layout_runs_at_cp1_as_a_group_of_one(wrapper):
    """``independent`` at cp_size 1: a Llama with each attention method (its batch in the contiguous
    layout, the trainer's cp 1 policy) computes each packed document as if alone."""
    from hyper_parallel.distributed.context_parallel.batch import CONTIGUOUS_POLICY, shard_batch_for_cp
    from hyper_parallel.distributed.context_parallel.meta import cp_batch_context
    from hyper_parallel.distributed.plan.applier import apply_sharding_plan
    from hyper_parallel.distributed.plan.planner import ShardingPlanner

    model, ref = build("llama").float().train(), build("llama").float().train()
    ref.load_state_dict(model.state_dict())
    overrides = [{**ATTENTION_ONLY[0], "inner_wrapper": wrapper}]
    plan = ShardingPlanner(overrides, packed_documents="independent").plan(model, None, cp_size=1, packed_rows=True)
    model, _ = apply_sharding_plan(model, plan, None, fsdp=False)
    assert len(plan.cp_targets) == 2
    batch, docs = make_batch("packed", S + 1, model.config.vocab_size, 2)    # an odd row: no CP padding at cp 1
    local = shard_batch_for_cp(batch, (0, 1), CONTIGUOUS_POLICY, packed_documents="independent")
    with cp_batch_context(local.meta):
        got = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
    alone = torch.zeros_like(got)
    for b, s, n in docs:
        alone[b, s:s + n] = ref(input_ids=batch["input_ids"][b:b + 1, s:s + n], use_cache=False).logits[0]
    err = (got - alone).abs().max().item() / alone.abs().max().item()
    print(f"{wrapper}: cp 1 vs each document alone, logits max rel {err:.2e} (tol {TOL:g})")
    assert err <= TOL
