"""One pipeline stage of a Hugging Face causal LM, cut where transformers' ``base_model_pp_plan`` says.

:func:`build_stage` keeps, of ``model.model``, the embedding on the first stage, a contiguous block of
decoder layers on every stage and the final norm with the LM head on the last, and drops the rest.
Parameter names stay the full model's (``model.layers.<i>.…`` with the original ``i``, ``lm_head.weight``),
so a stage's state dict is a slice of the whole model's. The stage runs the model's own forward
(``inputs_embeds`` from the previous stage after the first), so rotary embeddings and masks are computed
in every stage from the microbatch's ``position_ids``. A model this cannot cut exactly is refused by
:func:`check_pipelinable` before anything is built. docs/pipeline_parallel.md.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ...ops.tiled_loss import head_post, tiled_lm_loss
from ..errors import CPConfigError
from .router import StageRouterLoss, carry_router_stats, check_router_logits, router_aux, routers_in

__all__ = ["StageModule", "build_stage", "check_pipelinable", "rank_stages", "stage_layers"]

#: the cut points every supported model declares in ``config.base_model_pp_plan``
PP_PLAN_KEYS = ("embed_tokens", "layers", "norm")


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The decoder layers of stage ``pp_rank``: contiguous blocks, the first ``num_layers % pp_size``
    stages one layer longer."""
    base, extra = divmod(num_layers, pp_size)
    lo = pp_rank * base + min(pp_rank, extra)
    return range(lo, lo + base + (pp_rank < extra))


def rank_stages(num_layers: int, pp_size: int, pp_rank: int, virtual: int = 1) -> list:
    """``[(stage id, its decoder layers)]`` of the stages rank ``pp_rank`` holds when the model is cut
    in ``pp_size x virtual`` stages: ``pp_rank + k * pp_size`` for ``k < virtual`` (one without
    interleaving)."""
    total = pp_size * virtual
    return [(s, stage_layers(num_layers, total, s)) for s in (pp_rank + k * pp_size for k in range(virtual))]


def _fail(field: str, msg: str, fix: str):
    raise CPConfigError(field, msg, fix=fix)


def check_pipelinable(model: nn.Module, pp_size: int) -> None:
    """Raise CPConfigError (nothing built, no collective) when ``model`` cannot be cut into
    ``pp_size`` stages that compute what the whole model computes: no ``base_model_pp_plan`` or not
    its three cut points, fewer layers than stages, tied input/output embeddings, a parameter shared
    by two layers (Zamba2's shared block), or a model-level transformation of ``inputs_embeds`` (the
    later stages' input) that is not the identity. The last stage applies the model's head
    post-processing as the trainer's tiled head does (``ops.tiled_loss.head_post``); the trainer
    proves it on a probe before anything is built (``trainer/pipeline.py``)."""
    cfg = getattr(model, "config", None)
    kind = f"{type(model).__name__} (model_type {getattr(cfg, 'model_type', '?')!r})"
    plan = getattr(cfg, "base_model_pp_plan", None)
    inner = getattr(model, "model", None)
    if not plan or tuple(plan) != PP_PLAN_KEYS or inner is None or not all(hasattr(inner, k) for k in PP_PLAN_KEYS):
        _fail("accelerator.pp_size", f"{kind} declares no pipeline cut points (config.base_model_pp_plan = {plan!r}; "
              f"expected {PP_PLAN_KEYS} on model.model)", "set accelerator.pp_size: 1 for this model")
    layers = inner.layers
    if len(layers) < pp_size:
        _fail("accelerator.pp_size", f"{kind} has {len(layers)} decoder layers, fewer than pp_size={pp_size} stages",
              f"use accelerator.pp_size <= {len(layers)}")
    if getattr(cfg, "tie_word_embeddings", False) and pp_size > 1:
        _fail("model.config.tie_word_embeddings", f"{kind} ties its input and output embeddings, which live on the "
              "first and the last stage", "untie them (model.config.tie_word_embeddings: false) or pp_size: 1")
    owner: dict = {}
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            if id(p) in owner and owner[id(p)][0] != i:
                _fail("accelerator.pp_size", f"{kind}: layers {owner[id(p)][0]} and {i} share parameter "
                      f"{owner[id(p)][1]!r}; a stage cannot hold a layer another stage updates",
                      "set accelerator.pp_size: 1 for this model")
            owner.setdefault(id(p), (i, name))
    _check_identity_path(model, kind)


