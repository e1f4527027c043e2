"""ShardingApplier: apply a :class:`~.sharding_planner.ShardingPlan` to a model.

Order: TP placement -> the declared CP wrapper / local compute -> activation
checkpointing -> expert parallelism (:mod:`..expert_parallel`, after the CP proof) -> FSDP2
``fully_shard`` (each EP experts module on ``experts_fsdp_mesh``, an untied input
embedding, each decoder layer, an untied output head, then the root, on ``mesh.fsdp_mesh``; HSDP
when ``dp_replicate > 1``). Decoder layers (the TP, checkpointing and
FSDP units) are what transformers declares (``_no_split_modules``, see
:func:`~.tensor_parallel.find_decoder_layers`), so GPT-NeoX, Falcon, Bloom, GPT-2, OPT and MPT
are sharded and checkpointed as Llama is. Only what the plan declares is applied.
With cp > 1 every rotary embedding module is first probed (:func:`~.context_parallel.rope.check_rotary_modules`,
a refusal names the module) and, with the CP wrappers, made to compute its output on the batch's
global positions (:func:`~.context_parallel.rope.install_cp_rope`; undone by the rollback), and a
base model whose every CP method ignores the model's attention mask (DSA, Doge) builds none under CP
(:func:`~.context_parallel.interception.model_mask.install_no_model_mask`; undone by the rollback).

Installing a CP method on ``inner_module``:

* ``inner_wrapper``: ``fn(inner_module, mesh, tp_mesh, cp_mesh, ep_mesh, **named_params)`` with
  ``mesh`` the :class:`~.mesh.MeshContext` and ``None`` for inactive axes. A returned callable
  becomes ``inner_module.forward``; a wrapper returning None must have replaced
  ``inner_module.forward`` itself. While it runs, :func:`~.context_parallel.interception.current_apply_context`
  gives the module FQN and the mode.
* ``local_compute_fn``: ``inner_module.forward = lambda *a, **kw: fn(inner_module, *a, cp_mesh=cp_mesh,
  **named_params, **kw)`` — the function owns the whole local-region compute, collectives included.

If anything fails after the first CP install (another wrapper, a check, activation
checkpointing, FSDP), every forward replaced by this call is restored before the error
propagates (TP placement is not undone: rebuild the model after a TP failure).

With cp > 1 the CP preflight proof (:func:`~.context_parallel.model_proof.prove_cp_model`) runs by
default, so a model CP would compute wrongly (an undeclared token mixer, an attention semantic a
method drops) is refused here instead of returning wrong numbers; ``preflight_proof=False`` opts out.

Modes: ``production`` runs the CP path; ``validate`` additionally runs each wrapped module's
original path on the CP-gathered input and raises on mismatch (see
:mod:`~.context_parallel.wrappers`). Outputs and gradients are identical in both modes.
"""
from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

import torch.nn as nn

from ..context_parallel.interception import applying
from ..context_parallel.interception.model_mask import install_no_model_mask
from ..context_parallel.meta import cp_batch_context, current_cp_batch_meta
from ..context_parallel.mixers.layout import on_contiguous_layout
from ..context_parallel.mixers.rows import documents_alone
from ..context_parallel.model_proof import NO_INSTANCE_FORWARD
from ..context_parallel.rope import check_rotary_modules, find_rotary_modules, install_cp_rope
from ..context_parallel.vision import install_block_input_guard, vision_tower
from ..errors import CPConfigError
from .planner import ShardingPlan
from ..tensor_parallel import TPGradInfo, apply_tensor_parallel, replicated_grad_info

log = logging.getLogger("hyper_parallel.apply")

MODES = ("production", "validate")
_MISSING = NO_INSTANCE_FORWARD     # no instance forward before CP (shared with the preflight proof)


