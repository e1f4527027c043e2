"""Rotary position embeddings under CP: every rank computes them as for the whole sequence.

Contract
--------
A rotary embedding module (``*RotaryEmbedding`` of a transformers model, or any module found
by :func:`find_rotary_modules`) maps ``(x, position_ids, ...)`` to tensors (``cos, sin``)
whose second-to-last dim is the sequence. Several transformers RoPE variants do not depend on
the positions alone but on *the sequence length*, which transformers takes from the positions
it is given (``dynamic_rope_update``): ``L = max(position_ids) + 1`` over the whole batch —
``dynamic`` NTK rescales (and statefully caches) ``inv_freq`` when ``L`` exceeds
``max_position_embeddings``; ``longrope`` switches from the short to the long factors when
``L > original_max_position_embeddings``. Under CP every rank holds a chunk of the global
sequence and would derive its own ``L`` from its own chunk: silently wrong.

During a CP forward (inside ``cp_batch_context(meta)``, ``meta.cp_size > 1``) each rotary
module installed by :func:`install_cp_rope` therefore

1. takes the **global** positions of the batch from the meta (``meta.position_ids``,
   ``[B|1, global_seq_len]``, set by ``shard_batch_for_cp``) and checks that the
   ``position_ids`` the model passed are this rank's slice of them;
2. replaces the positions of the tokens that CP added to reach the policy multiple
   (``meta.seq_len <= index < meta.global_seq_len``, tokens that do not exist at CP=1) with the
   row's last real position, so they change nothing;
3. calls the module's original forward **once on those global positions** — so its length,
   its state (dynamic NTK's cached ``inv_freq`` across steps of different lengths) and its
   output are exactly those of CP=1 — and returns this rank's tokens ``meta.q_index`` (the contiguous
   slice ``[cp_rank * local_seq_len, (cp_rank + 1) * local_seq_len)``, or the balanced split's
   permuted slots) (a copy: the global
   ``cos/sin`` are freed at once).

The other arguments pass through (``x`` stays this rank's hidden states: transformers reads
only its dtype and device). Memory and time: one ``[B|1, S_global, D]`` cos/sin pair per call,
O(S·D); no S×S tensor; when every row holds the same positions the module runs on one row.
Outside a CP forward (no meta, or ``cp_size == 1``) the module runs unchanged.

3-D (multimodal mrope) positions ``[3, B|1, n]`` (Qwen2/2.5/3-VL, Qwen3.5 text models): when the
batch gave 3-D ``position_ids`` (real temporal/height/width ids, rows that differ over vision
spans), ``shard_batch_for_cp`` keeps them global in ``meta.mrope_position_ids`` and the module runs
once on those (:mod:`.rope_mrope`); when the batch gave 1-D ids the model builds text-only 3-D
positions (every row the token's 1-D position), checked row by row against this rank's slice of
``meta.position_ids`` and run on the global positions repeated; 3-D rows that differ without 3-D
ids in the meta are refused (:class:`CPRopeError`). The preflight probes such modules with both:
text-only ``[3, 1, L]`` and multimodal ids (a vision grid inside the probe).

The length that results (identical on every rank and to CP=1 given the same global batch):
``L = 1 + max(position_ids)`` over every row and every real token of the global batch —
padding tokens of the user's batch (``attention_mask == 0``) included, as transformers
includes them, CP's own pad-to-multiple tokens excluded. Packed documents restart their
positions per slot, so ``L`` is the longest document slot (``seq_lens_padded``; or the run of
free tokens after the last slot, which restarts too), exactly what transformers derives at CP=1
from the same packed ``position_ids``.

Preflight (:func:`check_rotary_modules`, run by ``apply_sharding_plan`` before anything is
installed): every rotary module is probed locally (no collective) on a deep copy — at a probe
length beyond the model's original context, then a shorter one beyond it, one inside it and a
long one again (stateful variants must follow CP=1 across steps) — comparing what the CP path
above returns for the first and the last cp shard (the shard's slice of ``x`` and the global
positions) with the slice of the module's output for the whole probe sequence. A module whose
output depends on more than the positions (and the length they declare) — e.g. one that takes
the length or the positions from ``x.shape``, or a forward without ``position_ids`` — differs
or cannot be called, and is refused with a :class:`~hyper_parallel.distributed.errors.CPConfigError`
naming its FQN and the fix. transformers' variants (default, linear, dynamic, yarn, longrope,
llama3, proportional, any ``ROPE_INIT_FUNCTIONS`` entry used through ``dynamic_rope_update``)
pass: their output is a function of the positions only.
"""
from __future__ import annotations

