"""Differentiable CP collectives: Colossal AllGather, Ulysses A2A, Hybrid, Head-Tail.

Every collective goes through :mod:`hyper_parallel.platform` (the only caller of
``torch.distributed`` collectives) on a group handed in by the caller — a 1-D ``DeviceMesh``
(its cached group is used), a ``ProcessGroup`` cached from the root mesh, or ``None``
(= a CP group of size 1). Nothing here creates a process group. A group of size 1 is the
identity: the input is returned as is and no collective is issued.

Layouts are ``[B, H, S, D]`` (``seq_dim=2``, ``head_dim=1`` by default). The sequence order
of a CP group is group-rank order: rank ``i`` holds the ``i``-th contiguous sequence chunk.

  flex_cp_allgather(k, v, cp_dim, cp_mesh)
      fwd: AllGather K and V along ``cp_dim``       [.., S/C, ..] -> [.., S, ..]
      bwd: ReduceScatter(sum) of dK, dV              [.., S, ..]   -> [.., S/C, ..]
  window_chunk_ranges(world, local_len, window, causal) -> [(lo_r, hi_r)] per rank (no comm)
  flex_cp_window_gather(k, v, cp_dim, cp_mesh, ranges)
      fwd: rank r receives only chunks lo_r..hi_r  [.., S/C, ..] -> [.., (hi_r-lo_r+1)*S/C, ..]
      bwd: each received chunk's gradient goes back to its owner and is summed there
  regather_saved_kv(local, gathered, run)   (context manager around the attention)
      the attention saves the gathered K/V as the local shards; backward re-runs the exchange
  ulysses_seq_to_head(x, group)   [B, H, S/C, D] -> [B, H/C, S, D]   bwd: head_to_seq
  ulysses_head_to_seq(x, group)   [B, H/C, S, D] -> [B, H, S/C, D]   bwd: seq_to_head
      heads=[per-rank head indices]: uneven / replicated head split (one uneven all_to_all;
      bwd sums the gradients of a head's copies) — see strategies/ulysses_layout.py
  hybrid_kv_allgather(k, v, colossal, ulysses)
      [B, Hk, S/C, D] -> A2A(ulysses) -> [B, Hk/u, S*u/C, D] -> AllGather(colossal) -> [B, Hk/u, S, D]
      bwd: ReduceScatter(colossal) then the inverse A2A(ulysses)
  head_tail_dispatch / head_tail_combine
      Q sub-chunk exchange of the Head-Tail load balance (see :func:`head_tail_dispatch`).

Shapes and divisibility are checked before any collective; errors name the dimension and
the group (size and global ranks) that failed.
"""
from __future__ import annotations

import weakref
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ... import platform as P

__all__ = [
    "resolve_group", "group_desc", "flex_cp_allgather", "all_gather_seq", "ulysses_seq_to_head",
    "ulysses_head_to_seq", "hybrid_kv_allgather", "head_tail_dispatch", "head_tail_combine",
    "head_tail_sub_chunks", "CPCollectiveError", "window_chunk_ranges", "flex_cp_window_gather",
    "all_reduce_sum_replicated", "regather_saved_kv", "regather_allgather", "regather_window_gather",
]


class CPCollectiveError(ValueError):
    """A CP collective was called with shapes or a group that do not fit (raised before any comm)."""


# ----------------------------------------------------------------------------- groups
def resolve_group(cp_mesh):
    """ProcessGroup (or None for size 1) behind ``cp_mesh``: a 1-D DeviceMesh, a group, or None."""
    if cp_mesh is None:
        return None
    if isinstance(cp_mesh, DeviceMesh):
        if cp_mesh.ndim != 1:
            raise CPCollectiveError(
                f"CP collectives need a 1-D DeviceMesh, got a {cp_mesh.ndim}-D mesh with dims "
                f"{cp_mesh.mesh_dim_names}: pass mesh[dim_name] or its cached group"
            )
        return cp_mesh.get_group()
    if isinstance(cp_mesh, dist.ProcessGroup):
        return cp_mesh
    raise CPCollectiveError(
        f"expected a 1-D DeviceMesh, a ProcessGroup or None for the CP group, got {type(cp_mesh).__name__}"
    )


def group_desc(group) -> str:
    """Human-readable ``group(size=W, ranks=[...])`` for error messages (no communication)."""
    if group is None:
        return "group(size=1)"
    try:
        ranks = dist.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001 - description only
        ranks = "?"
    return f"group(size={P.group_size(group)}, ranks={ranks})"