class _Installed:
    """Undo record of forwards replaced by one apply call."""

    def __init__(self):
        self.items: list[tuple[nn.Module, object, list]] = []

    def replace_forward(self, module: nn.Module, fn: Callable, undo: Optional[list] = None) -> None:
        prev = module.__dict__.get("forward", _MISSING)
        module.forward = fn
        self.items.append((module, prev, list(undo or [])))

    def record_external(self, module: nn.Module, prev) -> None:
        self.items.append((module, prev, []))

    def rollback(self) -> None:
        for module, prev, undo in reversed(self.items):
            for u in reversed(undo):
                try:
                    u()
                except Exception:  # noqa: BLE001 - best effort, keep restoring
                    log.exception("rollback step failed")
            if prev is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.forward = prev
            if "__hp_cp_wrapped__" in module.__dict__:
                del module.__dict__["__hp_cp_wrapped__"]
            module.__dict__.pop("__hp_cp_prev_forward__", None)
        self.items.clear()


def _mesh_axes(mesh, plan: ShardingPlan):
    if mesh is None:
        return None, None, None
    tp_mesh = mesh.tp_mesh if plan.tp_size > 1 else None
    cp_mesh = mesh.cp_mesh if plan.cp_size > 1 else None
    ep_mesh = getattr(mesh, "ep_mesh", None) if plan.ep_size > 1 else None
    return tp_mesh, cp_mesh, ep_mesh


def _install_cp(model, plan: ShardingPlan, mesh, mode: str, installed: _Installed) -> None:
    tp_mesh, cp_mesh, ep_mesh = _mesh_axes(mesh, plan)
    for t in plan.cp_targets:
        module = t.inner_module
        field = t.spec.field(t.kind)
        if module.__dict__.get("__hp_cp_wrapped__"):
            raise CPConfigError(field, f"already wrapped by {module.__hp_cp_wrapped__}", module=t.fqn,
                                fix="apply a plan to a fresh model (one wrapper per attention)")
        prev_entry = module.__dict__.get("forward", _MISSING)   # the original, for the CP preflight proof
        if t.kind == "local_compute_fn":
            # fn(module, *forward_args, cp_mesh=<1-D cp DeviceMesh>, **named_params, **forward_kwargs)
            installed.replace_forward(module, functools.partial(t.fn, module, cp_mesh=cp_mesh, **t.params))
        else:
            prev = module.__dict__.get("forward", _MISSING)
            prev_forward = module.forward
            try:
                with applying(t.inner_fqn, mode):
                    if plan.cp_size == 1 and t.info is not None and t.info.mixer and not t.info.at_cp1:
                        unread = tuple(k for k, v in (t.info.seq_dims or {}).items() if v is None)
                        ret = documents_alone(module, t.inner_fqn, unread)   # independent documents, a CP group of one
                    else:
                        ret = t.fn(module, mesh, tp_mesh, cp_mesh, ep_mesh, **t.params)
            except CPConfigError:
                raise
            except (ValueError, TypeError) as exc:
                raise CPConfigError(field, f"{t.spec.inner_wrapper.describe()}: {exc}", module=t.fqn) from exc
            except Exception as exc:  # noqa: BLE001 - any failure of a wrapper's installation names its entry
                raise CPConfigError(field, f"{t.spec.inner_wrapper.describe()} failed to install: "
                                    f"{type(exc).__name__}: {exc}", module=t.fqn) from exc
            if ret is not None:
                if not callable(ret):
                    raise CPConfigError(field, f"{t.spec.inner_wrapper.describe()} returned a "
                                        f"{type(ret).__name__}, expected a forward callable or None", module=t.fqn)
                if t.info is not None and t.info.mixer:     # a permuted batch reaches it in the contiguous layout
                    ret = on_contiguous_layout(ret, module, cp_mesh, t.info.seq_dims, t.fqn)
                installed.replace_forward(module, ret, getattr(ret, "__hp_undo__", None))
            else:
                installed.record_external(module, prev)
                if module.forward == prev_forward:
                    raise CPConfigError(field, f"{t.spec.inner_wrapper.describe()} returned None but did not "
                                        "replace the module's forward", module=t.fqn,
                                        fix="return the replacement forward, or assign target_module.forward")
                if t.info is not None and t.info.mixer:
                    module.forward = on_contiguous_layout(module.forward, module, cp_mesh, t.info.seq_dims,
                                                          t.fqn)
        module.__hp_cp_wrapped__ = (t.spec.inner_wrapper or t.spec.local_compute_fn).describe()
        module.__dict__["__hp_cp_prev_forward__"] = prev_entry
        log.info("CP: %s", t.describe())