@torch.no_grad()
def _check_identity_path(model: nn.Module, kind: str) -> None:
    """The model's forward with no decoder layer and no final norm must return its ``inputs_embeds``
    unchanged: a later stage feeds the previous stage's hidden states in as ``inputs_embeds``, so any
    model-level scaling there (Gemma's normalizer) would be applied once per stage. A model on the
    meta device is probed through a twin of its class with no layer and a vocabulary of 8."""
    if any(t.is_meta for t in model.parameters()):
        model = _layerless_twin(model)
    inner = model.model
    saved = inner.layers, inner.norm
    inner.layers, inner.norm = nn.ModuleList(), nn.Identity()
    try:
        p = next(model.parameters())
        x = torch.randn(1, 4, model.config.hidden_size, dtype=p.dtype, device=p.device)
        out = inner(inputs_embeds=x, position_ids=torch.arange(4, device=p.device)[None], use_cache=False)
        same = torch.equal(out.last_hidden_state, x)
    finally:
        inner.layers, inner.norm = saved
    if not same:
        _fail("accelerator.pp_size", f"{kind} transforms inputs_embeds in its own forward (outside the embedding and "
              "the layers), which every stage after the first would apply again", "set accelerator.pp_size: 1 for "
              "this model")


def _layerless_twin(model: nn.Module) -> nn.Module:
    """``type(model)`` built on the CPU from a copy of its config with no decoder layer and 8 tokens."""
    import copy

    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers, cfg.vocab_size = 0, 8
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = []
    with torch.device("cpu"):
        return type(model)(cfg).float()


class StageModule(nn.Module):
    """Rank ``pp_rank``'s part of a causal LM cut in ``pp_size x virtual`` stages (its ``model`` pruned in
    place; names kept): stages ``pp_rank + k * pp_size`` for ``k < virtual`` (one per rank without
    interleaving), their layers together under the whole model's names.

    ``forward(x, stats=None, *, position_ids, shift_labels, chunk=0)`` runs stage ``chunk`` of this rank:
    ``x`` is ``input_ids [b, L]`` for stage 0 and the previous stage's hidden states ``[b, L, H]``
    otherwise; ``L`` is the CP-local length. Returns the hidden states ``[b, L, H]``, or for the last
    stage the scalar ``loss_scale * sum`` of the token cross-entropies of ``shift_labels``
    (``ignore_index`` -100 counts 0), tiled so that no ``[L, vocab]`` logits exist; ``loss_scale`` is set
    per step by the schedule (1 / the global token count x the gradient domain's factor). With
    :attr:`router` set (the MoE router loss), ``stats`` / the second output are the router statistics
    passed between stages and the last stage adds the loss (router.py). Every stage runs through this module's own
    call (FSDP2's hooks on it unshard what the stage needs); :meth:`stages` gives the module the
    pipeline schedule calls for each."""

    def __init__(self, causal_lm: nn.Module, pp_rank: int, pp_size: int, virtual: int = 1):
        super().__init__()
        self.config = causal_lm.config
        self.pp_rank, self.pp_size, self.virtual = pp_rank, pp_size, virtual
        inner = causal_lm.model
        held = rank_stages(len(inner.layers), pp_size, pp_rank, virtual)
        self.stage_ids, chunks = [s for s, _r in held], [r for _s, r in held]
        self.is_first, self.is_last = self.stage_ids[0] == 0, self.stage_ids[-1] == pp_size * virtual - 1
        whole, layers = inner.layers, nn.ModuleList()
        for r in chunks:                      # original indices as the child names: model.layers.<i>.…
            for i in r:
                layers.add_module(str(i), whole[i])
        inner.layers = layers
        if not self.is_first:
            inner.embed_tokens = None
        if not self.is_last:
            inner.norm = nn.Identity()
        self.model = inner
        _install_output_hooks(inner)          # on every layer of the rank, before a forward runs on a subset
        self.lm_head = causal_lm.lm_head if self.is_last else None
        self.head_post = head_post(causal_lm)       # softcap / logit scale / divisor of the model's head
        # the model was pruned in place: its own forward would run this rank's layers only, silently
        causal_lm.forward = _cut_forward(type(causal_lm).__name__, pp_rank)
        self.layer_chunks = chunks
        # per stage: its layers as a list of its own (not registered: the modules are model.layers')
        self._chunk_layers = [nn.ModuleList([whole[i] for i in r]) for r in chunks]
        # per stage: the routers transformers records router_logits from (checked against each forward)
        self._routers = [routers_in(inner, c) for c in self._chunk_layers]
        self.loss_scale = 1.0
        #: the MoE router loss across stages (router.py), set by the caller when the model's objective has it
        self.router: Optional[StageRouterLoss] = None

    @property
    def base_model(self) -> nn.Module:
        """The decoder (``model``), as transformers names it: the TP / EP plans declared under the base
        model's prefix (``config.base_model_tp_plan`` / ``base_model_ep_plan``) resolve on a stage too."""
        return self.model

    def stages(self) -> list:
        """One module per stage of this rank (in stage order) whose call is ``self(..., chunk=k)``."""
        return [_StageCall(self, k) for k in range(self.virtual)]

    def forward(self, x: torch.Tensor, stats: Optional[torch.Tensor] = None, *, position_ids: torch.Tensor,
                shift_labels: torch.Tensor, chunk: int = 0):
        stage = self.stage_ids[chunk]
        first, last = stage == 0, stage == self.pp_size * self.virtual - 1
        feed = {"input_ids": x} if first else {"inputs_embeds": x}
        router = self.router
        inner = self.model
        saved = inner._modules["layers"], inner._modules["norm"]
        inner._modules["layers"] = self._chunk_layers[chunk]     # the model's own forward over this stage's layers
        if not last:
            inner._modules["norm"] = _IDENTITY
        try:
            out = inner(position_ids=position_ids, use_cache=False, **feed,
                        **({"output_router_logits": True} if router is not None else {}))
        finally:
            inner._modules["layers"], inner._modules["norm"] = saved
        h = out.last_hidden_state
        logits = None
        if router is not None:
            logits = getattr(out, "router_logits", None)
            check_router_logits(logits, self._routers[chunk], stage)
        if not last:
            return h if router is None else (h, carry_router_stats(router, logits, stats, h.device))
        head = self.lm_head
        token_loss = tiled_lm_loss(h.reshape(-1, h.shape[-1]), head.weight, head.bias, shift_labels.reshape(-1),
                                   **self.head_post)
        loss = token_loss.float().sum() * self.loss_scale
        return loss if router is None else loss + router_aux(router, logits, stats, h.device)


