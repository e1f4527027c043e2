"""Async Qwen3-MoE adapter: TP-local head checks at preflight, local checks before any launch.

Single process: the planner runs no collective, and the runtime checks run before the first
launch (a ``None`` group is cp 1, so nothing is ever sent).
"""
import pytest
import torch

from tests.async_cp.test_qwen3_moe_async import MODULE, _model

ATTN_TP_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
                "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise"}


def _specs(wrapper, **params):
    return [{"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self",
             "inner_wrapper": {"_target_": f"{MODULE}.{wrapper}", **params}}]


@pytest.fixture
def qwen3_moe_tp_plan(monkeypatch):
    from hyper_parallel.distributed import tensor_parallel

    monkeypatch.setitem(tensor_parallel._TP_PLANS, "qwen3_moe", dict(ATTN_TP_PLAN))


@pytest.mark.parametrize("wrapper,cp,params", [
    ("qwen3_moe_async_ulysses_cp_wrapper", 4, {}),
    ("qwen3_moe_async_hybrid_cp_wrapper", 8, {"ulysses_degree": 4}),
])
def test_planner_rejects_tp_local_head_split(qwen3_moe_tp_plan, wrapper, cp, params):
    """heads 4/2 split over degree 4 globally, but per TP rank (tp 2) only 2/1 heads: fewer query
    heads than the degree (a rank would compute nothing), rejected at plan time. At degree 2 the
    TP-local 2/1 heads are accepted (even query split, the KV head replicated)."""
    from hyper_parallel.distributed.errors import CPConfigError
    from hyper_parallel.distributed.plan.planner import ShardingPlanner

    model = _model()
    ShardingPlanner(_specs(wrapper, **params)).plan(model, tp_size=1, cp_size=cp)   # fine without TP
    with pytest.raises(CPConfigError, match=r"num_q_heads=2 < .*=4 .*per TP rank, tp_size=2"):
        ShardingPlanner(_specs(wrapper, **params)).plan(model, tp_size=2, cp_size=cp)
    small = {"ulysses_degree": 2} if params else {}
    ShardingPlanner(_specs(wrapper, **small)).plan(model, tp_size=2, cp_size=cp // 2)   # 2/1 per TP rank, u=2


def test_planner_accepts_tp_local_colossal(qwen3_moe_tp_plan):
    from hyper_parallel.distributed.plan.planner import ShardingPlanner

    plan = ShardingPlanner(_specs("qwen3_moe_async_colossal_cp_wrapper")).plan(_model(), tp_size=2, cp_size=2)
    assert plan.batch_policy == "all_gather"


def test_validate_hooks_take_tp_size():
    from hyper_parallel.distributed.context_parallel.registry import import_target

    attn = _model().model.layers[0].self_attn
    uly = import_target(f"{MODULE}.qwen3_moe_async_ulysses_cp_wrapper").__hp_inner_wrapper__.validate
    uly(attn, cp_size=2)
    uly(attn, cp_size=2, tp_size=2)          # 2/1 heads per TP rank over 2: the KV head replicated
    with pytest.raises(ValueError, match=r"num_q_heads=2 < .*per TP rank"):
        uly(attn, cp_size=4, tp_size=2)
    with pytest.raises(ValueError, match="not divisible by tp_size=4"):
        uly(attn, cp_size=2, tp_size=4)      # 2 kv heads cannot be split over 4 TP ranks


class _NoGroupMesh:
    def get_group(self):
        return None


@pytest.mark.parametrize("bad", ["local_seq_len", "cp_size", "key_doc"])
def test_runtime_checks_run_before_first_launch(bad):
    from hyper_parallel.distributed.context_parallel.async_collectives import async_trace
    from hyper_parallel.distributed.context_parallel.meta import CPBatchMeta, cp_batch_context
    from hyper_parallel.distributed.context_parallel.registry import import_target

    model = _model()
    fn = import_target(f"{MODULE}.qwen3_moe_async_colossal_cp_wrapper")
    for layer in model.model.layers:
        layer.self_attn.forward = fn(layer.self_attn, None, None, _NoGroupMesh(), None)
    S = 8
    ids = torch.randint(0, 256, (2, S))
    meta = dict(cp_rank=0, cp_size=1, global_seq_len=S, local_seq_len=S, key_doc=None)
    with cp_batch_context(CPBatchMeta(**meta)):          # the good case runs
        model(input_ids=ids, use_cache=False)
    if bad == "local_seq_len":
        meta.update(global_seq_len=2 * S, local_seq_len=2 * S)
        match = "local sequence length 8 != meta.local_seq_len 16"
    elif bad == "cp_size":
        meta.update(cp_size=2, global_seq_len=2 * S)
        match = "meta was built for cp rank 0 of 2"
    else:
        meta.update(key_doc=torch.zeros(3, S, dtype=torch.long))
        match = "meta.key_doc has shape"
    with async_trace() as trace, cp_batch_context(CPBatchMeta(**meta)):
        with pytest.raises(ValueError, match=match):
            model(input_ids=ids, use_cache=False)
    assert not [e for e in trace if e[0] == "launch"], trace
