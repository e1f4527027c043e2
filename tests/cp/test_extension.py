"""A CP method added from this test module alone (no file under ``hyper_parallel/`` edited): its
catalogue row, its strategy, its async plan and its cost model here, the entry points generated from
the row (``context_parallel.extension.registered_method``), run end to end — the sync one through the
planner, the applier (preflight proof included) and a tiny Llama at CP=2 against CP=1, the async one
on the docs' handoff-protocol attention against the same module on the whole sequence; and gone again
after the block."""
from __future__ import annotations

import os

import pytest
import yaml

from hyper_parallel.distributed.context_parallel import catalogue
from hyper_parallel.distributed.context_parallel.async_plan import AsyncPlan, group_of
from hyper_parallel.distributed.context_parallel.collectives import flex_cp_allgather
from hyper_parallel.distributed.context_parallel.cost_model import CostModel, LayerShape
from hyper_parallel.distributed.context_parallel.extension import registered_method
from hyper_parallel.distributed.context_parallel.methods.base import CPGroupStrategy, engine_attention
from hyper_parallel.distributed.context_parallel.methods.colossal.async_ import colossal_kv_plan

from tests.wrappers import _workers as W

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CP, S, TOL = 2, 32, 1e-5
NAME = "toy_gather"


class ToyGatherStrategy(CPGroupStrategy):
    """K/V gathered whole (autograd: ReduceScatter back), the engine on the local queries at their
    global positions: Colossal without its window trimming or regather."""

    name = "all_gather"        # its batch policy
    method = NAME

    def attention(self, q, k, v, *, meta, scale=None, window=None, softcap=None, sinks=None):
        self.check_inputs(q, k, v, meta, cp_size=self.cp_size, cp_rank=self.cp_rank)
        k_all, v_all = flex_cp_allgather(k, v, 2, self.group)
        return engine_attention(q, k_all, v_all, q_pos=meta.q_index, k_pos=meta.k_index, meta=meta, scale=scale,
                                window=window, softcap=softcap, sinks=sinks)


class ToyCost(CostModel):
    def comm(self, x: LayerShape) -> dict:
        kv = 2 * x.local * x.hk * x.d * x.elem * (x.cp - 1)
        return {"fwd K/V AllGather": kv, "bwd dK/dV ReduceScatter": kv}


COST = ToyCost()


def toy_async_plan(method, strategy_cls, mesh, cp_mesh, ulysses_degree=None) -> AsyncPlan:
    """The toy's async variant: K and V launched at their handoffs (AllGather on the comm thread;
    backward ReduceScatter), waited whole at ``cp_attn_wait``, the engine on the local queries."""
    group = group_of(cp_mesh)
    kv = colossal_kv_plan(group)
    return AsyncPlan(method, {"k": kv, "v": kv}, strategy_cls(group), group=group, attend=toy_attend)


def toy_attend(plan, call, q, k, v, meta, sinks, kw: dict, keep: bool):
    return engine_attention(q, k, v, q_pos=meta.q_index, k_pos=meta.k_index, sinks=sinks, **kw)


ASYNC_ENTRY = catalogue.async_entry_name(NAME)
_NOT = "not offered by the toy"
ROW = catalogue.CPMethod(
    name=NAME, title="toy gather (a test module's own method)", strategy="ToyGatherStrategy",
    batch_policy="all_gather", head_rule="gqa", head_doc="any GQA ratio", degree="none", degree_doc="no degree",
    async_reason="the toy's own async plan", cost=f"{__name__}:COST", async_plan=f"{__name__}:toy_async_plan",
    async_targets=(f"{__name__}.{ASYNC_ENTRY}",), async_doc="K/V AllGather launched at their handoffs",
    offers=(catalogue.Offer("hf", "sdpa_hf_toy_gather_cp_wrapper", "sdpa_hf_toy_gather", module=__name__),
            catalogue.Offer("qkv", reason=_NOT + " (the sdpa_qkv style)"),
            catalogue.Offer("flex_hf", reason=_NOT + " (the flex_hf style)"),
            catalogue.Offer("flex_qkv", reason=_NOT + " (the flex_qkv style)")))


