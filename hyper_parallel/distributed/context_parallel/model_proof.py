"""CP preflight proof: the whole model computes the same thing under CP as without it.

Runs once, after the CP plan is applied and before the first step, on every rank together.
It is the general refusal of issue 21 (a token mixer that is not declared for CP) and the
safety net for declared methods that are not the module's own computation (issue 12: a
dropped window or mask): no name list is consulted, the model's numbers are compared.

What it does (:func:`prove_cp_model`):

1. **Probe batch** (same on every rank, private generator): random token ids, ``B = 3`` rows —
   a full row, a right-padded row and a packed row of three documents (``seq_lens``; dropped
   when the batch contract refuses ``seq_lens``). ``S`` is a multiple of the batch policy's
   multiple (:func:`~.batch.policy_multiple`), at least 16 tokens per CP rank, longer than a
   config ``sliding_window`` (``+ max(16, w/4)``), capped by ``max_seq_len`` and the model's
   ``max_position_embeddings``.
2. **CP forward**: the batch is sharded exactly as the trainer shards it (the plan's
   ``batch_prepare_fn`` or :func:`~.batch.shard_batch_for_cp` with ``plan.batch_policy``) and
   the model runs ``model(input_ids, position_ids)`` inside ``cp_batch_context(meta)``.
   Forward pre-hooks/hooks on every decoder layer keep this rank's layer inputs and outputs.
3. **Reference forward**: every CP-wrapped module gets its original forward back (and its
   original config: the ``flex_hf*`` private config is undone) for the duration of one forward
   of the *same* model on the whole sequence, every document as its own right-padded row with
   ``attention_mask`` — i.e. what the model computes without CP. Hooks compare, layer by
   layer, this rank's chunk of the CP run with the matching tokens of the reference, on valid
   tokens only (padding is ignored, packed documents are independent by definition):
   the input of every layer, the *update* each layer adds (``out - in``: sensitive even when
   the residual stream dominates) and the final logits.
4. **Agreement**: per-checkpoint errors are all-gathered; the first checkpoint above
   tolerance (max over ranks) decides, identically on every rank.
5. **Attribution** (only on failure): one more reference and one more CP forward capture the
   inputs of the failing layer's direct children; each child, in call order, is re-run under
   CP on this rank's slice of the *reference* inputs, and its gathered output is compared
   with its reference output. The first child that differs given identical inputs is the
   token mixer named in the error (``model.layers.0.linear_attn (Qwen3NextGatedDeltaNet)``);
   if none does, the layer's own forward mixes tokens (named as the layer).

The refusal is a :class:`~..errors.CPConfigError` naming the layer, the module and its class,
whether a ``plan_overrides`` entry covers it, the reason, the max relative error and the fix.
Every phase is agreed with :func:`~..preflight.agree_or_raise` (world group): a failure on
one rank fails every rank, no rank is left in a collective.

Precision: the probe runs in float32 — a model whose (non-DTensor) parameters are bf16/fp16
is temporarily upcast (bit-exact round trip) — and compares with ``PROOF_TOLERANCE`` of the
compute dtype (a model under an FSDP2 bf16 policy compares with the bf16 tolerance). The
model is left as it was: no autograd (``no_grad``), ``eval()`` during the probe and every
module's train/eval flag restored, RNG states restored, hooks removed, CP forwards back.

Cost: one CP forward plus one full-sequence forward of the ``B x S`` probe on every rank (two
more of each only when it refuses), and the layer inputs/outputs of this rank's chunk
(``2 x layers x B x S/cp x hidden``) held until the reference pass.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten_with_path, tree_unflatten

from ..errors import CPConfigError
from ..preflight import agree_or_raise
from .semantics import mixer_methods_for, uncarried_attention_semantics

log = logging.getLogger("hyper_parallel.cp.proof")

__all__ = ["prove_cp_model", "ProofReport", "PROOF_TOLERANCE", "cp_disabled", "probe_batch"]

#: relative tolerance per compute dtype: ``max|cp - ref| <= rtol * max|ref|`` on valid tokens
#: (layer updates: ``+ rtol/10 * max|layer output|`` for the residual stream's rounding)
PROOF_TOLERANCE = {
    torch.float64: 1e-8,
    torch.float32: 1e-4,
    torch.bfloat16: 3e-2,
    torch.float16: 1e-2,
}

#: how to skip the proof, in YAML and through the API (the caller then vouches for the model)
OPT_OUT = "accelerator.cp_preflight_proof: false (API: apply_sharding_plan(..., preflight_proof=False))"
FIX = "declare a CP method for it in plan_overrides, or use accelerator.cp_size: 1"
REASON_UNDECLARED = "mixes tokens along the sequence but is not declared for CP"
REASON_DECLARED = ("declared CP method differs from the module's own computation "
                   "(e.g. a dropped mask or window)")


@dataclasses.dataclass
class ProofReport:
    """What a passing proof checked (returned on every rank)."""

    seq_len: int                 # probe S (global, before policy padding)
    rows: int                    # probe rows (3 with the packed row, else 2)
    packed: bool                 # the packed (seq_lens) row was included
    layers: int                  # decoder layers compared
    checkpoints: int             # compared tensors (layer inputs, layer updates, logits)
    max_rel_error: float         # worst error / max|ref| over all checkpoints (max over ranks)
    dtype: str                   # compute dtype of the comparison
    time_s: float


class _MISSING_T:
    def __repr__(self):
        return "<missing>"


_NOTSET = _MISSING_T()

#: "this module had no instance ``forward`` before CP replaced it" — the value the applier records
#: as ``__hp_cp_prev_forward__`` (the plan applier imports it from here)
NO_INSTANCE_FORWARD = _MISSING_T()


# ============================================================================ helpers
def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _first_tensor(obj) -> Optional[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (tuple, list)):
        for x in obj:
            t = _first_tensor(x)
            if t is not None:
                return t
        return None
    if isinstance(obj, dict):   # ModelOutput / BaseModelOutput
        for key in ("logits", "last_hidden_state", "hidden_states"):
            if isinstance(obj.get(key), torch.Tensor):
                return obj[key]
        for v in obj.values():
            if isinstance(v, torch.Tensor):
                return v
    return None


def _hidden_in(args, kwargs) -> Optional[torch.Tensor]:
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"]
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    return None


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t


def _seq_shaped(t, B: int, S: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[0] == B and t.shape[1] == S


def _model_config(model: nn.Module):
    return getattr(model, "config", None)


def _cfg_int(cfg, name: str) -> Optional[int]:
    if cfg is None:
        return None
    vals = []
    for c in (cfg, getattr(cfg, "text_config", None)):
        v = getattr(c, name, None) if c is not None else None
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            vals.append(v)
    return max(vals) if vals else None


def _vocab(model: nn.Module) -> int:
    v = _cfg_int(_model_config(model), "vocab_size")
    if v is None:
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        v = getattr(emb, "num_embeddings", None)
    if not v:
        raise CPConfigError("accelerator.cp_preflight_proof", f"cannot find the vocabulary size of "
                            f"{type(model).__name__} to build the probe input",
                            fix=f"give the model a config.vocab_size, or set {OPT_OUT}")
    return int(v)


def _device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if hasattr(p, "_local_tensor"):
            return p._local_tensor.device
        return p.device
    return torch.device("cpu")


def probe_length(model: nn.Module, multiple: int, cp_size: int, *, seq_len: Optional[int] = None,
                 max_seq_len: int = 4096) -> int:
    """Probe S: a multiple of ``multiple``, >= 16 tokens per rank, > a config ``sliding_window``."""
    cfg = _model_config(model)
    if seq_len is None:
        want = max(16 * cp_size, 64)
        window = _cfg_int(cfg, "sliding_window")
        if window is not None:
            want = max(want, window + max(16, window // 4))
        want = min(want, max_seq_len)
        if window is not None and want <= window:
            log.warning("CP preflight proof: probe length %d does not exceed sliding_window=%d (max_seq_len cap); "
                        "the window is not exercised", want, window)
    else:
        want = int(seq_len)
    S = -(-want // multiple) * multiple
    limit = _cfg_int(cfg, "max_position_embeddings")
    if limit is not None and S > limit:
        S = max(multiple, (limit // multiple) * multiple)
    return S


def probe_batch(S: int, vocab: int, *, packed: bool, seed: int = 0, pad_token_id: int = 0):
    """(global batch dict, documents [(row, start, length)]) of the probe (CPU tensors)."""
    g = torch.Generator().manual_seed(1234 + seed)
    packed = packed and S >= 24          # three documents of >= 1 token and 2 padding tokens
    rows = 3 if packed else 2
    ids = torch.randint(0, vocab, (rows, S), generator=g)
    pad = max(1, S // 5)
    mask = torch.ones(rows, S, dtype=torch.int64)
    mask[1, S - pad:] = 0
    ids[1, S - pad:] = pad_token_id
    docs = [(0, 0, S), (1, 0, S - pad)]
    batch = {"input_ids": ids, "attention_mask": mask}
    if packed:
        a = S // 2 - 3                      # ends just before a cp=2 shard edge
        b = S // 4 + 5                      # crosses it
        c = S - a - b - 2                   # 2 padding tokens at the end
        lens = torch.tensor([[S, 0, 0], [S - pad, 0, 0], [a, b, c]], dtype=torch.int64)
        batch["seq_lens"] = lens
        mask[2, a + b + c:] = 0
        ids[2, a + b + c:] = pad_token_id
        docs += [(2, 0, a), (2, a, b), (2, a + b, c)]
    return batch, docs


def _call_kwargs(model: nn.Module, **kw) -> dict:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return kw
    var_kw = any(p.kind == p.VAR_KEYWORD for p in params.values())
    return {k: v for k, v in kw.items() if k in params or var_kw or k in ("input_ids",)}


# ============================================================================ model state
@contextlib.contextmanager
def cp_disabled(model: nn.Module):
    """Every CP-wrapped module runs its original forward (and original config) in the body.

    The original is what the applier replaced (``__hp_cp_prev_forward__``), else the wrapper's
    ``__wrapped__``, else the class forward; a wrapper's undo steps (``__hp_undo__``, e.g. the
    ``flex_hf*`` private config) are run. On exit every module's attributes are put back as
    they were, so the CP path is exactly restored.
    """
    saved = []
    try:
        for mod in model.modules():
            d = mod.__dict__
            if "__hp_cp_wrapped__" not in d:
                continue
            snapshot = dict(d)
            saved.append((mod, snapshot))
            fwd = d.get("forward")
            for undo in reversed(list(getattr(fwd, "__hp_undo__", []) or [])):
                undo()
            if "__hp_cp_prev_forward__" in d:
                orig = d["__hp_cp_prev_forward__"]
            elif fwd is not None and hasattr(fwd, "__wrapped__"):
                orig = fwd.__wrapped__
            else:
                orig = NO_INSTANCE_FORWARD
            if orig is NO_INSTANCE_FORWARD:
                d.pop("forward", None)
            else:
                d["forward"] = orig
        yield
    finally:
        for mod, snapshot in reversed(saved):
            d = mod.__dict__
            for k in [k for k in d if k not in snapshot]:
                del d[k]
            for k, v in snapshot.items():
                if d.get(k, _NOTSET) is not v:
                    d[k] = v


@contextlib.contextmanager
def _preserved(model: nn.Module, upcast: bool):
    """eval() + no_grad for the body; train flags, RNG and (upcast) parameter dtypes restored."""
    modes = [(m, m.training) for m in model.modules()]
    cpu_rng = torch.get_rng_state()
    dev_rng = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        dev_rng = torch.cuda.get_rng_state_all()
    cast: list = []
    try:
        if upcast:
            tensors = list(model.parameters()) + list(model.buffers())
            if not any(hasattr(t, "_local_tensor") for t in tensors):
                for t in tensors:
                    if t.dtype in (torch.bfloat16, torch.float16):
                        cast.append((t, t.data))
                        t.data = t.data.float()
        model.eval()
        with torch.no_grad():
            yield
    finally:
        for t, data in cast:
            t.data = data
        for m, flag in modes:
            m.training = flag
        torch.set_rng_state(cpu_rng)
        if dev_rng is not None:
            torch.cuda.set_rng_state_all(dev_rng)


# ============================================================================ the proof
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


class _Prover:
    def __init__(self, model, plan, mesh, *, seq_len, max_seq_len, pad_token_id, ignore_index, seed, packed,
                 upcast, prepare):
        from .batch import cp_coords, policy_multiple, shard_batch_for_cp

        self.model, self.plan, self.mesh = model, plan, mesh
        self.cp_mesh = mesh.cp_mesh if hasattr(mesh, "cp_mesh") else mesh
        self.cp_rank, self.cp_size = cp_coords(self.cp_mesh)
        self.policy = plan.batch_policy or "all_gather"
        self.prepare = prepare or getattr(plan, "batch_prepare_fn", None) or shard_batch_for_cp
        _, self.multiple = policy_multiple(self.policy, self.cp_size)
        self.seq_len, self.max_seq_len = seq_len, max_seq_len
        self.pad_token_id, self.ignore_index, self.seed = pad_token_id, ignore_index, seed
        self.want_packed = packed
        self.upcast = upcast
        names = dict(model.named_modules())
        self.names = names
        self.layers = [(f, names[f]) for f in (plan.decoder_layers or []) if f in names]
        if not self.layers:
            from ..tensor_parallel import find_decoder_layers

            self.layers = [(f, names[f]) for f in find_decoder_layers(model)]

    # -------------------------------------------------------------- phase 1 (local)
    def build(self):
        model = self.model
        self.device = _device(model)
        vocab = _vocab(model)
        self.S = probe_length(model, self.multiple, self.cp_size, seq_len=self.seq_len, max_seq_len=self.max_seq_len)
        packed = self.want_packed is not False
        local = None
        if packed and self.S < 24:
            if self.want_packed:
                raise CPConfigError("accelerator.cp_preflight_proof", f"the packed probe row needs S >= 24, got "
                                    f"seq_len={self.S}", fix="use a longer seq_len or packed=None")
            packed = False
        if packed:
            batch, docs = probe_batch(self.S, vocab, packed=True, seed=self.seed, pad_token_id=self.pad_token_id)
            try:
                local = self._shard(batch)
            except (TypeError, ValueError) as exc:
                if self.want_packed:
                    raise
                log.info("CP preflight proof: the batch contract refused the packed probe row (%s); probing "
                         "without it", exc)
                packed = False
        if not packed:
            batch, docs = probe_batch(self.S, vocab, packed=False, seed=self.seed, pad_token_id=self.pad_token_id)
            local = self._shard(batch)
        self.packed, self.batch, self.docs, self.local = packed, batch, docs, local
        meta = local.meta
        self.meta = meta
        self.L = meta.local_seq_len
        lo = meta.cp_rank * meta.local_seq_len
        slot = None if meta.perm is None else torch.argsort(meta.perm)
        self.layout = _Layout(docs, self.S, lo, lo + self.L, self.device, slot)
        R, T = self.layout.R, self.layout.ref_len
        ref_ids = torch.full((R, T), self.pad_token_id, dtype=torch.int64)
        ref_mask = torch.zeros(R, T, dtype=torch.int64)
        for r, (b, start, length) in enumerate(docs):
            ref_ids[r, :length] = batch["input_ids"][b, start:start + length]
            ref_mask[r, :length] = 1
        self.ref_inputs = _call_kwargs(
            model, input_ids=ref_ids.to(self.device), attention_mask=ref_mask.to(self.device),
            position_ids=torch.arange(T, dtype=torch.int64).expand(R, T).contiguous().to(self.device),
            use_cache=False)
        self.cp_inputs = _call_kwargs(
            model, input_ids=local["input_ids"].to(self.device), position_ids=local["position_ids"].to(self.device),
            use_cache=False)
        self.B = batch["input_ids"].shape[0]

    def _shard(self, batch):
        return self.prepare(batch, self.cp_mesh, self.policy, ignore_index=self.ignore_index,
                            pad_token_id=self.pad_token_id)

    # -------------------------------------------------------------- forwards
    def _cp_forward(self, hooks: list):
        from .meta import cp_batch_context

        handles = [h() for h in hooks]
        try:
            with cp_batch_context(self.meta):
                return self.model(**self.cp_inputs)
        finally:
            for h in handles:
                h.remove()

    def _ref_forward(self, hooks: list):
        handles = [h() for h in hooks]
        try:
            with cp_disabled(self.model):
                return self.model(**self.ref_inputs)
        finally:
            for h in handles:
                h.remove()

    # -------------------------------------------------------------- phase 2: CP forward
    def run_cp(self):
        self.cp_in: dict = {}
        self.cp_out: dict = {}
        hooks = []
        for fqn, layer in self.layers:
            def pre(mod, args, kwargs, fqn=fqn):
                x = _hidden_in(args, kwargs)
                if fqn not in self.cp_in and x is not None:
                    self.cp_in[fqn] = _full_tensor(x).detach().clone()

            def post(mod, args, kwargs, out, fqn=fqn):
                y = _first_tensor(out)
                if fqn not in self.cp_out and y is not None:
                    self.cp_out[fqn] = _full_tensor(y).detach().clone()

            hooks.append(lambda layer=layer, pre=pre: layer.register_forward_pre_hook(pre, with_kwargs=True))
            hooks.append(lambda layer=layer, post=post: layer.register_forward_hook(post, with_kwargs=True))
        try:
            out = self._cp_forward(hooks)
        except CPConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - refused at preflight instead of at the first step
            raise CPConfigError(
                "plan_overrides", f"CP preflight proof: the CP forward of the probe (S={self.S}) raised "
                f"{type(exc).__name__}: {exc}", fix="the declared CP methods cannot run this model as declared: "
                "fix the declaration, or use accelerator.cp_size: 1") from exc
        logits = _first_tensor(out)
        self.cp_logits = _full_tensor(logits).detach() if logits is not None else None

    # -------------------------------------------------------------- phase 3: reference forward
    def run_ref(self) -> list:
        lay = self.layout
        checks: list[_Check] = []
        current: dict = {}

        def usable(cp, ref):
            return (cp is not None and ref is not None and _seq_shaped(cp, self.B, self.L)
                    and _seq_shaped(ref, lay.R, lay.ref_len) and cp.shape[2:] == ref.shape[2:])

        hooks = []
        for fqn, layer in self.layers:
            def pre(mod, args, kwargs, fqn=fqn):
                x = _hidden_in(args, kwargs)
                if fqn in current or x is None:
                    return
                x = _full_tensor(x).detach().clone()
                current[fqn] = x
                cp = self.cp_in.get(fqn)
                if usable(cp, x):
                    checks.append(_Check(f"in:{fqn}", fqn, _diff(lay.cp_local(cp), lay.ref_local(x)),
                                         _amax(lay.ref_all(x)), 0.0, cp.dtype))

            def post(mod, args, kwargs, out, fqn=fqn):
                y = _first_tensor(out)
                x = current.get(fqn)
                if y is None or x is None or f"delta:{fqn}" in {c.key for c in checks}:
                    return
                y = _full_tensor(y).detach()
                cin, cout = self.cp_in.get(fqn), self.cp_out.get(fqn)
                if usable(cin, x) and usable(cout, y) and x.shape == y.shape:
                    d_ref = lay.ref_all(y).double() - lay.ref_all(x).double()
                    d_cp = lay.cp_local(cout).double() - lay.cp_local(cin).double()
                    d_ref_local = lay.ref_local(y).double() - lay.ref_local(x).double()
                    checks.append(_Check(f"delta:{fqn}", fqn, _diff(d_cp, d_ref_local), _amax(d_ref),
                                         _amax(lay.ref_all(y)), cout.dtype))
                elif usable(cout, y):
                    checks.append(_Check(f"out:{fqn}", fqn, _diff(lay.cp_local(cout), lay.ref_local(y)),
                                         _amax(lay.ref_all(y)), 0.0, cout.dtype))
                current[fqn] = None     # free

            hooks.append(lambda layer=layer, pre=pre: layer.register_forward_pre_hook(pre, with_kwargs=True))
            hooks.append(lambda layer=layer, post=post: layer.register_forward_hook(post, with_kwargs=True))
        try:
            out = self._ref_forward(hooks)
        except CPConfigError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise CPConfigError(
                "accelerator.cp_preflight_proof", f"CP preflight proof: the model's own forward (CP disabled) on "
                f"the probe ({lay.R} rows x {lay.ref_len} tokens, input_ids/attention_mask/position_ids) raised "
                f"{type(exc).__name__}: {exc}", fix="make the model run a plain forward on these inputs, or set "
                f"{OPT_OUT}") from exc
        ref_logits = _first_tensor(out)
        if ref_logits is not None and usable(self.cp_logits, _full_tensor(ref_logits)):
            r = _full_tensor(ref_logits)
            checks.append(_Check("logits", None, _diff(lay.cp_local(self.cp_logits), lay.ref_local(r)),
                                 _amax(lay.ref_all(r)), 0.0, self.cp_logits.dtype))
        self.cp_in = self.cp_out = None     # free the CP activations
        self.cp_logits = None
        return [(c.key, c.layer, c.diff, c.scale, c.res_scale, str(c.dtype)) for c in checks]

    # -------------------------------------------------------------- phase 5: attribution
    def _children(self, layer: nn.Module):
        return [(n, c) for n, c in layer.named_children()]

    def capture_children(self, fqn: str, layer: nn.Module, reference: bool) -> dict:
        """Call order, inputs (args, kwargs) and outputs of ``layer``'s direct children."""
        rec: dict = {"order": [], "args": {}, "out": {}}
        counts: dict = {}
        hooks = []
        for name, child in self._children(layer):
            def pre(mod, args, kwargs, name=name):
                i = counts.get(name, 0)
                counts[name] = i + 1
                key = (name, i)
                rec["order"].append(key)
                rec["args"][key] = _clone_tree((args, kwargs))

            def post(mod, args, kwargs, out, name=name):
                key = (name, counts.get(name, 1) - 1)
                y = _first_tensor(out)
                if reference and y is not None:
                    rec["out"][key] = _full_tensor(y).detach().clone()

            hooks.append(lambda child=child, pre=pre: child.register_forward_pre_hook(pre, with_kwargs=True))
            hooks.append(lambda child=child, post=post: child.register_forward_hook(post, with_kwargs=True))
        (self._ref_forward if reference else self._cp_forward)(hooks)
        return rec

    def attribute(self, fqn: str, layer: nn.Module):
        """(child fqn, child class, rel error) of the first child that differs on identical inputs, or None."""
        from .batch import gather_from_cp
        from .meta import cp_batch_context

        lay = self.layout
        ref = self.capture_children(fqn, layer, reference=True)
        cpr = self.capture_children(fqn, layer, reference=False)
        children = dict(self._children(layer))
        unshard = getattr(layer, "unshard", None)
        if callable(unshard):
            unshard()
        try:
            for key in ref["order"]:
                name, _i = key
                if key not in cpr["args"] or key not in ref["out"]:
                    continue
                ref_out = ref["out"][key]
                if not _seq_shaped(ref_out, lay.R, lay.ref_len):
                    continue
                args, kwargs = self._overlay(cpr["args"][key], ref["args"][key], gather_from_cp)
                with cp_batch_context(self.meta):
                    out = children[name](*args, **kwargs)
                y = _first_tensor(out)
                if y is None or not _seq_shaped(_full_tensor(y), self.B, self.L):
                    continue
                y = _full_tensor(y).detach()
                chk = _Check(f"child:{name}", fqn, _diff(lay.cp_local(y), lay.ref_local(ref_out)),
                             _amax(lay.ref_all(ref_out)), 0.0, y.dtype)
                worst = _max_over_ranks(chk.diff)
                if worst > chk.tol():
                    return f"{fqn}.{name}", type(children[name]).__name__, worst / chk.scale if chk.scale else worst
        finally:
            reshard = getattr(layer, "reshard", None)
            if callable(unshard) and callable(reshard):
                reshard()
        return None

    def _overlay(self, cp_tree, ref_tree, gather):
        """CP args with every sequence activation replaced by this rank's slice of the reference's."""
        lay = self.layout
        cp_leaves, spec = tree_flatten_with_path(cp_tree)
        ref_leaves = dict(tree_flatten_with_path(ref_tree)[0])
        out = []
        for path, leaf in cp_leaves:
            r = ref_leaves.get(path)
            if (_seq_shaped(leaf, self.B, self.L) and _seq_shaped(r, lay.R, lay.ref_len)
                    and leaf.shape[2:] == r.shape[2:] and leaf.is_floating_point()):
                full = gather(leaf.contiguous(), self.cp_mesh, dim=1)      # collective: same on every rank
                full = full.clone()
                full[lay.gb, lay.gs] = r[lay.rr, lay.rp].to(full.dtype)
                leaf = full[:, lay.lo:lay.hi].contiguous()
            out.append(leaf)
        return tree_unflatten(out, spec)