import copy
import functools
import inspect
import itertools
import logging
import re
from typing import Callable, Optional

import torch
import torch.nn as nn

from ..errors import CPConfigError
from .meta import CPBatchMeta, cp_batch_context, current_cp_batch_meta
from .rope_mrope import MROPE_ROWS, mrope_cp_call, mrope_section as _mrope_section, probe_mrope_positions

log = logging.getLogger("hyper_parallel.cp.rope")

__all__ = ["find_rotary_modules", "check_rotary_modules", "install_cp_rope", "CPRopeError",
           "rope_global_length"]

_NAME = re.compile(r"rotary|rope", re.IGNORECASE)
_NOT_ROTARY = re.compile(r"attention|attn", re.IGNORECASE)     # e.g. "...RoPEAttention" is a token mixer
FIELD = "model.config.rope_parameters"
FIX = ("make the module's output a function of position_ids alone, taking the sequence length as "
       "max(position_ids) + 1 (as transformers' @dynamic_rope_update / ROPE_INIT_FUNCTIONS rope types do), "
       "or train this model with accelerator.cp_size=1")
PROBE_TOL = 1e-6          # relative to max |reference| (the CP path is the same computation, usually bitwise)


class CPRopeError(RuntimeError):
    """A CP forward whose positions do not match the CP batch (raised by the installed rotary forward)."""


# ------------------------------------------------------------------------------ discovery
def _is_transformers_rope(module: nn.Module) -> bool:
    fwd = type(module).forward
    return "dynamic_rope_update" in getattr(fwd, "__qualname__", "") or (
        hasattr(module, "rope_type") and hasattr(module, "inv_freq"))


def find_rotary_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Rotary embedding modules of ``model``: transformers RoPE modules (``dynamic_rope_update``
    forward, or ``rope_type`` + ``inv_freq``), any module with an ``inv_freq`` buffer, and any
    module whose class name contains "rotary"/"rope" but not "attention"/"attn" (custom modules).
    A registered VLM's vision tower is left out: it runs per rank on whole images (vision.py)."""
    from .vision import vision_tower

    tower = vision_tower(model)
    found = []
    for fqn, mod in model.named_modules():
        if tower is not None and tower.holds(fqn):
            continue
        name = type(mod).__name__
        if "inv_freq" in getattr(mod, "_buffers", {}) or _is_transformers_rope(mod) or \
                (_NAME.search(name) and not _NOT_ROTARY.search(name)):
            found.append((fqn, mod))
    return found


def _positions_param(module: nn.Module) -> Optional[inspect.Signature]:
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None
    return sig if "position_ids" in sig.parameters else None


# ------------------------------------------------------------------------------ the CP path
def rope_global_length(meta: CPBatchMeta) -> int:
    """``1 + max`` of the meta's global positions over the real tokens (CP padding excluded)."""
    pos = _global_positions(meta, None)
    return int(pos.max()) + 1


def _global_positions(meta: CPBatchMeta, local: Optional[torch.Tensor]) -> torch.Tensor:
    g = getattr(meta, "position_ids", None)
    if g is None:
        raise CPRopeError(
            "the CP batch meta carries no global position_ids, so the rotary embedding cannot be computed for the "
            "whole sequence: build the batch with shard_batch_for_cp (a custom batch_prepare_fn must set "
            "meta.position_ids [B|1, global_seq_len] and meta.seq_len)")
    if g.dim() != 2 or g.shape[-1] != meta.global_seq_len:
        raise CPRopeError(f"meta.position_ids has shape {tuple(g.shape)}, expected [B|1, {meta.global_seq_len}]")
    n_real = meta.seq_len if getattr(meta, "seq_len", None) is not None else meta.global_seq_len
    if n_real < meta.global_seq_len:          # CP's pad-to-multiple tokens: repeat the last real position
        g = torch.cat([g[:, :n_real], g[:, n_real - 1:n_real].expand(-1, meta.global_seq_len - n_real)], dim=1)
    if local is not None:
        g = g.to(local.device)
    return g


