"""CP=1 runs the same batch contract as CP>1 (``shard_batch_for_cp`` with a CP group of one), so a
packed + padded global micro-batch gives the same targets, valid-token count, loss, logits and
gradients at CP=1 and CP=2 — and CP=1 really separates the packed documents (its first-step loss
equals the token mean of every document run through the model on its own).

Two micro-batches (GA 2) on fresh random tokens, tiny Llama (fp32, dropout 0, train mode):
  mb 0  packed with ``seq_lens`` / ``seq_lens_padded`` (padding inside document slots and a
        padded row tail), plus the matching 2-D ``attention_mask``;
  mb 1  transformers' convention: ``position_ids`` restarting per document, right padding.
"""
from __future__ import annotations

import pytest
import torch

from . import _workers as W

IGNORE = -100
S = 64
LOSS_ATOL = 1e-5
LOGITS_TOL = (2e-5, 1e-4)   # atol, rtol (as tests/trainer/test_parity.py)
GRAD_REL_TOL = 1e-4         # max abs error / the model's largest gradient


def _packed_batches(seed: int) -> tuple[list, list]:
    """Two global micro-batches [B=2, S] and, per micro-batch, the documents as (row, start, length)."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(1, 256, (n,), generator=g)  # noqa: E731 - pad id 0 never a token
    # mb 0: seq_lens / seq_lens_padded; row 0 slots 24+20+20 = 64, row 1 slots 32+22 (+10 tail padding)
    lens = torch.tensor([[20, 17, 15], [30, 19, 0]])
    slots = torch.tensor([[24, 20, 20], [32, 22, 0]])
    x0 = torch.zeros(2, S, dtype=torch.int64)
    docs0 = []
    for b in range(2):
        start = 0
        for n, slot in zip(lens[b].tolist(), slots[b].tolist()):
            if n:
                x0[b, start:start + n] = ids(n)
                docs0.append((b, start, n))
            start += slot
    mask0 = (x0 != 0).to(torch.int64)
    mb0 = {"input_ids": x0, "labels": torch.where(mask0.bool(), x0, torch.full_like(x0, IGNORE)),
           "attention_mask": mask0, "seq_lens": lens, "seq_lens_padded": slots}
    # mb 1: restarting position_ids, right padding (row 0: 25 + 30 + 9 pad; row 1: 40 + 24)
    x1 = torch.zeros(2, S, dtype=torch.int64)
    pos1 = torch.zeros(2, S, dtype=torch.int64)
    docs1 = []
    for b, parts in enumerate(([25, 30], [40, 24])):
        start = 0
        for n in parts:
            x1[b, start:start + n] = ids(n)
            pos1[b, start:start + n] = torch.arange(n)
            docs1.append((b, start, n))
            start += n
        pos1[b, start:] = torch.arange(S - start) + (pos1[b, start - 1] + 1)   # padding continues the run
    mask1 = (torch.arange(S) < torch.tensor([[55], [64]])).to(torch.int64)
    mb1 = {"input_ids": x1, "labels": torch.where(mask1.bool(), x1, torch.full_like(x1, IGNORE)),
           "attention_mask": mask1, "position_ids": pos1}
    return [mb0, mb1], [docs0, docs1]


def _expected_targets(mb: dict, docs: list) -> torch.Tensor:
    """Next token inside each document; ignore_index on a document's last token and on padding."""
    out = torch.full_like(mb["input_ids"], IGNORE)
    for b, start, n in docs:
        out[b, start:start + n - 1] = mb["input_ids"][b, start + 1:start + n]
    return out


def targets_and_step(cfg: dict, micro_batches: list):
    """Per micro-batch: the global targets this rank's batch contract produced (gathered over CP),
    then one train_step with logits and gradients probed."""
    from hyper_parallel.distributed.context_parallel.batch import gather_from_cp
    from hyper_parallel.trainer.base import StepProbe
    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.text import TextTrainer

    trainer = TextTrainer(TrainerConfig.from_dict(cfg))
    targets, counts = [], []
    for mb in micro_batches:
        p = trainer.prepare_batch(mb)
        shift = p.shift_labels
        if trainer.cp_size > 1:
            shift = gather_from_cp(shift, trainer.mesh.cp_mesh, dim=1)
        targets.append(shift[:, :p.seq_len].cpu())
        counts.append(p.num_valid_tokens)
    r = trainer.train_step(micro_batches, StepProbe(logits=True, grads=True))
    return {"targets": targets, "local_counts": counts, "loss": r.loss, "tokens": r.valid_tokens,
            "logits": r.logits, "grads": r.grads, "cp_rank": trainer.mesh.cp_rank}


def per_document_reference(cfg: dict, micro_batches: list, docs: list) -> float:
    """The step-1 loss computed without any packing: every document through the model on its own."""
    import torch.nn.functional as F

    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.model import HyperAutoModel

    c = TrainerConfig.from_dict(cfg)
    torch.manual_seed(c.schedule.seed)
    model = HyperAutoModel.from_config(c.model).train()
    total, n = 0.0, 0
    with torch.no_grad():
        for mb, mb_docs in zip(micro_batches, docs):
            for b, start, length in mb_docs:
                x = mb["input_ids"][b:b + 1, start:start + length]
                logits = model(input_ids=x, use_cache=False).logits.double()
                total += float(F.cross_entropy(logits[0, :-1], x[0, 1:], reduction="sum"))
                n += length - 1
    return total / n


