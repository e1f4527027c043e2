"""sdpa_hf under torch.autocast: the wrapper applies autocast's SDPA cast (q/k/v may arrive mixed)."""
import torch

from tests.wrappers import _workers

TOL_BF16 = 5e-2  # bf16 logits, max abs vs the CP=1 model under the same autocast


def autocast_parity():
    from hyper_parallel.distributed.context_parallel.batch import gather_from_cp, shard_batch_for_cp
    from hyper_parallel.distributed.context_parallel.meta import cp_batch_context
    from hyper_parallel.distributed.plan.applier import apply_sharding_plan
    from hyper_parallel.distributed.plan.planner import ShardingPlanner

    from tests.wrappers import _models

    cfg = _models.load_cfg("examples/cp/colossal.yaml")
    model, ref = _workers.build_pair(cfg, "hf")
    mesh = _workers.mesh_ctx(2)
    plan = ShardingPlanner(cfg.plan_overrides).plan(model, mesh, cp_size=2)
    model, _ = apply_sharding_plan(model, plan, mesh, fsdp=False)
    batch = _workers.global_batch(2, 32, model.config.vocab_size)
    local = shard_batch_for_cp(batch, mesh.cp_mesh, plan.batch_policy)
    with torch.autocast("cpu", dtype=torch.bfloat16), cp_batch_context(local.meta):
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        logits.float().square().mean().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_logits = ref(**batch).logits
    full = gather_from_cp(logits.detach().float().contiguous(), mesh.cp_mesh, dim=1)
    grads_finite = all(torch.isfinite(p.grad).all().item() for p in model.parameters() if p.grad is not None)
    err = (full - ref_logits.float()).abs().max().item()
    return err, err / ref_logits.float().abs().max().item(), logits.dtype, grads_finite


def test_sdpa_hf_under_bf16_autocast(ranks):
    for rank, (err, rel, dtype, finite) in enumerate(ranks(2).run(autocast_parity)):
        print(f"bf16 autocast rank {rank} logits: max abs {err:.2e} rel {rel:.2e} (tol abs {TOL_BF16:g})")
        assert dtype == torch.bfloat16
        assert finite
        assert err < TOL_BF16, f"bf16 autocast logits max abs err {err:.3e} (tol {TOL_BF16})"