def _clone_tree(tree):
    leaves, spec = tree_flatten_with_path(tree)
    return tree_unflatten([(_full_tensor(x).detach().clone() if isinstance(x, torch.Tensor) else x)
                           for _p, x in leaves], spec)


def _max_over_ranks(x: float) -> float:
    if _world() == 1:
        return x
    from ...platform import all_gather_object

    return max(all_gather_object(float(x)))


def _covering(plan, fqn: str):
    """(spec, declared fqn) of the plan_overrides entry covering ``fqn`` (itself or an ancestor), or None."""
    for t in getattr(plan, "cp_targets", []) or []:
        for declared in (t.fqn, t.inner_fqn):
            if fqn == declared or fqn.startswith(declared + "."):
                return t
    return None


def _contained(plan, fqn: str) -> list:
    return [t.fqn for t in getattr(plan, "cp_targets", []) or [] if t.fqn.startswith(fqn + ".")]


def _parent_of_layers(names: dict, layer_fqn: str) -> tuple[str, str]:
    parts = layer_fqn.split(".")
    for i in range(len(parts) - 1, 0, -1):
        cand = ".".join(parts[:i])
        mod = names.get(cand)
        if mod is not None and not isinstance(mod, nn.ModuleList):
            return cand, type(mod).__name__
    return "", "the model"


