"""``collectives.regather_saved_kv`` in one process, with a stand-in exchange (the multi-rank
behaviour is in test_collectives.py / tests/async_cp/test_async_regather.py): which saved tensors
it replaces, how often it exchanges, and the cases where it must keep what was saved."""
from __future__ import annotations

import torch

from hyper_parallel.distributed.context_parallel.collectives import regather_saved_kv
from hyper_parallel.ops import attention


def _setup(seed=0, S=48, L=16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, L, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k_loc = torch.randn(2, 2, L, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v_loc = torch.randn(2, 2, L, 8, generator=g, dtype=torch.float64, requires_grad=True)
    rest_k = torch.randn(2, 2, S - L, 8, generator=g, dtype=torch.float64)
    rest_v = torch.randn(2, 2, S - L, 8, generator=g, dtype=torch.float64)
    calls = []

    def run(k, v):                     # the "exchange": this rank's shard first, then the others
        calls.append(1)
        return torch.cat([k, rest_k], 2), torch.cat([v, rest_v], 2)

    return q, k_loc, v_loc, run, calls


def _recording_launch(run, events: list):
    """A ``launch`` for regather_saved_kv over the stand-in ``run`` that records "launch" / "wait"."""
    class Handle:
        def __init__(self, k, v):
            events.append("launch")
            self.res = run(k, v)

        def wait(self):
            events.append("wait")
            return self.res

    return Handle


def _attend(q, k, v, L):
    S = k.shape[2]
    return attention(q, k, v, q_pos=torch.arange(S - L, S), k_pos=torch.arange(S), causal=True)


def _reference(q, k_loc, v_loc, run, L, prefixes=(None,)):
    qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, k_loc, v_loc))
    k_all, v_all = run(kr, vr)
    out = sum(_attend(qr, k_all[:, :, :n] if n else k_all, v_all[:, :, :n] if n else v_all, L) for n in prefixes)
    out.sum().backward()
    return out.detach(), [t.grad for t in (qr, kr, vr)]


def test_views_share_one_exchange_and_match_keeping():
    """Two engine calls on key prefixes (views of the gathered K/V, as Head-Tail) and one on the whole:
    one exchange in backward serves all three, and output / gradients equal the run that keeps them."""
    L = 16
    q, k_loc, v_loc, run, calls = _setup()
    ref_out, ref_grads = _reference(q, k_loc, v_loc, run, L, prefixes=(32, 40, None))
    calls.clear()
    k_all, v_all = run(k_loc, v_loc)
    states = []
    with regather_saved_kv((k_loc, v_loc), (k_all, v_all), run, state_out=states):
        out = sum(_attend(q, k_all[:, :, :n] if n else k_all, v_all[:, :, :n] if n else v_all, L)
                  for n in (32, 40, None))
    assert states[0].refs == [3, 3] and states[0].hold is None
    out.sum().backward(retain_graph=True)
    assert len(calls) == 2 and states[0].pending is None        # the forward's gather + one regather
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    for got, ref in zip((q.grad, k_loc.grad, v_loc.grad), ref_grads):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    first = [t.grad.clone() for t in (q, k_loc, v_loc)]
    out.sum().backward()                                          # retain_graph: gathers again, same grads
    assert len(calls) == 3 and states[0].pending is None
    for t, f in zip((q, k_loc, v_loc), first):
        torch.testing.assert_close(t.grad, 2 * f, rtol=1e-12, atol=1e-12)


