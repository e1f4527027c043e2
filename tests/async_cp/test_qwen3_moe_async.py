"""Async Qwen3-MoE CP wrappers: real overlap order of the three design Targets, refusal of another model,
and the design YAMLs (plus one example per adapter) through planner + FSDP2 vs CP=1."""
import pytest
import torch

QWEN3_MOE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_experts=4, num_experts_per_tok=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                 tie_word_embeddings=False)

MODULE = "hyper_parallel.models.qwen3_moe.adapter.distributed.context_parallel_async"
# fp32 vs CP=1. rel = max abs error / max |reference| (per parameter for gradients).
# Measured (random-weighted objective): design YAML logits 2.4e-7 abs, grads 5.5e-7 rel
# (adapter examples up to 7.9e-7 rel). Tolerances are ~10x those.
YAML_TOL = 2e-6        # logits max abs (design YAML through planner + FSDP2)
YAML_GRAD_RTOL = 5e-6  # gradients max rel (design YAML through planner + FSDP2)

def _report(what: str, max_abs: float, rel: float, tol: float, kind: str) -> None:
    print(f"{what}: max abs {max_abs:.2e} rel {rel:.2e} (tol {kind} {tol:g})")


def _model():
    import transformers

    cfg = transformers.AutoConfig.for_model("qwen3_moe", **QWEN3_MOE)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def _install(model, mesh, wrapper_name, **params):
    from hyper_parallel.distributed.context_parallel.registry import import_target

    fn = import_target(f"{MODULE}.{wrapper_name}")
    for layer in model.model.layers:
        attn = layer.self_attn
        fn.__hp_inner_wrapper__.validate(attn, cp_size=mesh.cp_size, **params)
        attn.forward = fn(attn, mesh, None, mesh.cp_mesh, None, **params)


def run_async_parity(wrapper_name, cp, params, seq_len, pad_tail):
    from hyper_parallel.distributed.context_parallel.async_collectives import async_trace
    from hyper_parallel.distributed.context_parallel.meta import CPBatchMeta, cp_batch_context
    from hyper_parallel.distributed.mesh import MeshContext, MeshSizes
    from hyper_parallel.platform import all_gather, pending_handles

    mesh = MeshContext(MeshSizes(cp=cp), hybrid_degrees=[params["ulysses_degree"]] if params else [])
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, 256, (2, seq_len), generator=gen)
    key_doc = None
    valid = torch.ones(2, seq_len, dtype=torch.bool)
    if pad_tail:
        valid[1, seq_len - pad_tail:] = False
        key_doc = torch.where(valid, 0, -1).long()

    # objective: a fixed random-weighted sum of the valid logits (a plain sum() is blind to errors
    # that cancel along the vocab / sequence axes); the CP rank uses its slice of the same weights
    w = torch.randn(2, seq_len, QWEN3_MOE["vocab_size"], generator=torch.Generator().manual_seed(99))
    w = w * valid[..., None]

    ref = _model()
    ref_logits = ref(input_ids=ids, attention_mask=valid.long(), use_cache=False).logits
    (ref_logits * w).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}

    model = _model()
    _install(model, mesh, wrapper_name, **params)
    r, L = mesh.cp_rank, seq_len // cp
    sl = slice(r * L, (r + 1) * L)
    meta = CPBatchMeta(cp_rank=r, cp_size=cp, global_seq_len=seq_len, local_seq_len=L, key_doc=key_doc)
    with async_trace() as trace, cp_batch_context(meta):
        logits = model(input_ids=ids[:, sl], position_ids=torch.arange(seq_len)[sl].expand(2, -1), use_cache=False).logits
        loss = (logits * w[:, sl]).sum()
        loss.backward()
    pending = pending_handles()
    full = all_gather(logits.detach(), mesh.cp_group, dim=1)
    ref_valid = ref_logits.detach().masked_fill(~valid[..., None], 0)
    err_logits = (full - ref_logits.detach()).masked_fill(~valid[..., None], 0).abs().max().item()
    # parameters are replicated over CP: the CP=1 gradient is the sum over CP ranks. A parameter
    # (e.g. an expert no local token is routed to) may have no gradient on some CP ranks: it counts
    # as zero there, and "has a gradient" means on at least one CP rank.
    from hyper_parallel.platform import all_reduce
    err_grad_abs = err_grad = 0.0
    with_grad = set()
    for n, p in model.named_parameters():  # same order on every rank: the all_reduces line up
        local = p.grad if p.grad is not None else torch.zeros_like(p)
        flag = all_reduce(torch.tensor([float(p.grad is not None)]), mesh.cp_group)
        g = all_reduce(local, mesh.cp_group)
        if flag.item() == 0:
            continue
        with_grad.add(n)
        if n not in ref_grads:
            continue  # reported by the set comparison in the test
        a = (g - ref_grads[n]).abs().max().item()
        err_grad_abs = max(err_grad_abs, a)
        err_grad = max(err_grad, a / (ref_grads[n].abs().max().item() + 1e-6))
    return {"err_logits": err_logits, "err_logits_rel": err_logits / ref_valid.abs().max().item(),
            "err_grad_abs": err_grad_abs, "err_grad_rel": err_grad,
            "grad_names": with_grad, "ref_grad_names": set(ref_grads), "pending": pending,
            "trace": [(e, n) for e, n, _ in trace]}