def _checkpointed_forward(original: Callable) -> Callable:
    from torch.utils.checkpoint import checkpoint

    def forward(*args, **kwargs):
        meta = current_cp_batch_meta(required=False)

        def run(*a, **kw):
            if meta is None:
                return original(*a, **kw)
            with cp_batch_context(meta):     # recomputation in backward sees this step's CP meta
                return original(*a, **kw)

        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    forward.__wrapped__ = original
    return forward


def _no_layers(field: str, model) -> CPConfigError:
    declared = getattr(model, "_no_split_modules", None)
    return CPConfigError(field, f"no decoder layers found in {type(model).__name__} (_no_split_modules="
                         f"{sorted(declared) if declared else declared!r} matches no ModuleList entry, and no "
                         "ModuleList of *DecoderLayer/*Block/self_attn children exists)",
                         fix="declare the layer class in the model's _no_split_modules, or turn the option off")


def _apply_ac(model, plan: ShardingPlan, installed: _Installed) -> None:
    """Checkpoint every decoder layer (recomputed in backward under this step's CP meta). Like
    transformers' gradient checkpointing, turns ``config.use_cache`` off: a KV cache updated by the
    forward and again by the recomputation would see its keys twice."""
    names = dict(model.named_modules())
    layers = plan.decoder_layers
    if not layers:
        raise _no_layers("schedule.activation_checkpointing", model)
    cfg = getattr(model, "config", None)
    if getattr(cfg, "use_cache", False):
        log.info("activation checkpointing: config.use_cache set to False")
        cfg.use_cache = False
    for fqn in layers:
        layer = names[fqn]
        installed.replace_forward(layer, _checkpointed_forward(layer.forward))


def _install_ep(model, plan: ShardingPlan, mesh, installed: _Installed) -> None:
    """Split the experts of every :attr:`ShardingPlan.ep_targets` module over ``mesh.ep_mesh``. Like TP
    placement, the split is not undone by a rollback (rebuild the model after a failure)."""
    from ..expert_parallel import install_experts

    if mesh is None or mesh.ep_mesh is None:
        raise CPConfigError("accelerator.ep_size", f"the plan splits experts over ep_size={plan.ep_size} but the "
                            "MeshContext has no EP mesh", fix="build the mesh from the same accelerator config")
    install_experts(model, plan.ep_targets, mesh.ep_mesh, installed.replace_forward)


def _apply_fsdp(model, plan: ShardingPlan, mesh, mp_policy, reshard_after_forward: bool) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    fsdp_mesh = mesh.fsdp_mesh
    kwargs = dict(mesh=fsdp_mesh, mp_policy=mp_policy or MixedPrecisionPolicy(),
                  reshard_after_forward=reshard_after_forward)
    names = dict(model.named_modules())
    for t in plan.ep_targets:   # experts: sharded over the ranks holding the same experts (DTensors on ep)
        fully_shard(names[t.fqn], **dict(kwargs, mesh=mesh.experts_fsdp_mesh))
    embed, head = _untied_embeddings(model, plan.decoder_layers)
    if embed is not None:       # its own unit: unsharded only around its forward and its backward
        fully_shard(embed, **kwargs)
    for fqn in plan.decoder_layers:
        fully_shard(names[fqn], **kwargs)
    if head is not None:        # its own unit, kept unsharded from its forward into its backward (the next step)
        fully_shard(head, **dict(kwargs, reshard_after_forward=False))
    tower = vision_tower(model)  # replicated: each rank runs it on its own media only (no collective to join)
    ignored = {p for n, p in model.named_parameters() if tower.holds(n)} if tower is not None else set()
    fully_shard(model, **kwargs, **({"ignored_params": ignored} if ignored else {}))