def toy_parity(path: str) -> dict:
    """On each rank: the toy registered, the tiny Llama of the YAML at CP=2 vs CP=1 (logits, grads)."""
    with registered_method(ROW, ToyGatherStrategy, globals()):
        return W.cp_parity(path, model_kind="hf", S=S, grads=True, fsdp=False)


def test_a_method_added_from_a_test_module_runs_end_to_end_toy_method(ranks, tmp_path):
    doc = yaml.safe_load(open(os.path.join(ROOT, "examples", "cp", "colossal.yaml"), encoding="utf-8"))
    doc["accelerator"]["cp_size"] = CP
    doc["plan_overrides"] = [{"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self",
                              "inner_wrapper": "sdpa_hf_toy_gather"}]
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(doc))
    res = ranks(CP).run(toy_parity, str(path))
    for r, got in enumerate(res):
        print(f"toy method rank {r}: logits max abs {got['logits']:.2e} (rel {got['logits_rel']:.2e}), grads max "
              f"rel {got['grads']:.2e} (tol {TOL:g}); {got['summary'].splitlines()[1]}")
        assert got["logits"] <= TOL and got["grads"] <= TOL, got
        assert f"inner_wrapper=sdpa_hf_toy_gather [{NAME}, sync]" in got["summary"], got["summary"]
    assert NAME not in catalogue.METHODS     # the parent never registered it


def test_a_registered_method_is_read_everywhere_and_removed_after_toy_method():
    from hyper_parallel.distributed.context_parallel.registry import get_registered, wrapper_methods

    before = dict(catalogue.METHODS)
    with registered_method(ROW, ToyGatherStrategy, globals()) as names:
        assert names == ["sdpa_hf_toy_gather_cp_wrapper", ASYNC_ENTRY], names
        assert globals()[names[0]] is get_registered("sdpa_hf_toy_gather")
        assert catalogue.async_targets(catalogue.get_method(NAME))[0] == f"{__name__}.{ASYNC_ENTRY}"
        assert NAME in wrapper_methods() and catalogue.batch_policy_for([NAME]) == "all_gather"
        assert catalogue.cost_model(NAME) is COST
        got = catalogue.cost_model(NAME).comm(LayerShape(S=64, cp=4, hq=4, hk=2, d=8))
        assert got["fwd K/V AllGather"] == 2 * 16 * 2 * 8 * 4 * 3, got
        with pytest.raises(ValueError, match="already in the catalogue"):
            with registered_method(ROW, ToyGatherStrategy, globals()):
                pass
    assert catalogue.METHODS == before and "sdpa_hf_toy_gather_cp_wrapper" not in globals()
    assert ASYNC_ENTRY not in globals()
    assert NAME not in wrapper_methods()
    with pytest.raises(ValueError, match="already in the catalogue"):
        with registered_method(catalogue.METHODS["colossal"], ToyGatherStrategy, globals()):
            pass
    with pytest.raises(ValueError):
        catalogue.get_method(NAME)


def toy_async_parity() -> dict:
    """On each rank: the toy registered, its generated async Target on the docs' handoff-protocol
    attention at CP=2 vs the module on the whole sequence (output and every gradient, relative)."""
    from tests.async_cp._workers import custom_adapter_parity

    with registered_method(ROW, ToyGatherStrategy, globals()):
        return custom_adapter_parity(wrapper=globals()[ASYNC_ENTRY])


def test_an_async_method_added_from_a_test_module_runs_toy_method(ranks):
    for r, got in enumerate(ranks(CP).run(toy_async_parity)):
        print(f"toy async method rank {r}: output max rel {got['out']:.2e}, grads max rel {got['grads']:.2e} "
              f"(tol {TOL:g})")
        assert got["out"] <= TOL and got["grads"] <= TOL, got


def test_a_malformed_async_row_is_refused_toy_method():
    import dataclasses

    for bad in (dataclasses.replace(ROW, async_targets=()),                            # a plan, no Target
                dataclasses.replace(ROW, async_targets=("elsewhere.async_toy_gather_cp_wrapper",)),
                dataclasses.replace(ROW, async_plan=None)):                             # a Target, no plan
        with pytest.raises(ValueError, match="async row"):
            with registered_method(bad, ToyGatherStrategy, globals()):
                pass
        assert NAME not in catalogue.METHODS
