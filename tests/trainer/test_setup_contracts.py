"""Trainer set-up contracts: a registered model spec's batch_prepare_fn is the CP batch contract,
and the sharding plan is agreed across ranks (an error on one rank fails every rank)."""
from __future__ import annotations

import pytest

from . import _workers as W

_CALLS: list = []


def _recording_prepare(batch, cp_mesh, policy, **kw):
    """Records the call, then delegates to the standard contract."""
    from hyper_parallel.distributed.context_parallel.batch import shard_batch_for_cp

    _CALLS.append(policy)
    return shard_batch_for_cp(batch, cp_mesh, policy, **kw)


def train_with_spec(cfg: dict, register: bool):
    from hyper_parallel.distributed.context_parallel.model_spec import (register_cp_model_spec,
                                                                        unregister_cp_model_spec)

    _CALLS.clear()
    if register:
        register_cp_model_spec(architecture="llama", attention_targets=("*.self_attn",),
                               batch_prepare_fn=_recording_prepare)
    try:
        out = W.train_losses(cfg)
    finally:
        if register:
            unregister_cp_model_spec("llama")
    return out["losses"], list(_CALLS)


def test_registered_batch_prepare_fn_is_used_and_keeps_the_numbers(ranks, tmp_path):
    cfg = W.make_cfg("llama", cp=2, steps=2, warmup=1, min_doc_len=16, out_dir=str(tmp_path / "a"))
    plain = ranks(2).run(train_with_spec, cfg, False)
    spec = ranks(2).run(train_with_spec, dict(cfg, logging=dict(cfg.get("logging", {}),
                                                                out_dir=str(tmp_path / "b"))), True)
    for r in range(2):
        assert plain[r][1] == [], "no spec registered: the standard contract must not be replaced"
        # one call for the CP preflight proof's probe batch (it shards with the registered contract
        # too, accelerator.cp_preflight_proof defaults to true), then one call per step
        assert spec[r][1] == ["all_gather", "all_gather", "all_gather"], spec[r][1]
        assert spec[r][0] == plain[r][0]  # the delegating contract gives the same losses


def plan_fails_on_rank_1(cfg: dict):
    """Rank 1's planning raises (injected); every rank must fail at construction, none hang."""
    import torch.distributed as dist

    from hyper_parallel.distributed.errors import CPConfigError
    from hyper_parallel.distributed.plan.planner import ShardingPlanner

    original = ShardingPlanner.plan
    if dist.get_rank() == 1:
        def bad_plan(self, *a, **kw):
            raise CPConfigError("plan_overrides[0]", "injected planning failure on rank 1")
        ShardingPlanner.plan = bad_plan
    try:
        return W.build_error(cfg)
    finally:
        ShardingPlanner.plan = original


def test_planning_error_on_one_rank_fails_every_rank(ranks, tmp_path):
    cfg = W.make_cfg("llama", cp=2, steps=1, out_dir=str(tmp_path))
    errs = ranks(2).outcomes(plan_fails_on_rank_1, cfg, timeout=60)
    assert errs[1][0] == "CPConfigError" and "injected planning failure on rank 1" in errs[1][1], errs[1]
    assert errs[0][0] == "PreflightError" and "sharding plan failed on 1 rank(s): rank 1" in errs[0][1], errs[0]


def test_config_differing_between_ranks_fails_every_rank(ranks, tmp_path):
    good = W.make_cfg("llama", cp=2, steps=1, out_dir=str(tmp_path))
    bad = dict(good, schedule=dict(good["schedule"], resume_from=str(tmp_path / "no_such_checkpoint")))
    errs = ranks(2).outcomes(W.build_error, timeout=60, rank_args=[(good,), (bad,)])
    for e in errs:  # every rank: the same error, naming the section and the odd rank
        assert e[0] == "CPConfigError" and "'schedule' section differs between ranks: rank(s) [1]" in e[1], e


def _inject_on_rank_1(target, attr: str, exc: BaseException):
    import torch.distributed as dist

    original = getattr(target, attr)
    if dist.get_rank() == 1:
        def fail(*a, **kw):
            raise exc
        setattr(target, attr, fail)
    return original


def model_build_fails_on_rank_1(cfg: dict):
    from hyper_parallel.distributed.errors import CPConfigError
    from hyper_parallel.trainer.model import HyperAutoModel

    original = _inject_on_rank_1(HyperAutoModel, "from_config",
                                 CPConfigError("model.config_file", "unreadable on this node only"))
    try:
        return W.build_error(cfg)
    finally:
        HyperAutoModel.from_config = original


def resume_check_fails_on_rank_1(cfg: dict):
    """Rank 0 sees a valid checkpoint (stubbed), rank 1 cannot read it."""
    import torch.distributed as dist

    from hyper_parallel.distributed.errors import CPConfigError
    from hyper_parallel.trainer.checkpoint import resume as checkpoint   # where validate_resume looks them up

    saved = checkpoint.read_meta, checkpoint.check_topology, checkpoint.verify_checkpoint
    if dist.get_rank() == 0:
        checkpoint.read_meta = lambda path, **kw: {"topology": {}}
        checkpoint.check_topology = lambda path, saved_topology, current: None
        checkpoint.verify_checkpoint = lambda path, meta, part=0, parts=1: None
    else:
        _inject_on_rank_1(checkpoint, "read_meta", CPConfigError("schedule.resume_from", "not on this node's disk"))
    try:
        return W.build_error(cfg)
    finally:
        checkpoint.read_meta, checkpoint.check_topology, checkpoint.verify_checkpoint = saved


@pytest.mark.parametrize("worker,extra,own,agreed", [
    (model_build_fails_on_rank_1, {}, "unreadable on this node only", "model build"),
    (resume_check_fails_on_rank_1, {"schedule__resume_from": "ckpt"}, "not on this node's disk",
     "checkpoint resume"),
], ids=["model_build", "resume"])
def test_setup_error_on_one_rank_fails_every_rank(ranks, tmp_path, worker, extra, own, agreed):
    extra = {k: str(tmp_path / v) for k, v in extra.items()}
    cfg = W.make_cfg("llama", cp=2, steps=1, out_dir=str(tmp_path), **extra)
    errs = ranks(2).outcomes(worker, cfg, timeout=60)
    assert errs[1][0] == "CPConfigError" and own in errs[1][1], errs[1]
    if agreed == "checkpoint resume":
        # checkpoint checks raise the failing rank's own error on every rank: one line, the same everywhere
        assert errs[0] == errs[1], errs
    else:
        assert errs[0][0] == "PreflightError" and f"{agreed} failed on 1 rank(s): rank 1" in errs[0][1], errs[0]
