"""A registered model spec's batch_prepare_fn is the batch contract the trainer uses for CP > 1."""
from __future__ import annotations

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
        assert spec[r][1] == ["all_gather", "all_gather"], spec[r][1]  # one call per step
        assert spec[r][0] == plain[r][0]  # the delegating contract gives the same losses
