"""A mixer's sequence arguments are stated, not guessed from shapes (``mixers.layout``): under the
balanced split a tensor argument with a dim of the local length that the registration does not state
is refused before any collective, naming the module and the argument; a stated one moves along its
stated dim. One process: the relayout is a stand-in (reverse the tokens), the check runs before it."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hyper_parallel.distributed.context_parallel.comm import relayout as R
from hyper_parallel.distributed.context_parallel.meta import CPBatchMeta, cp_batch_context
from hyper_parallel.distributed.context_parallel.mixers import layout
from hyper_parallel.distributed.context_parallel.mixers.rows import CPMixerError
from hyper_parallel.distributed.context_parallel.registry import inner_wrapper

B, L, D = 2, 4, 3


class ToyMixer(nn.Module):
    """hidden_states [B, L, D] plus a side input in [L, B, D] layout (sequence on dim 0)."""

    def forward(self, hidden_states, side=None):
        return hidden_states + side.transpose(0, 1)


class _Flip:   # stand-in for this step's Relayout: the contiguous order is the reverse of the slots
    def to_contiguous(self, x):
        return x.flip(1)

    def to_permuted(self, y):
        return y.flip(1)


def _meta():
    return CPBatchMeta(cp_rank=0, cp_size=2, global_seq_len=2 * L, local_seq_len=L, key_doc=None,
                       policy="balanced", perm=torch.tensor([4, 5, 0, 1, 6, 7, 2, 3]))


@pytest.fixture
def no_comm(monkeypatch):
    moves = []
    monkeypatch.setattr(layout, "resolve_group", lambda mesh: None)
    monkeypatch.setattr(layout.P, "group_rank", lambda g: 0)
    monkeypatch.setattr(layout.P, "group_size", lambda g: 2)
    monkeypatch.setattr(R.Relayout, "cached", classmethod(lambda cls, *a, **k: moves.append(a) or _Flip()))
    return moves


def _install(seq_dims=None):
    m = ToyMixer()
    seen = {}

    def method(hidden_states, side=None):     # a mixer method: sees the contiguous layout
        seen.update(hs=hidden_states, side=side)
        return ToyMixer.forward(m, hidden_states, side)
    return m, layout.on_contiguous_layout(method, m, object(), seq_dims, "model.layers.0.mixer"), seen


def test_unstated_sequence_dim_is_refused_before_the_relayout(no_comm):
    m, fwd, seen = _install()
    hs, side = torch.randn(B, L, D), torch.randn(L, B, D)
    with cp_batch_context(_meta()), pytest.raises(CPMixerError) as err:
        fwd(hs, side=side)
    print(err.value)
    msg = str(err.value)
    assert "'model.layers.0.mixer'" in msg and "'side'" in msg and "seq_dims" in msg, msg
    assert not seen and not no_comm, "ran or relaid out before refusing"


def test_a_stated_dim_that_does_not_carry_the_sequence_is_refused(no_comm):
    _m, fwd, seen = _install({"side": 1})          # stated, but dim 1 is the batch here
    with cp_batch_context(_meta()), pytest.raises(CPMixerError, match="stated on dim 1"):
        fwd(torch.randn(B, L, D), side=torch.randn(L, B, D))
    assert not seen


def test_a_stated_dim_moves_along_it(no_comm):
    _m, fwd, seen = _install({"side": 0})
    hs, side = torch.randn(B, L, D), torch.randn(L, B, D)
    with cp_batch_context(_meta()):
        out = fwd(hs, side=side)
    assert torch.equal(seen["hs"], hs.flip(1)) and torch.equal(seen["side"], side.flip(0))
    assert torch.equal(out, hs + side.transpose(0, 1))   # moved back: the permuted order again


def test_contiguous_batch_runs_the_method_unchanged(no_comm):
    _m, fwd, seen = _install()
    hs, side = torch.randn(B, L, D), torch.randn(L, B, D)
    meta = CPBatchMeta(cp_rank=0, cp_size=2, global_seq_len=2 * L, local_seq_len=L, key_doc=None,
                       policy="all_gather")
    with cp_batch_context(meta):
        fwd(hs, side=side)
    assert seen["side"] is side and not no_comm


def test_registration_checks_seq_dims():
    with pytest.raises(ValueError, match="seq_dims"):
        inner_wrapper(method="custom", style="hf", mixer=True, seq_dims={"side": -1})
    with pytest.raises(ValueError, match="mixer=True only"):
        inner_wrapper(method="custom", style="hf", seq_dims={"side": 0})