def _untied_embeddings(model, layers=()) -> tuple:
    """(input embedding, output head) modules that get FSDP units of their own, or None each.

    In the root unit both would stay unsharded from the start of the forward to the end of the
    backward (FSDP2 does not reshard the root after forward), so every rank would hold the full
    vocabulary matrices at its peak whatever the FSDP size. As their own units the embedding is
    unsharded only around its forward and backward, the head from the end of the forward (the tiled
    loss) into its backward. Tied weights (one Parameter in both) stay in the root: a parameter
    belongs to one unit; so do modules inside a decoder layer (``layers``: their FQNs) or not
    declared by the model (``get_*_embeddings`` missing or raising)."""
    try:
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None, None
    if embed is None or head is None or embed is model or head is model or embed is head:
        return None, None
    w_in, w_out = getattr(embed, "weight", None), getattr(head, "weight", None)
    if not isinstance(w_in, nn.Parameter) or not isinstance(w_out, nn.Parameter) or w_in is w_out:
        return None, None
    fqn = {id(m): n for n, m in model.named_modules()}
    for m in (embed, head):
        name = fqn.get(id(m))
        if name is None or any(name == f or name.startswith(f + ".") for f in layers):
            return None, None
    return embed, head


def _check_rope_unwrapped(model, cp_size: int, installed: _Installed) -> None:
    """The RoPE preflight on a model whose rotary modules already carry the CP forward (meta
    build: probed once values exist): each rotary module's pre-CP forward is put back for the probe."""
    rotary = {id(m) for _, m in find_rotary_modules(model)}
    saved = []
    for module, prev, _ in installed.items:
        if id(module) in rotary:
            saved.append((module, module.__dict__.get("forward", _MISSING)))
            if prev is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.forward = prev
    try:
        check_rotary_modules(model, cp_size)
    finally:
        for module, fwd in reversed(saved):
            if fwd is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.forward = fwd


def _reshard(model) -> None:
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _prove(model, plan: ShardingPlan, mesh, preflight_proof) -> None:
    from ..context_parallel.model_proof import prove_cp_model

    prove_cp_model(model, plan, mesh, **(preflight_proof if isinstance(preflight_proof, dict) else {}))


