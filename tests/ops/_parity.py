"""Shared parity helpers: run the engine and the float64 reference on the same data, compare.

Every comparison reports ``max_abs`` (max |engine - reference|) and ``rel`` (max_abs divided by
max |reference|, floored at 1) and asserts ``rel <= tol`` for the stated per-dtype tolerance.
The sink gradient is a sum over every (batch, query) row of ``p_sink * (dlse - dout.out)``, terms
that partly cancel; its ``rel`` divides by the sum of those terms' magnitudes (per head, the
largest head; floored at 1), the scale its rounding error grows with.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hyper_parallel.ops import attention, engine_info, reference_attention

# normalized max error allowed vs the float64 reference, per input dtype
TOL = {
    torch.float64: 1e-10,
    torch.float32: 2e-5,
    torch.float16: 5e-3,
    torch.bfloat16: 1.5e-2,
}


@dataclass
class Case:
    B: int = 1
    Hq: int = 4
    Hk: int = 2
    D: int = 64
    q_pos: torch.Tensor = None
    k_pos: torch.Tensor = None
    q_doc: torch.Tensor | None = None
    k_doc: torch.Tensor | None = None
    causal: bool = True
    dtype: torch.dtype = torch.float32
    scale: float | None = None
    with_lse_grad: bool = True
    seed: int = 0
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False  # a random learned sink logit per query head (fp32; fp64 for fp64)
    Dv: int | None = None  # value head dim (None: D)
    kv_group: int | None = None  # query head h reads KV head (h + kv_offset) // kv_group (None: GQA)
    kv_offset: int = 0
    q_block: torch.Tensor | None = None  # bidirectional block ids (-1 = none), shaped like the positions
    k_block: torch.Tensor | None = None


def error(a: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    a, ref = a.double(), ref.double()
    if a.numel() == 0:
        return 0.0, 0.0
    max_abs = (a - ref).abs().max().item()
    return max_abs, max_abs / max(1.0, ref.abs().max().item())


def make_inputs(c: Case):
    g = torch.Generator().manual_seed(c.seed)
    Sq, Sk = c.q_pos.shape[-1], c.k_pos.shape[-1]
    Dv = c.D if c.Dv is None else c.Dv
    q = torch.randn(c.B, c.Hq, Sq, c.D, generator=g, dtype=torch.float64).to(c.dtype)
    k = torch.randn(c.B, c.Hk, Sk, c.D, generator=g, dtype=torch.float64).to(c.dtype)
    v = torch.randn(c.B, c.Hk, Sk, Dv, generator=g, dtype=torch.float64).to(c.dtype)
    dout = torch.randn(c.B, c.Hq, Sq, Dv, generator=g, dtype=torch.float64)
    dlse = torch.randn(c.B, c.Hq, Sq, generator=g, dtype=torch.float64)
    return q, k, v, dout, dlse


def feature_kwargs(c: Case) -> dict:
    """window / softcap / kv head map / sinks keyword arguments of a case (only those that are set)."""
    kw = {}
    if c.window is not None:
        kw["window"] = c.window
    if c.softcap is not None:
        kw["softcap"] = c.softcap
    if c.kv_group is not None:
        kw["kv_group"], kw["kv_offset"] = c.kv_group, c.kv_offset
    if c.q_block is not None:
        kw["q_block"], kw["k_block"] = c.q_block, c.k_block
    if c.sinks:
        g = torch.Generator().manual_seed(c.seed + 1000)
        sd = torch.float64 if c.dtype == torch.float64 else torch.float32  # a parameter's dtype
        kw["sinks"] = (torch.randn(c.Hq, generator=g, dtype=torch.float64) * 2).to(sd)
    return kw


def run_parity(c: Case, label: str = "") -> dict:
    """Forward out/lse and backward dq/dk/dv of the engine vs reference_attention (float64)."""
    q, k, v, dout, dlse = make_inputs(c)
    kw = dict(q_pos=c.q_pos, k_pos=c.k_pos, causal=c.causal, q_doc=c.q_doc, k_doc=c.k_doc,
              scale=c.scale, return_lse=True)
    fkw = feature_kwargs(c)
    sinks = fkw.pop("sinks", None)
    se = sr = None
    if sinks is not None:
        se, sr = sinks.clone().requires_grad_(), sinks.double().requires_grad_()

    qe, ke, ve = (t.clone().requires_grad_() for t in (q, k, v))
    ekw = dict(kw, **fkw, **({"sinks": se} if se is not None else {}))
    out, lse = attention(qe, ke, ve, **ekw)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    rkw = dict(kw, **fkw, **({"sinks": sr} if sr is not None else {}))
    rout, rlse = reference_attention(qr, kr, vr, **rkw)

    finite = torch.isfinite(rlse)
    assert out.dtype == c.dtype and out.shape == dout.shape and out.is_contiguous()
    assert lse.dtype == (torch.float64 if c.dtype == torch.float64 else torch.float32)
    assert torch.equal(torch.isfinite(lse), finite), "engine and reference disagree on empty rows"
    assert torch.all(lse[~finite] == -math.inf)

    def loss(o, l, lse_grad):
        val = (o.double() * dout).sum()
        if lse_grad:
            val = val + (torch.where(finite, l.double(), 0.0) * dlse).sum()
        return val

    loss(out, lse, c.with_lse_grad).backward()
    loss(rout, rlse, c.with_lse_grad).backward()

    tol = TOL[c.dtype]
    errs = {
        "out": error(out, rout),
        "lse": error(lse[finite], rlse[finite]),
        "dq": error(qe.grad, qr.grad),
        "dk": error(ke.grad, kr.grad),
        "dv": error(ve.grad, vr.grad),
    }
    if se is not None:
        with torch.no_grad():
            p_sink = torch.exp(sr.detach()[None, :, None] - rlse.detach())        # [B, Hq, Sq]
            delta = (dout * rout.detach()).sum(-1)
            g_lse = torch.where(finite, dlse, 0.0) if c.with_lse_grad else 0.0
            terms = (p_sink * (g_lse - delta)).abs().sum(dim=(0, 2)).max().item()
        max_abs = (se.grad.double() - sr.grad).abs().max().item()
        errs["dsinks"] = (max_abs, max_abs / max(1.0, terms))
    for t in (out, lse, qe.grad, ke.grad, ve.grad):
        assert not torch.isnan(t).any(), "NaN in engine result"
    line = " ".join(f"{n}: abs={a:.2e} rel={r:.2e}" for n, (a, r) in errs.items())
    print(f"[parity {label} {str(c.dtype).replace('torch.', '')} tol={tol:g}] {line}")
    bad = {n: r for n, (a, r) in errs.items() if not r <= tol}
    assert not bad, f"{label}: errors above tol={tol:g}: {line}"
    return errs


def isa_available(isa: str) -> bool:
    """Whether this CPU and build run the ``isa`` kernels (``base`` always does)."""
    return isa == "base" or f"{isa} cpu=yes" in engine_info()


def use_isa_or_skip(isa: str, monkeypatch) -> None:
    """Force the ``isa`` kernel build for this test (``HYPER_PARALLEL_ATTN_ISA``), or skip it, printing
    and naming what this CPU lacks (every ISA the CPU has is still tested)."""
    import pytest

    if not isa_available(isa):
        reason = f"this CPU lacks {isa} (engine_info: {engine_info()})"
        print(f"[isa={isa}] SKIP: {reason}")
        pytest.skip(reason)
    monkeypatch.setenv("HYPER_PARALLEL_ATTN_ISA", isa)
    assert f"kernels={isa}" in engine_info()