_IDENTITY = nn.Identity()


def _cut_forward(cls: str, pp_rank: int):
    def forward(*_args, **_kwargs):
        raise RuntimeError(f"this {cls} was cut into pipeline stages (pp rank {pp_rank} kept its part of it): run "
                           "the stage (pipeline_parallel.StageModule) through PipelineStep, not the model")
    return forward


def _install_output_hooks(inner: nn.Module) -> None:
    """transformers records outputs such as ``router_logits`` through hooks it installs on the modules
    present at a model's first forward; a stage's forward runs over one stage's layers at a time, so
    the hooks go on all of the rank's layers first."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:      # a transformers without output capturing: nothing recorded, nothing to install
        return
    if getattr(inner, "_can_record_outputs", None):
        maybe_install_capturing_hooks(inner)


class _StageCall(nn.Module):
    """Stage ``chunk`` of a :class:`StageModule` as the module a ``PipelineStage`` runs (holds no
    parameter of its own: the stage module's are updated through its call)."""

    def __init__(self, owner: StageModule, chunk: int):
        super().__init__()
        self.__dict__["owner"] = owner       # not a child: its parameters stay the owner's
        self.chunk = chunk

    def forward(self, x, stats=None, *, position_ids, shift_labels):
        return self.owner(x, stats, position_ids=position_ids, shift_labels=shift_labels, chunk=self.chunk)


def build_stage(model: nn.Module, pp_rank: int, pp_size: int, virtual: int = 1) -> StageModule:
    """Check ``model`` (:func:`check_pipelinable`, for ``pp_size x virtual`` stages) and cut rank
    ``pp_rank``'s stages out of it, in place."""
    check_pipelinable(model, pp_size * virtual)
    return StageModule(model, pp_rank, pp_size, virtual)
