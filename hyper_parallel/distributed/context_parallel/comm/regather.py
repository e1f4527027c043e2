"""``regather_saved_kv``: the attention keeps this rank's local K/V instead of the gathered pair
between forward and backward, and backward re-runs the exchange (saved-tensor hooks). Used by the
Colossal, Hybrid and Head-Tail strategies and their async variants. docs/strategies/colossal.md.
"""
from __future__ import annotations

import weakref

import torch


__all__ = ["regather_saved_kv"]


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