def _slice_outputs(out, sel, total: int, rows: Optional[int], fqn: str):
    if isinstance(out, torch.Tensor):
        if out.dim() < 2 or out.shape[-2] != total:
            raise CPRopeError(f"rotary module '{fqn}' returned a tensor of shape {tuple(out.shape)}: CP expects the "
                              f"sequence ({total} global positions) in its second-to-last dim")
        t = out[..., sel.to(out.device) if isinstance(sel, torch.Tensor) else sel, :].contiguous()
        if rows is not None and t.dim() >= 3 and t.shape[0] == 1 and rows > 1:
            t = t.expand(rows, *t.shape[1:])
        return t
    if isinstance(out, (tuple, list)):
        return type(out)(_slice_outputs(o, sel, total, rows, fqn) for o in out)
    raise CPRopeError(f"rotary module '{fqn}' returned {type(out).__name__}; CP expects tensors or a tuple of them")


def _cp_call(original: Callable, sig: inspect.Signature, meta: CPBatchMeta, fqn: str, args, kwargs,
             three_d: bool = False):
    """The CP path: original forward on the global positions, this rank's slice returned
    (``three_d``: an mrope module, which also takes text-only ``[K, B|1, n]`` positions)."""
    bound = sig.bind(*args, **kwargs)
    local = bound.arguments.get("position_ids")
    if not isinstance(local, torch.Tensor):
        raise CPRopeError(f"rotary module '{fqn}' was called without position_ids under CP: pass "
                          "position_ids=local['position_ids'] from shard_batch_for_cp")
    lead = None
    if three_d and local.dim() == 3 and getattr(meta, "mrope_position_ids", None) is not None:
        return mrope_cp_call(original, bound, meta, fqn, local, CPRopeError, _slice_outputs)   # multimodal ids
    if three_d and local.dim() == 3:              # 3-D (mrope) positions [K, B|1, n]: text-only rows carried
        lead, local = local.shape[0], _text_rows(local, fqn)
    g = _global_positions(meta, local)
    B, n = g.shape[0], meta.local_seq_len
    lo, hi = meta.cp_rank * n, (meta.cp_rank + 1) * n
    sel = slice(lo, hi) if getattr(meta, "perm", None) is None else meta.q_index.to(g.device)  # balanced split
    rows = local.shape[0] if local.dim() == 2 else -1
    if local.dim() != 2 or local.shape[-1] != n or rows not in (1, B):
        raise CPRopeError(
            f"rotary module '{fqn}' got position_ids of shape {tuple(local.shape)}; under CP it needs this rank's "
            f"[{B}|1, {n}] slice of the batch's global positions"
            + (f", or that slice repeated as [K, {B}|1, {n}] 3-D (mrope) positions" if three_d else
               " (3-D RoPE positions only for a module with mrope_section)")
            + " (pass position_ids=local['position_ids'] from shard_batch_for_cp)")
    want = meta.position_ids.to(g.device)[:, sel].to(device=local.device, dtype=local.dtype)
    if not torch.equal(local.expand_as(want), want):
        raise CPRopeError(
            f"rotary module '{fqn}' got position_ids that are not this rank's slice of the CP batch's global "
            f"position_ids (cp rank {meta.cp_rank}): pass position_ids=local['position_ids'] from "
            "shard_batch_for_cp (without them transformers restarts every rank at 0)")
    if B > 1 and (g.stride(0) == 0 or torch.equal(g, g[:1].expand_as(g))):
        g = g[:1]                                 # one distinct row: computed once (as HF does for [1, S])
    bound.arguments["position_ids"] = g if lead is None else g[None].expand(lead, *g.shape)
    out = original(*bound.args, **bound.kwargs)
    return _slice_outputs(out, sel, meta.global_seq_len, rows, fqn)


def _text_rows(local: torch.Tensor, fqn: str) -> torch.Tensor:
    """Row 0 of 3-D positions ``[K, B|1, n]`` whose K rows are equal (text-only mrope input: every
    row is the token's 1-D position); refuses rows that differ (multimodal positions)."""
    if local.shape[0] < 1 or not torch.equal(local, local[:1].expand_as(local)):
        raise CPRopeError(
            f"rotary module '{fqn}' got 3-D RoPE positions of shape {tuple(local.shape)} whose rows differ "
            "(multimodal temporal/height/width position ids) but the CP batch carries no global 3-D positions: "
            "pass the 3-D ids as the batch's position_ids ([3|4, B, S]) to shard_batch_for_cp, which keeps them "
            "global in meta.mrope_position_ids")
    return local[0]


