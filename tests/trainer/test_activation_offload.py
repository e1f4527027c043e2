"""schedule.activation_offload: the checkpointed layer inputs go through host buffers and come
back bit-equal — losses, every gradient and every parameter after the step equal offload off, on
the trainer at CP=1 (transformers' gradient checkpointing) and CP=2 (the applier's checkpointing);
refused without activation checkpointing and with TP."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from hyper_parallel.distributed.errors import CPConfigError
from hyper_parallel.platform import get_platform
from hyper_parallel.trainer.activation_offload import ActivationOffloader, check_activation_offload
from hyper_parallel.trainer.config import TrainerConfig

from . import _workers as W


def offload_steps(cfg: dict, batches: list):
    """:func:`_workers.run_steps` plus the offloader's counters (None when off)."""
    from hyper_parallel.trainer.base import StepProbe
    from hyper_parallel.trainer.text import TextTrainer

    trainer = TextTrainer(TrainerConfig.from_dict(cfg))
    probe = StepProbe(logits=False, grads=True, params=True)
    steps = [trainer.train_step(mbs, probe) for mbs in batches[trainer.mesh.dp_rank]]
    off = trainer.model.__dict__.get("_hp_activation_offload")
    return {"losses": [r.loss for r in steps], "grads": [r.grads for r in steps], "params": steps[-1].params,
            "layers": trainer.activation_offload, "stats": None if off is None else vars(off.stats).copy()}


def _assert_bit_equal(on: dict, off: dict) -> None:
    assert on["losses"] == off["losses"]
    for g_on, g_off in zip(on["grads"], off["grads"]):
        assert g_on.keys() == g_off.keys()
        for name in g_on:
            assert torch.equal(g_on[name], g_off[name]), name
    for name in on["params"]:
        assert torch.equal(on["params"][name], off["params"][name]), name


@pytest.mark.parametrize("cp,mp", [(1, None), (2, None), (1, "bf16")])
def test_trainer_offload_is_bit_exact(ranks, cp, mp):
    """CP=1: transformers' gradient checkpointing; CP=2 and bf16 (FSDP2 on a 1-rank mesh): the applier's."""
    kw = dict(cp=cp, mp=mp, steps=2, ga=2, ac=True, seq_len=64, min_doc_len=16)
    cfg_off = W.make_cfg("llama", **kw)
    cfg_on = W.make_cfg("llama", schedule__activation_offload=True, **kw)
    batches = W.make_batches(cfg_off)
    off = ranks(cp).run(offload_steps, cfg_off, batches)
    on = ranks(cp).run(offload_steps, cfg_on, batches)
    for r_on, r_off in zip(on, off):
        _assert_bit_equal(r_on, r_off)
        assert r_on["layers"] == ["model.layers.0", "model.layers.1"] and r_off["stats"] is None
        s = r_on["stats"]
        # per micro-batch each of the 2 layers offloads its input; backward of layer 1 prefetches layer 0
        assert s["packed"] == 2 * 2 * 2 and s["fetched_on_demand"] == s["prefetched"] == s["packed"] // 2, s


def _layered(offloader, x, weights):
    h = x
    for i, w in enumerate(weights):
        with offloader.layer(i) if offloader is not None else contextlib.nullcontext():
            h = checkpoint(lambda a, w=w: torch.tanh(a @ w) * a, h, use_reentrant=False)
    return h


def test_offloader_packs_checkpoint_inputs_and_prefetches_the_previous_layer():
    torch.manual_seed(0)
    weights = [torch.randn(8, 8, requires_grad=True) for _ in range(3)]
    x = torch.randn(8, 4, requires_grad=True)
    inp = x.t()      # a non-contiguous input: its host copy keeps the strides
    ref = _layered(None, inp, weights)
    grads_ref = torch.autograd.grad(ref.square().sum(), [x, *weights])
    off = ActivationOffloader(get_platform("cpu"))
    out = _layered(off, inp, weights)
    assert torch.equal(out, ref)
    assert off.stats.packed == 3 and off.stats.kept == 0 and off.stats.packed_bytes == 3 * 32 * 4
    grads = torch.autograd.grad(out.square().sum(), [x, *weights])
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ref))
    # layer 2 on demand, layers 1 and 0 prefetched by the unpack of the layer after them
    assert (off.stats.fetched_on_demand, off.stats.prefetched) == (1, 2)


def test_refused_where_it_cannot_work():
    sched = TrainerConfig.from_dict(W.make_cfg("llama", schedule__activation_offload=True)).schedule
    with pytest.raises(CPConfigError, match="schedule.activation_offload.*activation_checkpointing is false"):
        check_activation_offload(sched)
    sched = TrainerConfig.from_dict(W.make_cfg("llama", ac=True, schedule__activation_offload=True)).schedule
    check_activation_offload(sched)
    with pytest.raises(CPConfigError, match="schedule.activation_offload.*tensor parallelism"):
        check_activation_offload(sched, tp_size=2)


def test_trainer_refuses_offload_without_checkpointing(ranks):
    [err] = ranks(1).run(W.build_error, W.make_cfg("llama", schedule__activation_offload=True))
    assert err[0] == "CPConfigError" and "schedule.activation_offload" in err[1]
    assert "activation_checkpointing is false" in err[1]
