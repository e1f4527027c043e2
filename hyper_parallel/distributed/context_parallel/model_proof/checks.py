"""One compared checkpoint (:class:`_Check`) and the token map between the CP chunk and the
reference rows (:class:`_Layout`): valid tokens only, relative to ``max|ref|``."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .report import PROOF_TOLERANCE


class _Layout:
    """Maps valid global tokens (row b, position s) to reference tokens (ref row r, position p)."""

    def __init__(self, docs, S: int, lo: int, hi: int, device, slot=None):
        gb, gs, rr, rp = [], [], [], []
        for r, (b, start, length) in enumerate(docs):
            for j in range(length):
                gb.append(b)
                gs.append(start + j)
                rr.append(r)
                rp.append(j)
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        self.gb, self.gs, self.rr, self.rp = t(gb), t(gs), t(rr), t(rp)
        if slot is not None:                      # balanced split: global index -> slot of the permuted row
            self.gs = slot.to(device)[self.gs]
        self.S, self.lo, self.hi = S, lo, hi
        sel = (self.gs >= lo) & (self.gs < hi)
        self.lb, self.ls = self.gb[sel], self.gs[sel] - lo
        self.lr, self.lp = self.rr[sel], self.rp[sel]
        self.R = len(docs)
        self.ref_len = max(length for _b, _s, length in docs)

    def ref_all(self, ref: torch.Tensor) -> torch.Tensor:
        return ref[self.rr, self.rp]

    def ref_local(self, ref: torch.Tensor) -> torch.Tensor:
        return ref[self.lr, self.lp]

    def cp_local(self, cp: torch.Tensor) -> torch.Tensor:
        return cp[self.lb, self.ls]


def _amax(t: torch.Tensor) -> float:
    return float(t.detach().abs().max().item()) if t.numel() else 0.0


def _diff(cp_sel: torch.Tensor, ref_sel: torch.Tensor) -> float:
    if cp_sel.numel() == 0:
        return 0.0
    d = (cp_sel.double() - ref_sel.double()).abs()
    d = torch.nan_to_num(d, nan=float("inf"))
    return float(d.max().item())


@dataclasses.dataclass
class _Check:
    key: str            # "in:<layer>" | "delta:<layer>" | "logits"
    layer: Optional[str]
    diff: float         # this rank's max |cp - ref| on its valid tokens
    scale: float        # max |ref| on every valid token (same on every rank)
    res_scale: float    # max |layer output| (residual rounding term), 0 when not a layer update
    dtype: torch.dtype

    def tol(self) -> float:
        rtol = PROOF_TOLERANCE.get(self.dtype, 1e-4)
        return rtol * self.scale + 0.1 * rtol * self.res_scale + 1e-30

    def rel(self) -> float:
        return self.diff / self.scale if self.scale > 0 else (0.0 if self.diff == 0 else float("inf"))