def _cp_forward(original: Callable, sig: inspect.Signature, fqn: str, three_d: bool = False) -> Callable:
    @functools.wraps(original)
    def forward(*args, **kwargs):
        meta = current_cp_batch_meta(required=False)
        if meta is None or meta.cp_size == 1:
            return original(*args, **kwargs)
        return _cp_call(original, sig, meta, fqn, args, kwargs, three_d)

    forward.__hp_cp_rope__ = fqn
    return forward


# ------------------------------------------------------------------------------ preflight
def _contexts(module: nn.Module, model_config=None) -> list[int]:
    """The lengths at which a RoPE variant may change behaviour: ``original_max_position_embeddings``
    (longrope, yarn, llama3), ``max_position_embeddings`` (dynamic NTK), ``original_max_seq_len``."""
    cands = set()
    for cfg in (getattr(module, "config", None), model_config):
        if cfg is None:
            continue
        params = getattr(cfg, "rope_parameters", None)
        if isinstance(params, dict):
            for d in [params] + [v for v in params.values() if isinstance(v, dict)]:
                if isinstance(d.get("original_max_position_embeddings"), int):
                    cands.add(d["original_max_position_embeddings"])
        for name in ("original_max_position_embeddings", "max_position_embeddings"):
            if isinstance(getattr(cfg, name, None), int):
                cands.add(getattr(cfg, name))
    for name in ("original_max_seq_len", "max_seq_len_cached", "max_position_embeddings"):
        if isinstance(getattr(module, name, None), int):
            cands.add(getattr(module, name))
    return sorted(c for c in cands if c > 0) or [4096]