def _refusal(prover: _Prover, check: tuple, culprit) -> CPConfigError:
    key, layer_fqn, diff, scale, _res, dtype = check
    rel = diff / scale if scale else float("inf")
    plan = prover.plan
    names = prover.names
    cp = prover.cp_size
    head = (f"CP preflight proof: the model computes differently under CP (cp_size={cp}) than without it "
            f"on the probe input (S={prover.S}, {prover.layout.R} documents{', packed row' if prover.packed else ''})")
    if key == "logits":
        fqn, cls = _parent_of_layers(names, prover.layers[-1][0]) if prover.layers else ("", type(prover.model).__name__)
        return CPConfigError(
            "plan_overrides",
            f"{head}: every decoder layer matches, but the logits differ — code after the last decoder layer "
            f"(in {type(prover.model).__name__}.forward / {cls}.forward) {REASON_UNDECLARED}; max relative error "
            f"{rel:.3e}", module=fqn or None, fix=FIX)
    if key.startswith("in:"):
        idx = [f for f, _ in prover.layers].index(layer_fqn)
        fqn, cls = _parent_of_layers(names, layer_fqn)
        where = (f"between '{prover.layers[idx - 1][0]}' and '{layer_fqn}'" if idx else
                 f"before the first decoder layer '{layer_fqn}' (embeddings)")
        return CPConfigError(
            "plan_overrides",
            f"{head}: the input of decoder layer '{layer_fqn}' already differs — code {where}, in "
            f"'{fqn}' ({cls}).forward, {REASON_UNDECLARED}; not covered by any plan_overrides declaration; "
            f"max relative error {rel:.3e}", module=fqn or None, fix=FIX)
    if culprit is not None:
        fqn, cls, rel = culprit
    else:
        fqn, cls = layer_fqn, type(names[layer_fqn]).__name__
    target = _covering(plan, fqn)
    module = names.get(fqn)
    if target is not None:
        field = target.spec.field(target.kind)
        ref = target.spec.inner_wrapper if target.kind == "inner_wrapper" else target.spec.local_compute_fn
        cover = (f"covered by {target.spec.field()} (match={target.spec.match!r}, {target.kind}="
                 f"{ref.describe()})")
        reason = REASON_DECLARED
        semantics = uncarried_attention_semantics(module) if module is not None else []
        if semantics:
            reason = f"the declared CP method does not carry what the module computes: {'; '.join(semantics)}"
        fix = ("fix or replace the declared CP method so that it computes what the module computes (e.g. a method "
               "that supports its mask/window), or use accelerator.cp_size: 1")
    else:
        field = "plan_overrides"
        inside = _contained(plan, fqn)
        cover = "not covered by any plan_overrides declaration" + (
            f" (it contains the declared {inside[:2]}, but the difference is in its own computation)" if inside else "")
        reason = REASON_UNDECLARED
        fix = FIX
        methods = mixer_methods_for(module, cp) if module is not None and fqn != layer_fqn else []
        if methods:
            fix = (f"{FIX} (token-mixer methods that accept {cls}: inner_wrapper: {' | '.join(methods)}, on a match "
                   f"selecting these modules, e.g. '{_pattern(fqn)}')")
    within = "" if fqn == layer_fqn else f"; first differing submodule '{fqn}' ({cls})"
    if culprit is None and fqn == layer_fqn:
        within = f"; none of its submodules differs on identical inputs, so the layer's own forward ({cls})"
    return CPConfigError(
        field, f"{head}: first differing decoder layer '{layer_fqn}'{within}, {cover}: {reason}; max relative "
        f"error {rel:.3e} (tolerance {PROOF_TOLERANCE.get(_dtype(dtype), 1e-4):g} relative, {dtype})",
        module=fqn, fix=fix)