def _rel(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    a = (got.double() - ref.double()).abs().max().item()
    return a, a / max(ref.abs().max().item(), 1e-12)


@pytest.mark.parametrize("method", ["colossal", "head_tail"])
def test_cp1_and_cp2_give_the_same_targets_and_loss_on_packed_padded_batches(ranks, tmp_path, method):
    micro_batches, docs = _packed_batches(seed=1234 + len(method))
    cfg1 = W.make_cfg("llama", cp=1, ga=2, seq_len=S, method=method, out_dir=str(tmp_path / "cp1"))
    cfg2 = W.make_cfg("llama", cp=2, ga=2, seq_len=S, method=method, out_dir=str(tmp_path / "cp2"))
    [ref] = ranks(1).run(targets_and_step, cfg1, micro_batches, timeout=300)
    cp2 = ranks(2).run(targets_and_step, cfg2, micro_batches, timeout=300)

    # targets: CP=1 and every CP=2 rank's gathered shard equal the hand-built document targets
    n_expected = 0
    for i, (mb, mb_docs) in enumerate(zip(micro_batches, docs)):
        expected = _expected_targets(mb, mb_docs)
        n_expected += int((expected != IGNORE).sum())
        assert torch.equal(ref["targets"][i], expected), f"CP=1 micro-batch {i}: targets cross a document"
        for r, res in enumerate(cp2):
            assert torch.equal(res["targets"][i], expected), f"CP=2 rank {r} micro-batch {i}: targets differ"
        assert sum(res["local_counts"][i] for res in cp2) == ref["local_counts"][i]
    assert ref["tokens"] == n_expected and all(res["tokens"] == n_expected for res in cp2)

    # CP=1 separates the packed documents: its loss is the per-document token mean
    [doc_loss] = ranks(1).run(per_document_reference, cfg1, micro_batches, docs, timeout=300)
    err_doc = abs(ref["loss"] - doc_loss)
    print(f"{method}: CP=1 loss {ref['loss']:.8f} vs per-document reference {doc_loss:.8f}: "
          f"abs err {err_doc:.2e} rel {err_doc / doc_loss:.2e} (tol {LOSS_ATOL:g} abs)")
    assert err_doc <= LOSS_ATOL

    # CP=2 == CP=1: loss, logits on valid positions, gradients
    g_scale = max(g.abs().max().item() for g in ref["grads"].values())
    worst = {"loss": 0.0, "logits": (0.0, 0.0), "grads": 0.0}
    for r, res in enumerate(cp2):
        err = abs(res["loss"] - ref["loss"])
        worst["loss"] = max(worst["loss"], err)
        assert err <= LOSS_ATOL, f"CP=2 rank {r}: loss {res['loss']:.8f} vs CP=1 {ref['loss']:.8f}"
        for i, mb in enumerate(micro_batches):
            valid = mb["attention_mask"].bool()
            got, exp = res["logits"][i][valid], ref["logits"][i][valid]
            torch.testing.assert_close(got, exp, atol=LOGITS_TOL[0], rtol=LOGITS_TOL[1])
            a, rel = _rel(got, exp)
            worst["logits"] = (max(worst["logits"][0], a), max(worst["logits"][1], rel))
        for name, g in ref["grads"].items():
            a = (res["grads"][name].double() - g.double()).abs().max().item()
            worst["grads"] = max(worst["grads"], a)
            assert a <= GRAD_REL_TOL * g_scale, f"CP=2 rank {r}: grad of {name}: max abs err {a:.3e}"
    print(f"{method}: CP=2 vs CP=1 loss max abs {worst['loss']:.2e} (tol {LOSS_ATOL:g}); logits max abs "
          f"{worst['logits'][0]:.2e} rel {worst['logits'][1]:.2e} (atol {LOGITS_TOL[0]:g} rtol {LOGITS_TOL[1]:g}); "
          f"grads max abs {worst['grads']:.2e} = {worst['grads'] / g_scale:.2e} of the largest gradient "
          f"{g_scale:.2e} (tol {GRAD_REL_TOL:g})")


def test_cp1_refuses_padding_inside_a_document():
    """CP=1 passes no attention_mask: padding followed by a token of the same document is refused."""
    from hyper_parallel.trainer.batch_prep import prepare_batch

    x = torch.randint(1, 256, (1, 16))
    mask = torch.ones(1, 16, dtype=torch.int64)
    mask[0, 5:8] = 0
    with pytest.raises(ValueError, match="row 0: padding at token 7 is followed by valid token 8"):
        prepare_batch({"input_ids": x, "attention_mask": mask}, cp_mesh=None, cp_size=1, policy=None,
                      device="cpu")
    # the same padding ending a document whose successor restarts its positions is fine
    pos = torch.cat([torch.arange(8), torch.arange(8)]).unsqueeze(0)
    p = prepare_batch({"input_ids": x, "attention_mask": mask, "position_ids": pos}, cp_mesh=None, cp_size=1,
                      policy=None, device="cpu")
    # targets: 0..3 and 8..14 (token 4 precedes padding, 5..7 are padding, 15 is last)
    assert p.num_valid_tokens == int((p.shift_labels != IGNORE).sum()) == 11