def _probe_lengths(contexts: list[int], multiple: int) -> list[int]:
    """Long (beyond every context) -> just beyond -> short (inside every context) -> long again."""
    up = lambda v: -(-max(v, multiple) // multiple) * multiple  # noqa: E731
    top = contexts[-1]
    longest = up(top + top // 4 + 1)
    beyond = up(top + 1)
    short = (contexts[0] // 2) // multiple * multiple or multiple
    return [longest, beyond, short, longest]


def _probe_x(module: nn.Module, model_config, L: int) -> torch.Tensor:
    buf = next(itertools.chain(module.buffers(), module.parameters()), None)
    device = buf.device if buf is not None else torch.device("cpu")
    hidden = getattr(getattr(module, "config", None) or model_config, "hidden_size", None) or 64
    col = torch.randn(1, L, 1, generator=torch.Generator().manual_seed(0)).to(device)
    return col.expand(1, L, hidden)           # a value per token, stride 0 over hidden: O(L) memory


def _layer_types(module: nn.Module, sig: inspect.Signature) -> list:
    rt = getattr(module, "rope_type", None)
    if "layer_type" in sig.parameters and isinstance(rt, dict):
        return list(rt)
    return [None]


def _flatten(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flatten(o)]
    return [out]


def _probe_module(fqn: str, module: nn.Module, cp_size: int, multiple: int, model_config) -> None:
    sec = _mrope_section(module, model_config)
    lead = len(sec) if sec is not None else None     # 3-D (mrope) module: probed with text-only [K, 1, L]
    sig = _positions_param(module)
    if sig is None:
        raise CPConfigError(FIELD, f"rotary module ({type(module).__name__}) has no position_ids argument: under CP "
                            "each rank would rotate its chunk as if it started the sequence", module=fqn,
                            fix="give its forward a position_ids argument (transformers' (x, position_ids) "
                            "convention); " + FIX)
    contexts = _contexts(module, model_config)
    lengths = _probe_lengths(contexts, multiple)
    shards = sorted({0, cp_size - 1})
    for layer_type in _layer_types(module, sig):
        extra = {} if layer_type is None else {"layer_type": layer_type}
        ref_mod = copy.deepcopy(module)
        cp_mods = {r: copy.deepcopy(module) for r in shards}
        steps = [(L, False) for L in lengths] + [(L, True) for L in lengths] * (lead == MROPE_ROWS)
        for step, (L, multimodal) in enumerate(steps):
            x = _probe_x(module, model_config, L)
            pos = torch.arange(L, device=x.device)[None]
            mm = probe_mrope_positions(L).to(x.device) if multimodal else None
            if lead is not None:
                pos = pos[None].expand(lead, 1, L) if mm is None else mm
            try:
                with torch.no_grad():
                    ref = _flatten(ref_mod(x, position_ids=pos, **extra))
                    n = L // cp_size
                    got = {}
                    for r in shards:
                        meta = CPBatchMeta(cp_rank=r, cp_size=cp_size, global_seq_len=L, local_seq_len=n,
                                           key_doc=None, position_ids=pos.reshape(-1, L)[:1], seq_len=L,
                                           mrope_position_ids=mm)
                        m = cp_mods[r]
                        fwd = _cp_forward(m.forward, inspect.signature(m.forward), fqn, lead is not None)
                        with cp_batch_context(meta):
                            got[r] = _flatten(fwd(x[:, r * n:(r + 1) * n], position_ids=pos[..., r * n:(r + 1) * n],
                                                  **extra))
            except (CPRopeError, RuntimeError, TypeError, ValueError, IndexError) as exc:
                raise CPConfigError(FIELD, f"rotary module ({type(module).__name__}) could not be probed for CP at "
                                    f"length {L}: {type(exc).__name__}: {exc}", module=fqn, fix=FIX) from exc
            for r in shards:
                lo, hi = r * n, (r + 1) * n
                worst = 0.0
                for a, b in zip(got[r], ref):
                    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
                        continue
                    ref_slice = b[..., lo:hi, :]
                    if a.shape != ref_slice.shape:
                        worst = float("inf")
                        break
                    scale = max(float(ref_slice.abs().max()) if ref_slice.numel() else 0.0, 1e-30)
                    worst = max(worst, float((a.float() - ref_slice.float()).abs().max()) / scale
                                if a.numel() else 0.0)
                if len(got[r]) != len(ref) or worst > PROBE_TOL:
                    lt = "" if layer_type is None else f" (layer_type {layer_type!r})"
                    raise CPConfigError(
                        FIELD, f"rotary module ({type(module).__name__}){lt} depends on more than the positions: "
                        f"at probe step {step} (length {L}, original context {contexts[-1]}) its CP output for cp "
                        f"shard {r}/{cp_size} differs from the slice of its output for the whole sequence (max rel err "
                        f"{worst:.2e} > {PROBE_TOL:g}), so CP would be silently wrong", module=fqn, fix=FIX)


def check_rotary_modules(model: nn.Module, cp_size: int, multiple: Optional[int] = None) -> list[str]:
    """Preflight probe of every rotary module (see the module doc); returns their FQNs.

    Local and deterministic (no collective): every rank reaches the same verdict. The modules
    themselves are not touched (the probe runs on deep copies, so no state is consumed).
    """
    if cp_size <= 1:
        return []
    multiple = multiple or 2 * cp_size
    model_config = getattr(model, "config", None)
    fqns, probed = [], set()
    for fqn, module in find_rotary_modules(model):
        cfg = getattr(module, "config", None)
        key = (type(module), id(cfg)) if cfg is not None else (type(module), id(module))
        if key not in probed:        # per-layer copies of one class built from one config: probed once
            _probe_module(fqn, module, cp_size, multiple, model_config)
            probed.add(key)
        fqns.append(fqn)
    return fqns


def install_cp_rope(model: nn.Module, replace_forward: Optional[Callable] = None) -> list[str]:
    """Route every rotary module of ``model`` through the CP path (module doc); returns the FQNs.

    ``replace_forward(module, fn)`` installs the forward (the applier passes its undo-recording
    installer); by default ``module.forward = fn``. Idempotent per module.
    """
    done = []
    for fqn, module in find_rotary_modules(model):
        if hasattr(module.__dict__.get("forward"), "__hp_cp_rope__"):
            continue
        sig = _positions_param(module)
        if sig is None:
            raise CPConfigError(FIELD, f"rotary module ({type(module).__name__}) has no position_ids argument",
                                module=fqn, fix=FIX)
        three_d = _mrope_section(module, getattr(model, "config", None)) is not None
        fn = _cp_forward(module.forward, sig, fqn, three_d)
        if replace_forward is None:
            module.forward = fn
        else:
            replace_forward(module, fn)
        done.append(fqn)
        log.info("CP RoPE: %s (%s) computed on the global positions", fqn, type(module).__name__)
    return done