def _check_dim(x: torch.Tensor, dim: int, what: str, fn: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise CPCollectiveError(f"{fn}: {what} must be a tensor, got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise CPCollectiveError(f"{fn}: {what} has shape {tuple(x.shape)}, no dim {dim}")
    return dim % x.dim()


def _check_divisible(x: torch.Tensor, dim: int, world: int, what: str, dim_name: str, group, fn: str):
    if x.shape[dim] % world:
        raise CPCollectiveError(
            f"{fn}: {what} {dim_name} dim {dim} of size {x.shape[dim]} (shape {tuple(x.shape)}) is not "
            f"divisible by the size {world} of {group_desc(group)}"
        )


# ----------------------------------------------------------------------------- autograd functions
class _AllGather(torch.autograd.Function):
    """fwd: AllGather along ``dim``; bwd: ReduceScatter(sum) of the gathered gradient."""

    @staticmethod
    def forward(ctx, x, group, dim, tag):
        ctx.group, ctx.dim, ctx.tag = group, dim, tag
        return P.all_gather(x, group, dim=dim, tag=tag)

    @staticmethod
    def backward(ctx, grad):
        return P.reduce_scatter(grad, ctx.group, dim=ctx.dim, tag=ctx.tag + ".bwd"), None, None, None


class _KVAllGather(torch.autograd.Function):
    """fwd: AllGather K and V (both launched before either is waited); bwd: two ReduceScatters."""

    @staticmethod
    def gather(k, v, group, dim, tag="cp.allgather"):
        hk = P.all_gather(k, group, dim=dim, async_op=True, tag=tag + "_k")
        hv = P.all_gather(v, group, dim=dim, async_op=True, tag=tag + "_v")
        return hk.wait(), hv.wait()

    @staticmethod
    def forward(ctx, k, v, group, dim):
        ctx.group, ctx.dim = group, dim
        return _KVAllGather.gather(k, v, group, dim)

    @staticmethod
    def backward(ctx, gk, gv):
        hk = P.reduce_scatter(gk.contiguous(), ctx.group, dim=ctx.dim, async_op=True,
                              tag="cp.allgather_k.bwd")
        hv = P.reduce_scatter(gv.contiguous(), ctx.group, dim=ctx.dim, async_op=True,
                              tag="cp.allgather_v.bwd")
        return hk.wait(), hv.wait(), None, None


class _AllToAll(torch.autograd.Function):
    """fwd: all_to_all(scatter_dim -> gather_dim); bwd: all_to_all(gather_dim -> scatter_dim).

    The all-to-all is a permutation of equal chunks, so its adjoint is its inverse: split the
    gradient along ``gather_dim`` and reassemble along ``scatter_dim``.
    """

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim, tag):
        ctx.group, ctx.sd, ctx.gd, ctx.tag = group, scatter_dim, gather_dim, tag
        return P.all_to_all(x, group, scatter_dim=scatter_dim, gather_dim=gather_dim, tag=tag)

    @staticmethod
    def backward(ctx, grad):
        out = P.all_to_all(grad, ctx.group, scatter_dim=ctx.gd, gather_dim=ctx.sd, tag=ctx.tag + ".bwd")
        return out, None, None, None, None


class _AllToAllUneven(torch.autograd.Function):
    """fwd: sparse piece permutation (``send_counts`` -> ``recv_counts``); bwd: the inverse
    permutation of the gradient (counts swapped)."""

    @staticmethod
    def forward(ctx, x, group, send_counts, recv_counts, dim, tag):
        ctx.args = (group, recv_counts, send_counts, dim, tag + ".bwd")
        return P.all_to_all_uneven(x, group, send_counts, recv_counts, dim, tag=tag)

    @staticmethod
    def backward(ctx, grad):
        group, send, recv, dim, tag = ctx.args
        return P.all_to_all_uneven(grad.contiguous(), group, send, recv, dim, tag=tag), None, None, None, None, None


# ----------------------------------------------------------------------------- Colossal
def _check_kv_pair(k: torch.Tensor, v: torch.Tensor, cp_dim: int, fn: str) -> int:
    """The normalized ``cp_dim`` of a K/V pair that agrees in shape up to it (v's head dim may differ)."""
    dk = _check_dim(k, cp_dim, "k", fn)
    dv = _check_dim(v, cp_dim, "v", fn)
    if k.dim() != v.dim() or dk != dv or k.shape[:dk + 1] != v.shape[:dv + 1]:
        raise CPCollectiveError(
            f"{fn}: k {tuple(k.shape)} and v {tuple(v.shape)} must agree up to cp_dim {cp_dim}"
        )
    return dk


class _Regather:
    """What the attention's autograd node keeps instead of a gathered K or V (see
    :func:`regather_saved_kv`): this rank's local K and V, their versions, and the no-grad
    re-run of the exchange that produced the gathered pair (``run``; or ``launch``, which starts it
    and returns an object whose ``wait()`` gives the pair — then :meth:`prefetch` can start it
    early). ``refs[i]``: how many saved tensors (the gathered tensor or views of it) the node
    packed for K (0) / V (1); ``geometry[i]``: the gathered tensor's shape, strides, dtype and
    device, which the re-run reproduces (checked). ``hold``: set when the context closes with K or
    V not packed at all (a backend that saved a copy of it): the packed gathered tensors are then
    kept and nothing is exchanged — an exchange must happen on every rank of the group or on none,
    and a pair with half its saves elsewhere would re-gather for nothing. ``then``: a weak
    reference to the state whose exchange to start once this one has run (async prefetch)."""

    __slots__ = ("local", "versions", "run", "launch", "pending", "left", "refs", "geometry", "handle",
                 "then", "hold", "__weakref__")

    def __init__(self, local, run, gathered, launch=None):
        self.local, self.run, self.launch = local, run, launch
        self.versions = tuple(t._version for t in local)
        self.pending: list | None = None
        self.left: list | None = None
        self.refs = [0, 0]
        self.geometry = tuple((tuple(g.shape), g.stride(), g.dtype, g.device) for g in gathered)
        self.handle = None
        self.then = None
        self.hold: tuple | None = None

    def __del__(self):
        # a prefetched exchange whose graph is freed unread (a forward kept but never backpropagated):
        # every rank issued it, so it completes; wait it so that no handle is left pending
        handle = getattr(self, "handle", None)
        if handle is not None:
            try:
                handle.wait()
            except Exception:  # noqa: BLE001 - nothing to report it to at collection time
                pass

    def finish(self, gathered) -> None:
        """At the context's exit: keep the packed gathered tensors when K or V was not packed."""
        if not all(self.refs):
            self.hold = tuple(g if r else None for g, r in zip(gathered, self.refs))
            self.local = ()

    def _check_versions(self) -> None:
        if tuple(t._version for t in self.local) != self.versions:
            raise RuntimeError(
                "regathered K/V: the local key or value shard was modified in place after the "
                "attention's forward, so re-gathering it in backward would use other values; do not "
                "write into key/value states after attention (or use activation checkpointing)")

    def prefetch(self) -> None:
        """Start the exchange now (``launch`` only; no-op once it was started or read — a prefetch
        must be consumed, so a second backward exchanges on demand — or when the pair is held: its
        context closed with K or V unpacked, see :meth:`finish`)."""
        if (self.launch is None or self.hold is not None or self.pending is not None
                or self.handle is not None or self.left is not None):
            return
        self._check_versions()
        self.handle = self.launch(*self.local)

    def get(self, which: int) -> torch.Tensor:
        """The gathered K (0) or V (1). One exchange brings both; they are kept until every saved
        tensor packed from them has been unpacked, then dropped. An unpack that finds its slot
        empty (a second backward) exchanges again — the same calls on every rank, in autograd's order."""
        if self.hold is not None:
            return self.hold[which]
        if self.pending is None or self.pending[which] is None:
            if self.handle is None:
                self._check_versions()
            with torch.no_grad():
                got = self.handle.wait() if self.handle is not None else self.run(*self.local)
            self.handle = None
            for i, g in enumerate(got):
                geo = (tuple(g.shape), g.stride(), g.dtype, g.device)
                if geo != self.geometry[i]:
                    raise RuntimeError(f"regathered K/V: the re-run exchange gave shape, stride, dtype, device "
                                       f"{geo}, the forward's was {self.geometry[i]}")
            self.pending, self.left = list(got), list(self.refs)
            nxt = self.then() if self.then is not None else None
            if nxt is not None:
                nxt.prefetch()
        out = self.pending[which]
        self.left[which] -= 1
        if self.left[which] <= 0:
            self.pending[which] = None
            if all(x is None for x in self.pending):
                self.pending = None
        return out


class _RegatherHooks(torch.autograd.graph.saved_tensors_hooks):
    """The saved-tensor hooks of :func:`regather_saved_kv`; on exit the state learns what was packed."""

    def __init__(self, pack, unpack, state: _Regather, gathered: tuple):
        super().__init__(pack, unpack)
        self._state, self._gathered = state, gathered

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._state.finish(self._gathered)
        self._gathered = None


#: the last :class:`_Regather` created in ``launch`` mode (weak): the next one prefetches it in backward
_LAST_LAUNCH_STATE = None


class _Kept:
    """Any other saved tensor under :func:`regather_saved_kv`: a detached alias and its version,
    checked when backward reads it (autograd skips its own in-place check for hooked tensors)."""

    __slots__ = ("t", "version")

    def __init__(self, t):
        self.t, self.version = t.detach(), t._version

    def get(self) -> torch.Tensor:
        if self.t._version != self.version:
            raise RuntimeError(
                f"one of the tensors the CP attention saved for backward (shape {tuple(self.t.shape)}) was "
                f"modified by an in-place operation after the forward (version {self.t._version}, saved at "
                f"{self.version}); its gradient would be wrong")
        return self.t


def _hooks_free() -> bool:
    """No saved-tensor hooks in force, hooks allowed, and no compiler tracing this call."""
    ag = torch._C._autograd
    if not ag._saved_tensors_hooks_is_enabled() or ag._top_saved_tensors_default_hooks(True) is not None:
        return False
    compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return not (callable(compiling) and compiling())


def regather_saved_kv(local: tuple, gathered: tuple, run=None, *, launch=None, state_out: list | None = None):
    """Context manager: autograd saves the gathered ``(k_all, v_all)`` — or views of them, e.g. the
    causal key prefixes Head-Tail passes — as the local ``(k, v)``, and ``run(k, v)`` (a no-grad
    re-run of the exchange, bitwise the same result) brings them back when backward reads them.
    Between forward and backward a rank then holds the local shards (``1/C`` of the gathered size;
    in a model nothing else saves the post-RoPE K/V) instead of the gathered tensors: ``(C-1)/C`` of
    them saved. Backward issues one more exchange (tags ``*.regather_k`` / ``*.regather_v``), in
    the same order on every rank (autograd's); it is kept until every saved tensor packed from it
    has been read, so several engine calls on one gathered pair share one exchange.

    ``launch`` instead of ``run`` (the async methods): ``launch(k, v)`` starts the exchange on the
    platform's communication thread and returns an object whose ``wait()`` gives the pair. Each
    such pair links to the one created before it (weakly): when backward reads a pair, the exchange
    of the pair created just before it — the next one backward reads: the previous K/V chunk, the
    previous layer — starts at once and travels while this pair's attention backward and the rest
    of the layer's backward compute. ``state_out`` (a list) receives the state (tests).

    Every rank of the exchange's group must make the same saves: the exchange runs when backward
    reads a packed tensor. When the engine call packs only one of K and V (the other was saved as a
    copy), the packed gathered tensors are kept and nothing is exchanged (no saving, no collective).
    A gathered tensor modified in place before the engine saved it is kept as is (the re-run would
    give the values before the write).

    Active only where it can act: with grad enabled, no other saved-tensor hooks in force
    (activation checkpointing and offloading install their own and already drop these tensors;
    nested hooks would override theirs for the whole attention), hooks not disabled, and not
    under compiler tracing. Every other saved tensor is kept as a detached alias whose version is
    checked in backward, as autograd would (returning the tensor itself would tie the attention's
    outputs to their own graph node in a reference cycle);
    a backend that saves a copy instead of the gathered tensor itself simply keeps that copy
    (same numbers, no saving).
    """
    import contextlib

    if launch is not None and run is None:
        def run(k, v):
            return launch(k, v).wait()
    if not torch.is_grad_enabled() or gathered[0] is local[0] or not _hooks_free():
        return contextlib.nullcontext()

    # a contiguous gathered tensor is one memory range: any saved tensor inside it is a view of it;
    # a strided one (some exchanges return a permuted buffer) is matched only as itself
    global _LAST_LAUNCH_STATE
    spans = []
    for g in gathered:
        spans.append((g.untyped_storage().data_ptr(), g.storage_offset(), g.storage_offset() + g.numel(),
                      g.dtype, g.device, g.is_contiguous(), (g.data_ptr(), tuple(g.shape), g.stride()), g._version))
    state = _Regather(tuple(local), run, gathered, launch=launch)
    if launch is not None:
        state.then, _LAST_LAUNCH_STATE = _LAST_LAUNCH_STATE, weakref.ref(state)
    if state_out is not None:
        state_out.append(state)

    def view_of(t):
        """(index of the gathered tensor ``t`` is, or is a view into; its geometry relative to it)."""
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.numel() == 0:
            return None
        ptr = t.untyped_storage().data_ptr()
        off = t.storage_offset()
        last = off + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        for i, (gp, lo, hi, dtype, dev, contiguous, exact, version) in enumerate(spans):
            if ptr != gp or t.dtype != dtype or t.device != dev or t._version != version:
                continue
            if (t.data_ptr(), tuple(t.shape), t.stride()) == exact:
                return i, (exact[1], exact[2], 0)
            if contiguous and lo <= off and last < hi and all(s >= 0 for s in t.stride()):
                return i, (tuple(t.shape), t.stride(), off - lo)
        return None

    def pack(t):
        hit = view_of(t)
        if hit is None:
            return _Kept(t)
        i, geom = hit
        state.refs[i] += 1
        return (state, i, geom)

    def unpack(x):
        if isinstance(x, _Kept):
            return x.get()
        st, i, (shape, stride, rel) = x
        base = st.get(i)
        if shape == tuple(base.shape) and stride == base.stride() and rel == 0:
            return base
        return base.as_strided(shape, stride, base.storage_offset() + rel)

    return _RegatherHooks(pack, unpack, state, tuple(gathered))


def regather_allgather(cp_dim: int, cp_mesh):
    """The no-grad re-run of :func:`flex_cp_allgather` for :func:`regather_saved_kv`."""
    group = resolve_group(cp_mesh)
    return lambda k, v: _KVAllGather.gather(k, v, group, cp_dim % k.dim(), tag="cp.allgather.regather")


def regather_window_gather(cp_dim: int, cp_mesh, ranges: Sequence[tuple[int, int]]):
    """The no-grad re-run of :func:`flex_cp_window_gather` (same ranges) for :func:`regather_saved_kv`."""
    group = resolve_group(cp_mesh)
    send, recv = _window_counts([tuple(int(x) for x in rg) for rg in ranges], P.group_rank(group))
    return lambda k, v: _KVWindowGather.gather(k, v, group, cp_dim % k.dim(), send, recv,
                                               tag="cp.window_gather.regather")


def flex_cp_allgather(k: torch.Tensor, v: torch.Tensor, cp_dim: int, cp_mesh):
    """Gather the local K/V sequence shards of the CP group into the global sequence.

    ``k`` ``[.., S/C, ..]`` and ``v`` (same shape except possibly the last dim) are this rank's
    contiguous chunk along ``cp_dim``; returns ``(k_global, v_global)`` with ``cp_dim`` of size
    S in group-rank order. Backward: ReduceScatter(sum) — every rank's partial dK/dV (from its
    own queries) is summed and each rank keeps the gradient of its own chunk.
    ``cp_mesh``: 1-D DeviceMesh, ProcessGroup, or None (identity, no collective).
    """
    fn = "flex_cp_allgather"
    group = resolve_group(cp_mesh)
    dk = _check_kv_pair(k, v, cp_dim, fn)
    if P.group_size(group) == 1:
        return k, v
    return _KVAllGather.apply(k, v, group, dk)


def window_chunk_ranges(world: int, local_len: int, window: int, causal: bool = True) -> list[tuple[int, int]]:
    """The contiguous chunk range ``(lo_r, hi_r)`` (inclusive) each rank's queries can see.

    Contiguous layout: rank r holds global indices ``[r*L, (r+1)*L)`` (``L = local_len``). With
    a left sliding window ``w`` (key j visible to query i only if ``i - w < j``; transformers'
    ``sliding_window``), the earliest key any query of chunk r sees is ``r*L - w + 1``, so
    ``lo_r = max(0, r - ceil((w - 1) / L))``; ``hi_r = r`` when ``causal`` (keys after the last
    query are invisible), else ``world - 1`` (the window is left-only). Pure arithmetic on
    values every rank shares (no communication); docs/padding are not used to trim further.
    """
    for name, val in (("world", world), ("local_len", local_len), ("window", window)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise CPCollectiveError(f"window_chunk_ranges: {name} must be an int >= 1, got {val!r}")
    back = -(-(window - 1) // local_len)          # ceil((w - 1) / L): previous chunks reached
    return [(max(0, r - back), r if causal else world - 1) for r in range(world)]


def _window_counts(ranges, me: int):
    world = len(ranges)
    send = [1 if lo <= me <= hi else 0 for lo, hi in ranges]
    lo, hi = ranges[me]
    recv = [1 if lo <= s <= hi else 0 for s in range(world)]
    return send, recv


class _KVWindowGather(torch.autograd.Function):
    """fwd: one uneven all_to_all per tensor (K and V both launched before either is waited):
    this rank's chunk goes to every rank whose range contains it, and rank r receives its range
    in source order. bwd: the inverse exchange of dK/dV; the copies of this rank's chunk that
    came back (one per receiver, itself included) are summed."""

    @staticmethod
    def gather(k, v, group, dim, send, recv, tag="cp.window_gather"):
        n = sum(send)
        hk = P.all_to_all_uneven(torch.cat([k] * n, dim=dim), group, send, recv, dim, async_op=True,
                                 tag=tag + "_k")
        hv = P.all_to_all_uneven(torch.cat([v] * n, dim=dim), group, send, recv, dim, async_op=True,
                                 tag=tag + "_v")
        return hk.wait(), hv.wait()

    @staticmethod
    def forward(ctx, k, v, group, dim, send, recv):
        ctx.group, ctx.dim, ctx.send, ctx.recv = group, dim, send, recv
        return _KVWindowGather.gather(k, v, group, dim, send, recv)

    @staticmethod
    def backward(ctx, gk, gv):
        g, d, send, recv = ctx.group, ctx.dim, ctx.send, ctx.recv
        hk = P.all_to_all_uneven(gk.contiguous(), g, recv, send, d, async_op=True, tag="cp.window_gather_k.bwd")
        hv = P.all_to_all_uneven(gv.contiguous(), g, recv, send, d, async_op=True, tag="cp.window_gather_v.bwd")
        n = sum(send)
        dk = torch.stack(hk.wait().chunk(n, dim=d), 0).sum(0)
        dv = torch.stack(hv.wait().chunk(n, dim=d), 0).sum(0)
        return dk, dv, None, None, None, None


def flex_cp_window_gather(k: torch.Tensor, v: torch.Tensor, cp_dim: int, cp_mesh,
                          ranges: Sequence[tuple[int, int]]):
    """Gather only the K/V chunks a rank can see: rank r gets chunks ``ranges[r] = (lo, hi)``.

    ``k`` ``[.., L, ..]`` / ``v`` (same shape up to ``cp_dim``) are this rank's contiguous chunk
    along ``cp_dim``; ``ranges`` (one inclusive ``(lo, hi)`` per group rank, identical on every
    rank, e.g. :func:`window_chunk_ranges`; each must contain its own rank) says which chunks each
    rank receives. Returns ``(k_vis, v_vis)`` ``[.., (hi-lo+1)*L, ..]`` = global indices
    ``[lo*L, (hi+1)*L)`` in order: bit-identical to that slice of :func:`flex_cp_allgather`'s
    output. One uneven all_to_all per tensor on the group (``platform.all_to_all_uneven``:
    gloo, NCCL, HCCL); a rank sends its chunk only to the ranks whose range contains it.
    When every range is the rank alone (window 1), nothing is communicated.
    Backward: the gradient of each received chunk goes back to its owner, which sums the
    copies from every receiver (itself included) — the sum a ReduceScatter of the full
    gather would give, restricted to the ranks that can see the chunk.
    """
    fn = "flex_cp_window_gather"
    group = resolve_group(cp_mesh)
    dk = _check_kv_pair(k, v, cp_dim, fn)
    world, me = P.group_size(group), P.group_rank(group)
    ranges = [tuple(int(x) for x in rg) for rg in ranges]
    if len(ranges) != world or any(not (0 <= lo <= r <= hi < world) for r, (lo, hi) in enumerate(ranges)):
        raise CPCollectiveError(
            f"{fn}: ranges must give one (lo, hi) per rank of {group_desc(group)} with lo <= rank <= hi, "
            f"got {ranges}"
        )
    if all(lo == hi for lo, hi in ranges):           # every rank sees only its own chunk
        return k, v
    send, recv = _window_counts(ranges, me)
    return _KVWindowGather.apply(k, v, group, dk, send, recv)


def all_gather_seq(x: torch.Tensor, cp_mesh, dim: int = 1, tag: str = "cp.allgather") -> torch.Tensor:
    """Differentiable AllGather of one tensor along ``dim`` (bwd: ReduceScatter sum)."""
    group = resolve_group(cp_mesh)
    d = _check_dim(x, dim, "x", "all_gather_seq")
    if P.group_size(group) == 1:
        return x
    return _AllGather.apply(x, group, d, tag)


# ----------------------------------------------------------------------------- Ulysses
def _check_heads(heads, world: int, num_heads: int, fn: str, group, cover: bool) -> list:
    """``heads`` as a list of ``world`` tuples of head indices in ``[0, num_heads)`` (each non-empty);
    ``cover``: disjoint and covering every head (the query / output split)."""
    try:
        heads = [tuple(int(h) for h in hs) for hs in heads]
    except TypeError:
        raise CPCollectiveError(f"{fn}: heads must be one sequence of head indices per rank, got {heads!r}") from None
    bad = len(heads) != world or any(not hs or any(not 0 <= h < num_heads for h in hs) for hs in heads)
    if not bad and cover:
        bad = sorted(h for hs in heads for h in hs) != list(range(num_heads))
    if bad:
        raise CPCollectiveError(
            f"{fn}: heads={heads} must give each of the {world} ranks of {group_desc(group)} a non-empty set of "
            f"head indices in [0, {num_heads})" + (", disjoint and covering every head" if cover else ""))
    return heads


def _heads_to_ranks(x: torch.Tensor, group, heads, tag: str) -> torch.Tensor:
    """``x`` ``[H, L, *]`` (all heads, this rank's chunk) -> ``[n_me, W*L, *]`` (heads ``heads[me]``,
    the group's whole sequence): one uneven all_to_all; rank j receives ``heads[j]`` from everyone."""
    world, me = P.group_size(group), P.group_rank(group)
    idx = torch.tensor([h for hs in heads for h in hs], dtype=torch.long, device=x.device)
    n_me, L = len(heads[me]), x.shape[1]
    got = P.all_to_all_uneven(x.index_select(0, idx), group, [len(hs) for hs in heads], [n_me] * world, 0,
                              tag=tag)                                         # [W*n_me, L, *] source-major
    got = got.reshape((world, n_me) + tuple(got.shape[1:])).transpose(0, 1)   # [n_me, W, L, *]
    return got.reshape((n_me, world * L) + tuple(got.shape[3:]))


def _ranks_to_heads(y: torch.Tensor, group, heads, num_heads: int, tag: str) -> torch.Tensor:
    """Adjoint of :func:`_heads_to_ranks`: ``y`` ``[n_me, W*L, *]`` -> ``[H, L, *]``; the pieces of a
    head that several ranks hold are summed (for disjoint ``heads`` this is the inverse permutation)."""
    world, me = P.group_size(group), P.group_rank(group)
    n_me = len(heads[me])
    L = y.shape[1] // world
    rest = tuple(y.shape[2:])
    x = y.reshape((n_me, world, L) + rest).transpose(0, 1).reshape((world * n_me, L) + rest)
    got = P.all_to_all_uneven(x.contiguous(), group, [n_me] * world, [len(hs) for hs in heads], 0, tag=tag)
    flat = [h for hs in heads for h in hs]
    if flat == list(range(num_heads)):
        return got
    idx = torch.tensor(flat, dtype=torch.long, device=got.device)
    return got.new_zeros((num_heads, L) + rest).index_add_(0, idx, got)


class _HeadExchange(torch.autograd.Function):
    """fwd ``to_ranks``: :func:`_heads_to_ranks` (seq -> head, heads may repeat over ranks), else
    :func:`_ranks_to_heads` (head -> seq); bwd: the other one (sums the gradients of repeated heads)."""

    @staticmethod
    def forward(ctx, x, group, heads, num_heads, to_ranks, tag):
        ctx.args = (group, heads, num_heads, to_ranks, tag + ".bwd")
        if to_ranks:
            return _heads_to_ranks(x, group, heads, tag)
        return _ranks_to_heads(x, group, heads, num_heads, tag)

    @staticmethod
    def backward(ctx, grad):
        group, heads, num_heads, to_ranks, tag = ctx.args
        grad = grad.contiguous()
        out = _ranks_to_heads(grad, group, heads, num_heads, tag) if to_ranks \
            else _heads_to_ranks(grad, group, heads, tag)
        return out, None, None, None, None, None


def _even_heads(heads, num_heads: int, world: int) -> bool:
    n = num_heads // world
    return num_heads % world == 0 and [tuple(h) for h in heads] == [tuple(range(i * n, (i + 1) * n))
                                                                      for i in range(world)]


def ulysses_seq_to_head(x: torch.Tensor, group, *, seq_dim: int = 2, head_dim: int = 1,
                        tag: str = "cp.ulysses_s2h", heads=None) -> torch.Tensor:
    """Sequence shard -> head shard on ``group`` (size W).

    ``[B, H, S/W, D]`` (this rank's sequence chunk, all heads) ->
    ``[B, H/W, S, D]`` (heads ``[i*H/W, (i+1)*H/W)`` for group rank i, the group's full sequence
    in rank order). Backward: :func:`ulysses_head_to_seq` of the gradient. Requires H % W == 0.

    ``heads`` (one sequence of head indices per group rank, identical on every rank; e.g.
    :attr:`~.strategies.ulysses_layout.UlyssesHeadLayout.q_heads` / ``kv_heads``): rank i gets
    ``[B, len(heads[i]), S, D]``, heads ``heads[i]`` in that order — uneven counts, and a head
    may go to several ranks (replicated GQA/MQA KV heads: each rank that needs it receives one
    copy, nobody else). One uneven all_to_all (``platform.all_to_all_uneven``). Backward: the
    inverse exchange, and the gradients of a head's copies are **summed** into that head on the
    rank owning the chunk. The even split takes the plain all_to_all.
    """
    fn = "ulysses_seq_to_head"
    group = resolve_group(group)
    sd, hd = _check_dim(x, seq_dim, "x", fn), _check_dim(x, head_dim, "x", fn)
    world = P.group_size(group)
    if heads is not None:
        heads = _check_heads(heads, world, x.shape[hd], fn, group, cover=False)
        if not _even_heads(heads, x.shape[hd], world):
            y = _HeadExchange.apply(x.movedim((hd, sd), (0, 1)), group, heads, x.shape[hd], True, tag)
            return y.movedim((0, 1), (hd, sd))
    if world == 1:
        return x
    _check_divisible(x, hd, world, "x", "head", group, fn)
    return _AllToAll.apply(x, group, hd, sd, tag)


def ulysses_head_to_seq(x: torch.Tensor, group, *, seq_dim: int = 2, head_dim: int = 1,
                        tag: str = "cp.ulysses_h2s", heads=None, num_heads=None) -> torch.Tensor:
    """Head shard -> sequence shard on ``group`` (inverse of :func:`ulysses_seq_to_head`).

    ``[B, H/W, S, D]`` -> ``[B, H, S/W, D]``. Backward: :func:`ulysses_seq_to_head`. Requires S % W == 0.
    ``heads``: the query split of :func:`ulysses_seq_to_head` (disjoint, covering every head,
    possibly uneven): rank i holds heads ``heads[i]``; the result has all ``H`` heads in order.
    With ``num_heads`` given, ``heads`` may overlap (the replicated KV split): the pieces of a
    head that several ranks hold are **summed** — the adjoint of the replicating
    :func:`ulysses_seq_to_head`, i.e. what a hand-written backward of the K/V exchange (the
    async wrappers) returns as dK/dV.
    """
    fn = "ulysses_head_to_seq"
    group = resolve_group(group)
    sd, hd = _check_dim(x, seq_dim, "x", fn), _check_dim(x, head_dim, "x", fn)
    world = P.group_size(group)
    if heads is not None:
        num = sum(len(h) for h in heads) if num_heads is None else int(num_heads)
        heads = _check_heads(heads, world, num, fn, group, cover=num_heads is None)
        me = P.group_rank(group)
        if x.shape[hd] != len(heads[me]):
            raise CPCollectiveError(f"{fn}: x has {x.shape[hd]} heads (shape {tuple(x.shape)}) but heads[{me}] "
                                    f"gives this rank {len(heads[me])}")
        if not _even_heads(heads, num, world):
            _check_divisible(x, sd, world, "x", "sequence", group, fn)
            y = _HeadExchange.apply(x.movedim((hd, sd), (0, 1)), group, heads, num, False, tag)
            return y.movedim((0, 1), (hd, sd))
    if world == 1:
        return x
    _check_divisible(x, sd, world, "x", "sequence", group, fn)
    return _AllToAll.apply(x, group, sd, hd, tag)


# ----------------------------------------------------------------------------- Hybrid
def hybrid_kv_allgather(k: torch.Tensor, v: torch.Tensor, colossal_group, ulysses_group, *,
                        seq_dim: int = 2, head_dim: int = 1, heads=None, regather: bool = False):
    """Hybrid K/V layout transform: Ulysses A2A inside ``ulysses_group`` (size u), then AllGather
    across ``colossal_group`` (size C/u).

    ``[B, Hk, S/C, D]`` -> ``[B, Hk/u, S*u/C, D]`` (chunk colossal_idx of C/u, head slice
    ulysses_idx) -> ``[B, Hk/u, S, D]``. Backward (by composition): ReduceScatter over the
    colossal group, then the inverse A2A over the ulysses group. Requires Hk % u == 0, unless
    ``heads`` (the KV split of a :class:`~.strategies.ulysses_layout.UlyssesHeadLayout`, see
    :func:`ulysses_seq_to_head`) gives ulysses rank i the KV heads ``heads[i]`` (replicated where
    several ranks need one; backward sums the copies' gradients).
    ``regather=True``: returns ``(k_all, v_all, ctx)`` with ``ctx`` the :func:`regather_saved_kv`
    context for the attention that consumes ``k_all`` / ``v_all`` as they are (it then keeps the
    head-exchanged shards and gathers them again over the colossal group in backward).
    """
    ug = resolve_group(ulysses_group)
    if heads is None:
        for name, t in (("k", k), ("v", v)):       # check both before the first collective
            hd = _check_dim(t, head_dim, name, "hybrid_kv_allgather")
            _check_divisible(t, hd, P.group_size(ug), name, "head", ug, "hybrid_kv_allgather")
    else:
        for name, t in (("k", k), ("v", v)):
            hd = _check_dim(t, head_dim, name, "hybrid_kv_allgather")
            _check_heads(heads, P.group_size(ug), t.shape[hd], "hybrid_kv_allgather", ug, cover=False)
    k_h = ulysses_seq_to_head(k, ulysses_group, seq_dim=seq_dim, head_dim=head_dim, tag="cp.ulysses_s2h_k",
                              heads=heads)
    v_h = ulysses_seq_to_head(v, ulysses_group, seq_dim=seq_dim, head_dim=head_dim, tag="cp.ulysses_s2h_v",
                              heads=heads)
    k_all, v_all = flex_cp_allgather(k_h, v_h, seq_dim, colossal_group)
    if not regather:
        return k_all, v_all
    return k_all, v_all, regather_saved_kv((k_h, v_h), (k_all, v_all), regather_allgather(seq_dim, colossal_group))


# ----------------------------------------------------------------------------- Head-Tail
def head_tail_sub_chunks(rank: int, world: int) -> tuple[int, int]:
    """(head, tail) sub-chunk ids computed by ``rank`` in the 2*world split: (r, 2C-1-r)."""
    return rank, 2 * world - 1 - rank


def _head_tail_owner(sub: int) -> int:
    return sub // 2          # rank r holds sub-chunks 2r and 2r+1 of the contiguous layout


def _head_tail_computer(sub: int, world: int) -> int:
    return sub if sub < world else 2 * world - 1 - sub


def _route(pieces: Sequence[torch.Tensor], ids: Sequence[int], dest_of, want: Sequence[int],
           src_of, group, seq_dim: int, tag: str) -> list[torch.Tensor]:
    """Send sub-chunk ``ids[i]`` (tensor ``pieces[i]``) to rank ``dest_of(id)`` and return the
    sub-chunks ``want`` (each held by ``src_of(id)``), through one differentiable sparse
    all-to-all (``platform.all_to_all_uneven``): each rank moves only the sub-chunks another
    rank needs (at most 2), nothing zero-filled. Backward is the inverse permutation.
    """
    world, me = P.group_size(group), P.group_rank(group)
    by_id = dict(zip(ids, pieces))
    send = [sorted(i for i in ids if dest_of(i) == d) for d in range(world)]
    recv = [sorted(i for i in range(2 * world) if src_of(i) == s and dest_of(i) == me) for s in range(world)]
    x = torch.cat([by_id[i] for d in range(world) for i in send[d]], dim=seq_dim)
    got = _AllToAllUneven.apply(x, group, [len(s) for s in send], [len(r) for r in recv], seq_dim, tag)
    order = [i for r in recv for i in r]
    parts = got.chunk(len(order), dim=seq_dim)
    return [parts[order.index(i)] for i in want]


def head_tail_dispatch(q: torch.Tensor, group, *, seq_dim: int = 2):
    """Head-Tail Q exchange: contiguous local shard -> this rank's (head, tail) sub-chunks.

    With C = group size and the sequence split into 2C sub-chunks, rank r holds sub-chunks
    (2r, 2r+1) on input and returns ``(q_head, q_tail)`` = sub-chunks (r, 2C-1-r), each
    ``[B, H, S/(2C), D]``. One all_to_all on ``group``; backward is the inverse exchange.
    Requires the local sequence length to be even.
    """
    fn = "head_tail_dispatch"
    group = resolve_group(group)
    sd = _check_dim(q, seq_dim, "q", fn)
    world = P.group_size(group)
    if q.shape[sd] % 2:
        raise CPCollectiveError(
            f"{fn}: q sequence dim {sd} of size {q.shape[sd]} must be even (2*cp_size sub-chunks) on "
            f"{group_desc(group)}; shard the batch with policy='load_balance'"
        )
    lo, hi = q.chunk(2, dim=sd)
    if world == 1:
        return lo, hi
    me = P.group_rank(group)
    return tuple(_route([lo, hi], [2 * me, 2 * me + 1], lambda i: _head_tail_computer(i, world),
                        head_tail_sub_chunks(me, world), _head_tail_owner, group, sd,
                        "cp.head_tail_dispatch"))


def head_tail_combine(o_head: torch.Tensor, o_tail: torch.Tensor, group, *, seq_dim: int = 2) -> torch.Tensor:
    """Inverse of :func:`head_tail_dispatch`: (head, tail) outputs -> contiguous local shard.

    ``o_head``/``o_tail`` ``[B, H, S/(2C), D]`` are sub-chunks (r, 2C-1-r); returns
    ``[B, H, S/C, D]`` = sub-chunks (2r, 2r+1). Backward: the dispatch exchange of the gradient.
    """
    fn = "head_tail_combine"
    group = resolve_group(group)
    sd = _check_dim(o_head, seq_dim, "o_head", fn)
    if o_head.shape != o_tail.shape:
        raise CPCollectiveError(f"{fn}: head {tuple(o_head.shape)} and tail {tuple(o_tail.shape)} differ")
    world = P.group_size(group)
    if world == 1:
        return torch.cat([o_head, o_tail], dim=sd)
    me = P.group_rank(group)
    lo, hi = _route([o_head, o_tail], list(head_tail_sub_chunks(me, world)), _head_tail_owner,
                    [2 * me, 2 * me + 1], lambda i: _head_tail_computer(i, world), group, sd,
                    "cp.head_tail_combine")
    return torch.cat([lo, hi], dim=sd)


# ----------------------------------------------------------------------------- replicated sums
class _AllReduceSumReplicated(torch.autograd.Function):
    """fwd: SUM all-reduce; bwd: identity (see :func:`all_reduce_sum_replicated`)."""

    @staticmethod
    def forward(ctx, x, group, tag):
        return P.all_reduce(x, group, op=dist.ReduceOp.SUM, tag=tag)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def all_reduce_sum_replicated(x: torch.Tensor, group, tag: str = "cp.all_reduce_replicated") -> torch.Tensor:
    """Differentiable SUM of per-rank partial sums ``x`` over ``group`` whose result feeds a loss
    that every rank of the group computes **identically** (a replicated loss).

    fwd: ``y = sum_r x_r`` (every rank). bwd: ``dx_r = dy`` (identity, no communication): each
    rank's upstream ``dy`` already is the full derivative of the replicated loss, so the gradient
    of ``x_r`` is exactly ``dy``; the trainer's gradient reduction (SUM / FSDP average with its
    grad_scale) then adds the ranks' parameter contributions once. (A SUM all-reduce in backward
    would count the loss ``group size`` times.) ``group``: a 1-D DeviceMesh, a ProcessGroup or
    None (size 1: identity, no collective).
    """
    if not isinstance(x, torch.Tensor):
        raise CPCollectiveError(f"all_reduce_sum_replicated: x must be a tensor, got {type(x).__name__}")
    group = resolve_group(group)
    if P.group_size(group) == 1:
        return x
    return _AllReduceSumReplicated.apply(x.contiguous(), group, tag)
