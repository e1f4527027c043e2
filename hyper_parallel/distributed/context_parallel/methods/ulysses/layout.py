"""Ulysses head layout: which query and KV heads each rank of a Ulysses group computes.

One place for the head rule of every Ulysses A2A (Pure Ulysses, Hybrid's Ulysses sub-group, the
flex Ulysses wrappers and the async Ulysses/Hybrid wrappers). :func:`ulysses_head_layout`
returns a :class:`UlyssesHeadLayout` for ``(Hq, Hk, degree)`` — the heads a rank computes
(TP-local under TP) — and every Ulysses path communicates and computes from it:

* **query heads**: rank ``i`` of the group gets the contiguous range ``q_ranges[i]`` of query
  heads; the counts differ by at most one (``floor(Hq/u)`` or ``ceil(Hq/u)``), so compute stays
  balanced when ``Hq % u != 0``. Which ranks get the extra head is chosen (dynamic programme
  over the ranks) to minimise the number of KV-head copies below;
* **KV heads**: rank ``i`` gets exactly the KV heads its query heads use (``h // (Hq/Hk)``,
  ``kv_heads[i]``), each **replicated** from its owner — never averaged or merged. A KV head
  that the query heads of several ranks use is sent once to each of those ranks (and only to
  them): that is the fewest copies any layout with these query ranges can send, because each
  of those ranks needs the whole sequence of that head. When ``Hk % u == 0`` (and so
  ``Hq % u == 0``) this is the classic even split (``Hk/u`` disjoint KV heads per rank, no copy);
* **backward**: the inverse exchange returns each copy's gradient to the rank that owns the
  sequence chunk, which sums the copies into the KV head (see
  :func:`.collectives.ulysses_seq_to_head` with ``heads=``);
* **per-head inputs** (sinks) follow their query heads: :meth:`UlyssesHeadLayout.q_slice`.

Exact for every layout with ``Hq % Hk == 0`` and ``Hq >= u``; the only refusal is fewer query
heads than the degree (a rank would compute nothing) — :func:`ulysses_head_layout` names the
numbers and the degrees that work. Pure arithmetic on values every rank shares: no collective.

How a Ulysses path uses it (sync strategies here; the async wrappers must do the same)::

    lay = ulysses_head_layout(Hq, Hk, u, who="MyWrapper")            # at apply time: refusal
    i = group_rank(ulysses_group)
    q_h = ulysses_seq_to_head(q, g, heads=lay.q_heads)                # [B, nq_i, S, D]
    k_h = ulysses_seq_to_head(k, g, heads=lay.kv_heads)               # [B, nk_i, S, D] (replicas)
    v_h = ulysses_seq_to_head(v, g, heads=lay.kv_heads)
    sinks_i = lay.q_slice(sinks, i)
    out_h = engine_attention(q_h, k_h, v_h, ..., sinks=sinks_i, **lay.kv_map_args(i))  # the GQA map
    out = ulysses_head_to_seq(out_h, g, heads=lay.q_heads)            # [B, Hq, S/u, D]

(``heads=None`` when ``lay.even``: the plain all_to_all, as before.) A path that writes its own
backward for these exchanges (the async wrappers' launch/wait chains) must use the adjoints:
dQ ``ulysses_head_to_seq(dq_h, g, heads=lay.q_heads)``, dK/dV
``ulysses_head_to_seq(dk_h, g, heads=lay.kv_heads, num_heads=Hk)`` (sums the copies of a
replicated KV head), dO ``ulysses_seq_to_head(do, g, heads=lay.q_heads)``; Hybrid's colossal
AllGather/ReduceScatter then acts on the ``nk_i``-head shard unchanged.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import torch

__all__ = ["UlyssesHeadLayout", "ulysses_head_layout", "working_degrees"]


@dataclasses.dataclass(frozen=True)
class UlyssesHeadLayout:
    """The head split of one Ulysses group of size ``degree`` (identical on every rank).

    ``q_ranges[i] = (start, stop)``: query heads of group rank ``i``; ``kv_heads[i]``: the KV
    heads (sorted, global KV-head indices) its query heads use. ``q_heads`` / ``kv_heads`` are
    what the ``heads=`` argument of the Ulysses collectives takes.
    """

    num_q_heads: int
    num_kv_heads: int
    degree: int
    q_ranges: tuple
    kv_heads: tuple

    # -- counts ---------------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        """Query heads per KV head (``Hq // Hk``)."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def q_heads(self) -> tuple:
        """Per group rank, the query-head indices it computes (contiguous, disjoint, cover all)."""
        return tuple(tuple(range(a, b)) for a, b in self.q_ranges)

    @property
    def q_counts(self) -> tuple:
        return tuple(b - a for a, b in self.q_ranges)

    @property
    def kv_counts(self) -> tuple:
        return tuple(len(h) for h in self.kv_heads)

    @property
    def kv_copies(self) -> int:
        """KV heads received over the group in total (each head counted once per receiving rank)."""
        return sum(self.kv_counts)

    @property
    def even(self) -> bool:
        """The classic Ulysses split: equal query counts and a disjoint, equal KV split (no copy)."""
        return len(set(self.q_counts)) == 1 and self.kv_copies == self.num_kv_heads \
            and len(set(self.kv_counts)) == 1

    @property
    def replicated(self) -> bool:
        """Some KV head is sent to more than one rank."""
        return self.kv_copies > self.num_kv_heads

    # -- per rank -------------------------------------------------------------------------
    def q_slice(self, x: Optional[torch.Tensor], rank: int, dim: int = 0):
        """Rank ``rank``'s query heads of a per-head input (sinks ``[Hq]``) along ``dim``; None stays None."""
        if x is None:
            return None
        a, b = self.q_ranges[rank]
        return x.narrow(dim, a, b - a)

    def kv_map_args(self, rank: int) -> dict:
        """The engine's query-head -> KV-head map for ``rank`` (keywords of
        :func:`hyper_parallel.ops.attention`): ``{}`` when the engine's own GQA grouping (local
        query ``h`` -> local KV ``h // (nq/nk)``) is right, else ``{"kv_group": Hq/Hk, "kv_offset":
        a % (Hq/Hk)}`` for a rank whose query range ``[a, b)`` starts or ends inside a KV group
        (e.g. 3 query heads over 2 KV heads): the engine reads the received KV heads in place
        (local KV index ``(h + a % g) // g``) and sums each KV head's gradient over its query heads —
        no per-query-head copy of K/V, so what the engine saves for backward is the received
        (Hybrid: the gathered) K/V itself, which the Colossal regather can free."""
        a, b = self.q_ranges[rank]
        g = self.group_size
        nq, nk = b - a, len(self.kv_heads[rank])
        if nq % nk == 0 and all((a + h) // g - a // g == h // (nq // nk) for h in range(nq)):
            return {}          # the engine's plain GQA grouping already is this map
        return {"kv_group": g, "kv_offset": a % g}

    def describe(self) -> str:
        """One line for plan summaries: per-rank query / KV heads and the KV copies sent."""
        what = "even" if self.even else ("KV replicated" if self.replicated else "uneven")
        kv = "; ".join(",".join(map(str, h)) for h in self.kv_heads)
        return (f"ulysses heads (Hq={self.num_q_heads}, Hk={self.num_kv_heads}, degree={self.degree}, {what}): "
                f"q per rank {list(self.q_counts)}, kv per rank {list(self.kv_counts)} [{kv}], "
                f"{self.kv_copies} KV-head copies for {self.num_kv_heads} KV heads")


def working_degrees(num_q_heads: int, candidates: Sequence[int]) -> list:
    """The ``candidates`` a Ulysses layout accepts for ``num_q_heads`` query heads (``<= Hq``)."""
    return [d for d in candidates if 1 <= d <= num_q_heads]


def _touched(a: int, n: int, g: int) -> int:
    """KV groups (of ``g`` query heads) touched by query heads ``[a, a+n)``."""
    return (a + n - 1) // g - a // g + 1


@functools.lru_cache(maxsize=256)
def _solve(hq: int, hk: int, u: int) -> tuple:
    """Query counts per rank (each floor or ceil of hq/u, contiguous ranges) minimising
    (total KV copies, max KV heads on one rank); ties keep the extra heads on the lowest ranks."""
    g, lo, extra = hq // hk, hq // u, hq % u
    # best[(r, e)]: best (copies, max_kv, counts) for ranks r.. given e extra heads used by ranks < r
    memo: dict = {}

    def best(r: int, e: int):
        if r == u:
            return (0, 0, ()) if e == extra else None
        key = (r, e)
        if key in memo:
            return memo[key]
        a = r * lo + e
        out = None
        for take in ((1, 0) if extra else (0,)):
            if e + take > extra or (extra - e - take) > (u - r - 1):
                continue
            rest = best(r + 1, e + take)
            if rest is None:
                continue
            n = lo + take
            t = _touched(a, n, g)
            cand = (rest[0] + t, max(rest[1], t), (n,) + rest[2])
            if out is None or cand[:2] < out[:2]:
                out = cand
        memo[key] = out
        return out

    return best(0, 0)[2]


def ulysses_head_layout(num_q_heads: int, num_kv_heads: int, degree: int, *, who: str = "Ulysses",
                        what: str = "ulysses_degree", cp_size: Optional[int] = None) -> UlyssesHeadLayout:
    """The head layout of a Ulysses group of size ``degree`` for these (TP-local) heads.

    Raises ValueError (prefixed ``who``; ``what`` names the degree in the message) when
    ``Hq % Hk != 0`` (not GQA) or ``Hq < degree`` (a rank would get no query head): the message
    names the numbers and the degrees that work (divisors of ``cp_size`` when given, as Hybrid
    needs). Every other layout is accepted: uneven counts, KV heads fewer than the degree
    (replicated), MQA. Cached; no collective.
    """
    hq, hk, u = int(num_q_heads), int(num_kv_heads), int(degree)
    if hq < 1 or hk < 1 or hq % hk:
        raise ValueError(f"{who}: num_q_heads={hq} must be a positive multiple of num_kv_heads={hk} (GQA groups)")
    if u < 1:
        raise ValueError(f"{who}: {what}={u} must be >= 1")
    if hq < u:
        if cp_size is not None:
            ok = [d for d in range(2, cp_size) if cp_size % d == 0 and d <= hq]
            fix = (f"ulysses_degree in {ok} (Hybrid) or the colossal method" if ok
                   else "the colossal (AllGather) or load_balance method")
        else:
            fix = f"a Ulysses degree <= {hq} (Hybrid with a smaller ulysses_degree) or the colossal method"
        raise ValueError(
            f"{who}: num_q_heads={hq} < {what}={u} (num_kv_heads={hk}): every Ulysses rank needs at least one "
            f"query head, so a head split over {u} ranks does not exist; use {fix}")
    return _build(hq, hk, u)


@functools.lru_cache(maxsize=256)
def _build(hq: int, hk: int, u: int) -> UlyssesHeadLayout:
    """The (valid) layout: contiguous query ranges of :func:`_solve`'s counts, KV heads they use."""
    ranges, a = [], 0
    for n in _solve(hq, hk, u):
        ranges.append((a, a + n))
        a += n
    g = hq // hk
    kv = tuple(tuple(range(s // g, (e - 1) // g + 1)) for s, e in ranges)
    return UlyssesHeadLayout(hq, hk, u, tuple(ranges), kv)
