"""The prover: builds the probe, runs the CP and the reference forwards with layer hooks, and
attributes a failing layer to its first differing child (the collective parts go through
``platform``). Driven by :func:`.prove.prove_cp_model`."""
from __future__ import annotations

import logging

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten_with_path, tree_unflatten

from ...errors import CPConfigError
from .checks import _amax, _Check, _diff, _Layout
from .probe import (_call_kwargs, _device, _first_tensor, _full_tensor, _hidden_in, _seq_shaped, _vocab, _world,
                    probe_batch, probe_length)
from .report import OPT_OUT
from .state import cp_disabled

log = logging.getLogger("hyper_parallel.cp.proof")


class _Prover:
    def __init__(self, model, plan, mesh, *, seq_len, max_seq_len, pad_token_id, ignore_index, seed, packed,
                 upcast, prepare):
        from ..batch import cp_coords, policy_multiple, shard_batch_for_cp

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
            from ...tensor_parallel import find_decoder_layers

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
        from ..meta import INDEPENDENT

        local = self.prepare(batch, self.cp_mesh, self.policy, ignore_index=self.ignore_index,
                             pad_token_id=self.pad_token_id)
        if getattr(local, "meta", None) is not None:    # the reference runs each packed document alone
            local.meta.documents = INDEPENDENT
        return local

    # -------------------------------------------------------------- forwards
    def _cp_forward(self, hooks: list):
        from ..meta import cp_batch_context

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
        from ..batch import gather_from_cp
        from ..meta import cp_batch_context

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
    from ....platform import all_gather_object

    return max(all_gather_object(float(x)))
