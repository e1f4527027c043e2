"""The entry point :func:`prove_cp_model`: every phase agreed on every rank, the first checkpoint
above tolerance refused, a :class:`ProofReport` on success."""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import torch.nn as nn

from ...errors import CPConfigError
from ...preflight import agree_or_raise
from .checks import _Check
from .probe import _world
from .prover import _Prover
from .refusal import _refusal
from .report import ProofReport, _dtype
from .state import _preserved

log = logging.getLogger("hyper_parallel.cp.proof")


def prove_cp_model(model: nn.Module, plan, mesh, *, seq_len: Optional[int] = None, max_seq_len: int = 4096,
                   pad_token_id: int = 0, ignore_index: int = -100, seed: int = 0,
                   packed: Optional[bool] = None, upcast: bool = True,
                   prepare: Optional[Callable] = None) -> Optional[ProofReport]:
    """Prove on a probe input that ``model`` (with ``plan`` applied) computes under CP what it
    computes without CP, layer by layer; raise :class:`CPConfigError` naming the first module
    that differs. Collective: call it on **every** rank (world group), after
    :func:`~...plan.applier.apply_sharding_plan`, before the first step.

    ``plan``: the :class:`~...plan.planner.ShardingPlan`; ``mesh``: the MeshContext (or the
    1-D cp mesh). ``seq_len``: probe S (default: see module doc; ``max_seq_len`` caps it).
    ``packed``: None = include the packed row when the batch contract accepts ``seq_lens``,
    True = require it, False = omit it. ``upcast``: run a bf16/fp16 (non-DTensor) model in fp32
    for the probe. ``prepare``: the batch contract (default: ``plan.batch_prepare_fn`` or
    ``shard_batch_for_cp``). Returns a :class:`ProofReport` (None when ``plan.cp_size == 1``:
    nothing to prove). The model is left exactly as it was.
    """
    if getattr(plan, "cp_size", 1) <= 1:
        return None
    t0 = time.perf_counter()
    prover = _Prover(model, plan, mesh, seq_len=seq_len, max_seq_len=max_seq_len, pad_token_id=pad_token_id,
                     ignore_index=ignore_index, seed=seed, packed=packed, upcast=upcast, prepare=prepare)
    what = "CP preflight proof"
    with _preserved(model, upcast):
        agree_or_raise(prover.build, what=f"{what} (probe batch)")
        agree_or_raise(prover.run_cp, what=f"{what} (CP forward)")
        local = agree_or_raise(prover.run_ref, what=f"{what} (reference forward)")
        everyone = _gather(local)
        keys = [c[0] for c in local]
        if any([c[0] for c in other] != keys for other in everyone):
            raise CPConfigError("accelerator.cp_preflight_proof", "the ranks compared different checkpoints on the "
                                "probe (the model's control flow differs between ranks)",
                                fix="run the same model on every rank")
        merged = []
        for i, c in enumerate(local):
            diff = max(other[i][2] for other in everyone)
            merged.append((c[0], c[1], diff, c[3], c[4], c[5]))
        failing = None
        for c in merged:
            chk = _Check(c[0], c[1], c[2], c[3], c[4], _dtype(c[5]))
            if chk.diff > chk.tol():
                failing = c
                break
        if failing is not None:
            culprit = None
            if failing[0].startswith(("delta:", "out:")):
                layer = prover.names[failing[1]]
                culprit = agree_or_raise(lambda: prover.attribute(failing[1], layer), what=f"{what} (attribution)")
            err = _refusal(prover, failing, culprit)

            def refuse():
                raise err

            agree_or_raise(refuse, what=what)
    worst = max((c[2] / c[3] if c[3] else 0.0) for c in merged) if merged else 0.0
    report = ProofReport(seq_len=prover.S, rows=prover.B, packed=prover.packed, layers=len(prover.layers),
                         checkpoints=len(merged), max_rel_error=worst,
                         dtype=merged[0][5] if merged else "n/a", time_s=time.perf_counter() - t0)
    log.info("CP preflight proof passed: S=%d rows=%d packed=%s layers=%d checkpoints=%d max rel err %.2e (%s) "
             "in %.2fs", report.seq_len, report.rows, report.packed, report.layers, report.checkpoints,
             report.max_rel_error, report.dtype, report.time_s)
    return report


def _gather(local):
    if _world() == 1:
        return [local]
    from ....platform import all_gather_object

    return all_gather_object(local)