def apply_sharding_plan(model: nn.Module, plan: ShardingPlan, device_mesh=None, *, mode: str = "production",
                        fsdp: Optional[bool] = None, mp_policy=None, reshard_after_forward: bool = True,
                        activation_checkpointing: bool = False,
                        preflight_proof=True,
                        materialize: Optional[Callable[[nn.Module], object]] = None) -> tuple[nn.Module, TPGradInfo]:
    """Apply TP -> CP -> activation checkpointing -> FSDP2; return ``(model, tp_grad_info)``.

    ``preflight_proof``: True (default), False, or a dict of
    :func:`~.context_parallel.model_proof.prove_cp_model` options — when cp > 1, prove before FSDP
    (fp32 master weights; after ``materialize`` for a meta build) that the model computes under CP
    what it computes without it; a refusal rolls the CP install back and raises
    :class:`~.errors.CPConfigError` on every rank. The proof needs nothing from the caller (it
    builds its own probe batch); a model it cannot run (no vocabulary size, a forward that does not
    take ``input_ids``) is refused too, never applied unproved. ``preflight_proof=False`` is the
    opt-out: the caller then vouches for every token mixer and attention semantic of the model.

    ``materialize``: for a model built on the ``meta`` device — ``materialize(model)`` runs after
    FSDP (last step), so each rank allocates and fills only its own shards (TP slices, FSDP
    chunks); the checks that need values (the RoPE probe, the CP preflight proof) then run on the
    materialized, sharded model instead of before TP / FSDP.

    ``device_mesh``: the :class:`~.mesh.MeshContext` (required unless tp = cp = 1 and fsdp off).
    ``fsdp``: None = on when ``mesh.fsdp_mesh`` has more than one rank. ``mp_policy``: an FSDP2
    ``MixedPrecisionPolicy`` (default: none). ``tp_grad_info``: a :class:`~.tensor_parallel.TPGradInfo`.
    """
    if mode not in MODES:
        raise CPConfigError("mode", f"unknown apply mode {mode!r}", fix=f"use one of {MODES}")
    if not isinstance(preflight_proof, (bool, dict)):
        raise CPConfigError("preflight_proof", f"expected True, False or a dict of prove_cp_model options, got "
                            f"{type(preflight_proof).__name__}", fix="pass True (default), False or a dict")
    prove = preflight_proof is not False     # {} = the proof with its default options
    mesh = device_mesh
    if mesh is not None and not hasattr(mesh, "cp_mesh"):
        raise CPConfigError("device_mesh", f"expected the MeshContext (DistributedSetup.mesh), got "
                            f"{type(mesh).__name__}")
    if mesh is None and (plan.tp_size > 1 or plan.cp_size > 1 or fsdp):
        raise CPConfigError("device_mesh", "a MeshContext is required when tp_size > 1, cp_size > 1 or fsdp=True")
    if mesh is not None:
        s = mesh.sizes
        for name, want, have in (("cp_size", plan.cp_size, s.cp), ("tp_size", plan.tp_size, s.tp)):
            if want != have:
                raise CPConfigError(f"accelerator.{name}", f"the plan was made for {name}={want} but the mesh has "
                                    f"{have}")
        degrees = plan.hybrid_degrees()
        if degrees:
            mesh.ensure_hybrid(degrees)   # set-up time, collective; no-op when already built

    # 0. RoPE preflight (local, deterministic: every rank reaches the same verdict); a meta-built
    # model has no buffer values yet: probed after materialization (step 5)
    if plan.cp_size > 1 and materialize is None:
        check_rotary_modules(model, plan.cp_size)

    # 1. TP placement
    if plan.tp_size > 1:
        tp_info = apply_tensor_parallel(model, mesh.tp_mesh, plan.decoder_layers, plan.tp_layer_plan)
    else:
        tp_info = replicated_grad_info(model)

    installed = _Installed()
    try:
        # 2. declared CP methods
        _install_cp(model, plan, mesh, mode, installed)
        # 2b. rotary embeddings computed on the batch's global positions, this rank's slice kept
        if plan.cp_size > 1:
            install_cp_rope(model, installed.replace_forward)
            # 2c. no model-level attention mask where every CP method ignores it (DSA, Doge)
            install_no_model_mask(model, installed.replace_forward)
        # 2d. a VLM's bidirectional-visibility input (Gemma 3's token_type_ids) only as batch block ids,
        # wherever a CP batch meta can be current (a CP group of one included); a pass-through without one
        install_block_input_guard(model, installed.replace_forward)
        # 3. activation checkpointing
        if activation_checkpointing:
            _apply_ac(model, plan, installed)
        # 3b. CP preflight proof (collective on every rank; before FSDP, so in the parameters' dtype)
        if prove and plan.cp_size > 1 and materialize is None:
            _prove(model, plan, mesh, preflight_proof)
        # 3c. expert parallelism: each rank keeps its experts, routed rows exchanged by all-to-all
        if plan.ep_targets:
            _install_ep(model, plan, mesh, installed)
        # 4. FSDP2 / HSDP
        use_fsdp = fsdp if fsdp is not None else (mesh is not None and mesh.fsdp_mesh.size() > 1)
        if use_fsdp:
            if not plan.decoder_layers:
                raise _no_layers("fsdp", model)
            _apply_fsdp(model, plan, mesh, mp_policy, reshard_after_forward)
        # 5. meta build: each rank materializes its own shards, then the value checks run
        if materialize is not None:
            materialize(model)
            if plan.cp_size > 1:
                _check_rope_unwrapped(model, plan.cp_size, installed)
                if prove:
                    _prove(model, plan, mesh, preflight_proof)
                    _reshard(model)   # the proof's forward left the FSDP root unsharded (full embedding/head)
    except BaseException:
        installed.rollback()
        raise
    return model, tp_info