def _pattern(fqn: str) -> str:
    """``model.layers.0.conv`` -> ``*[0-9].conv``: a plan_overrides glob for every layer's copy that
    does not also match a same-named grandchild (LFM2's ``conv.conv``)."""
    parent, _, name = fqn.rpartition(".")
    if not parent:
        return fqn
    return f"*[0-9].{name}" if parent.rpartition(".")[2].isdigit() else f"*.{name}"


def _dtype(name: str):
    for d in PROOF_TOLERANCE:
        if str(d) == name:
            return d
    return torch.float32


def prove_cp_model(model: nn.Module, plan, mesh, *, seq_len: Optional[int] = None, max_seq_len: int = 4096,
                   pad_token_id: int = 0, ignore_index: int = -100, seed: int = 0,
                   packed: Optional[bool] = None, upcast: bool = True,
                   prepare: Optional[Callable] = None) -> Optional[ProofReport]:
    """Prove on a probe input that ``model`` (with ``plan`` applied) computes under CP what it
    computes without CP, layer by layer; raise :class:`CPConfigError` naming the first module
    that differs. Collective: call it on **every** rank (world group), after
    :func:`~..plan.applier.apply_sharding_plan`, before the first step.

    ``plan``: the :class:`~..plan.planner.ShardingPlan`; ``mesh``: the MeshContext (or the
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
    from ...platform import all_gather_object

    return all_gather_object(local)