def test_half_packed_pair_is_kept_not_exchanged():
    """The engine saved a copy of V (not the gathered V): nothing is exchanged in backward (an
    exchange must happen on every rank or none) and the gathered K is kept; a second backward works."""
    L = 16
    q, k_loc, v_loc, run, calls = _setup(1)
    ref_out, ref_grads = _reference(q, k_loc, v_loc, run, L)
    calls.clear()
    k_all, v_all = run(k_loc, v_loc)
    states = []
    with regather_saved_kv((k_loc, v_loc), (k_all, v_all), run, state_out=states):
        out = _attend(q, k_all, v_all * 1, L)                    # V reaches the engine as a copy
    assert states[0].refs == [1, 0] and states[0].hold[0] is k_all and states[0].local == ()
    out.sum().backward(retain_graph=True)
    out.sum().backward()
    assert len(calls) == 1, "a half-packed pair must not be regathered"
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    for got, ref in zip((q.grad, k_loc.grad, v_loc.grad), ref_grads):
        torch.testing.assert_close(got, 2 * ref, rtol=1e-12, atol=1e-12)


def test_gathered_written_in_place_before_the_call_is_kept():
    """K gathered, then scaled in place, then attended: the saved K has another version than the
    gathered tensor had, so it is kept as saved (a regather would give the values before the write)."""
    L = 16
    q, k_loc, v_loc, run, calls = _setup(2)
    k_all, v_all = run(k_loc.detach(), v_loc.detach())
    k_all = k_all.clone().requires_grad_(True)
    v_all = v_all.clone().requires_grad_(True)
    states = []
    kk = k_all * 1
    with regather_saved_kv((k_loc, v_loc), (kk, v_all), run, state_out=states):
        kk.mul_(0.5)
        out = _attend(q, kk, v_all, L)
    assert states[0].refs == [0, 1], states[0].refs
    calls.clear()
    out.sum().backward()
    assert not calls
    k_ref = (k_all.detach() * 0.5).requires_grad_(True)
    q_ref = q.detach().clone().requires_grad_(True)
    _attend(q_ref, k_ref, v_all.detach(), L).sum().backward()
    torch.testing.assert_close(q.grad, q_ref.grad, rtol=1e-12, atol=1e-12)


def test_launch_mode_prefetches_the_pair_created_before():
    """``launch`` mode on three chained layers: reading a layer's pair starts the exchange of the pair
    created just before it (the previous layer's), so that exchange is launched before the previous
    layer's backward begins and only waited when it reads it; nothing stays pending."""
    L = 16
    q, k_loc, v_loc, run, calls = _setup(3)
    events = []
    Handle = _recording_launch(run, events)

    class Marker(torch.autograd.Function):      # records when backward enters a layer
        @staticmethod
        def forward(ctx, x, layer):
            ctx.layer = layer
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            events.append(f"bwd{ctx.layer}")
            return g, None

    x, states = q, []
    for layer in range(3):
        k_all, v_all = run(k_loc, v_loc)
        with regather_saved_kv((k_loc, v_loc), (k_all, v_all), launch=Handle, state_out=states):
            x = _attend(x, k_all, v_all, L)
        x = Marker.apply(x, layer)
    calls.clear()
    x.sum().backward()
    assert events == ["bwd2", "launch", "wait", "launch", "bwd1", "wait", "launch", "bwd0", "wait"], events
    assert len(calls) == 3
    assert all(s.pending is None and s.handle is None for s in states)


def test_prefetched_exchange_of_a_graph_freed_unread_is_waited():
    """Layer A's forward is kept but never backpropagated; B's backward prefetches A's pair (created
    just before B's). When A's graph is freed, the prefetched exchange is waited (nothing pending)."""
    import gc

    L = 16
    q, k_loc, v_loc, run, calls = _setup(4)
    events = []
    Handle = _recording_launch(run, events)

    outs = []
    for _ in range(2):
        k_all, v_all = run(k_loc, v_loc)
        with regather_saved_kv((k_loc, v_loc), (k_all, v_all), launch=Handle):
            outs.append(_attend(q, k_all, v_all, L))
    a, b = outs
    b.sum().backward()
    assert events == ["launch", "wait", "launch"], events       # B's exchange, then A's prefetched
    del a, outs
    gc.collect()
    assert events == ["launch", "wait", "launch", "wait"], events