CASES = [
    ("qwen3_moe_async_colossal_cp_wrapper", 2, {}),
    ("qwen3_moe_async_ulysses_cp_wrapper", 2, {}),
    ("qwen3_moe_async_hybrid_cp_wrapper", 4, {"ulysses_degree": 2}),
]


# Parity of the three wrappers (and Head-Tail) with CP=1 and with the sync wrappers, padded and
# packed rows: tests/async_cp/test_async_adapters.py (qwen3_moe is one of its adapters).


def _first(trace, event, name, start=0):
    for i in range(start, len(trace)):
        if trace[i] == (event, name):
            return i
    raise AssertionError(f"{(event, name)} not in trace {trace}")


@pytest.mark.parametrize("name,cp,params", CASES)
def test_async_overlap_order(ranks, name, cp, params):
    """Forward: K/V launched before the Q projection runs and waited after it. Backward: the
    inverse K/V collectives are launched before the Q projection's backward and waited after."""
    [res, *_] = ranks(cp).run(run_async_parity, name, cp, params, 32, 0)
    t = res["trace"]
    launch_k = _first(t, "launch", "k")
    launch_v = _first(t, "launch", "v")
    q_fwd = _first(t, "compute", "q_proj")
    wait_k = _first(t, "wait", "k")
    assert launch_k < launch_v < q_fwd < wait_k, t
    bwd_launch_k = _first(t, "bwd_launch", "k")
    q_bwd = _first(t, "bwd_compute", "q_proj", bwd_launch_k)
    bwd_wait_k = _first(t, "bwd_wait", "k", bwd_launch_k)
    assert bwd_launch_k < q_bwd < bwd_wait_k, t


def run_reject_llama():
    import transformers

    from hyper_parallel.distributed.context_parallel.registry import import_target

    cfg = transformers.AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    fn = import_target(f"{MODULE}.qwen3_moe_async_colossal_cp_wrapper")
    fn.__hp_inner_wrapper__.validate(model.model.layers[0].self_attn, cp_size=2)


def test_async_wrapper_rejects_non_adapter_model():
    with pytest.raises(ValueError, match="Qwen3-MoE model adapter but the target is LlamaAttention"):
        run_reject_llama()


def yaml_parity(path, padding):
    from tests.wrappers._workers import cp_parity

    return cp_parity(path, grads=True, padding=padding)


@pytest.mark.parametrize("path,cp", [("examples/cp/async_colossal.yaml", 2), ("examples/cp/async_ulysses.yaml", 2),
                                     ("examples/cp/async_hybrid.yaml", 4),
                                     ("examples/cp/async_llama_colossal.yaml", 2),
                                     ("examples/cp/async_qwen2_ulysses.yaml", 2),
                                     ("examples/cp/async_qwen3_hybrid.yaml", 4),
                                     ("examples/cp/async_mistral_colossal.yaml", 2),
                                     ("examples/cp/async_qwen3_moe_load_balance.yaml", 2)])
def test_design_async_yaml_through_planner_and_fsdp(ranks, path, cp):
    """The design's async snippets, unchanged, and one example per adapter, through ShardingPlanner +
    apply_sharding_plan (FSDP2 on), padded rows, logits and every gradient vs CP=1."""
    for rank, r in enumerate(ranks(cp).run(yaml_parity, path, True)):
        _report(f"{path} rank {rank} logits", r["logits"], r["logits_rel"], YAML_TOL, "abs")
        _report(f"{path} rank {rank} grads", r["grads_abs"], r["grads"], YAML_GRAD_RTOL, "rel")
        assert r["logits"] < YAML_TOL, f"{path}: logits max abs err {r['logits']:.3e} (tol {YAML_TOL})"
        assert r["grads"] < YAML_GRAD_RTOL, f"{path}: grad max rel err {r['grads']:.3e} (tol {YAML_GRAD_RTOL})"
        assert "async" in r["summary"]
