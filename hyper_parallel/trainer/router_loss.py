"""The MoE router load-balancing loss of the model's own objective, exact under CP and DP.

Transformers' MoE causal LMs (Qwen3-MoE, Mixtral, ...) add, when their config sets
``output_router_logits: true``, ``router_aux_loss_coef * aux`` to the token loss, with
:func:`transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func`::

    f_e = (sum over layers l and valid tokens t of [e in top_k(softmax(g_lt))]) / R
    P_e = (sum over layers l and valid tokens t of softmax(g_lt)_e) / R
    aux = num_experts * sum_e f_e * P_e          R = num_layers x valid tokens

``aux`` is a product of two sequence-wide means, so the mean of per-CP-rank losses is **not** the
loss of the whole sequence. Here every rank computes its local sums (``counts_e``, ``probsum_e``,
``R``) over its own *valid input* tokens (padding and CP padding excluded: ``key_doc >= 0`` of the
batch meta; packed documents are all valid, as with transformers' attention_mask at CP=1), one
differentiable SUM all-reduce (:func:`~hyper_parallel.distributed.context_parallel.collectives.
all_reduce_sum_replicated`: identity backward) forms the global sums, and every rank computes the
same ``aux``. Only ``P_e`` carries gradient (``f_e`` comes from top-k), into the router weights and
everything below them, exactly as at CP=1.

Reduction domain (``loss.router_balance_domain``):

* ``global_micro_batch`` (default): statistics over ``dp_cp_mesh`` — micro-batch ``i`` of the step
  on every DP rank and CP rank together, i.e. CP=1 on one rank with the DP ranks' rows
  concatenated (the trainer's CP=1 reference). One all-reduce of ``2E+1`` floats per micro-batch.
* ``local_micro_batch``: statistics over the CP group only — each DP rank balances its own rows
  (what an unmodified per-rank ``model(labels=...)`` with DDP does); the step's router loss is the
  mean over DP ranks.

Gradient accumulation: ``aux`` is formed per micro-batch (never across micro-batches) and the
step's router loss is the **mean** over its ``grad_accum_steps`` micro-batches; at GA=1 the
objective is exactly ``model(labels=..., num_items_in_batch=N).loss`` of the whole batch. Each
rank adds ``coef * aux / GA [/ dp] * grad_scale`` to its backward loss, so the trainer's gradient
reduction (SUM, or FSDP's average with ``grad_scale``) yields ``d(coef * mean aux)/d(theta)``.

No router z-loss is defined by the supported architectures (Qwen3-MoE, Mixtral); a config that
sets a non-zero ``router_z_loss_coef`` is refused rather than silently ignored.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..distributed.errors import CPConfigError

__all__ = ["RouterLossSpec", "router_loss_spec", "router_spec", "RouterStats", "local_router_stats", "router_aux_from_stats",
           "domain_sums", "stage_router_stats", "DOMAINS"]

DOMAINS = ("global_micro_batch", "local_micro_batch")


@dataclasses.dataclass(frozen=True)
class RouterLossSpec:
    """What the model's config declares: its router loss is on, with these constants."""
    num_experts: int
    top_k: int
    coef: float
    domain: str = "global_micro_batch"


def _text_config(model):
    cfg = getattr(model, "config", None)
    return getattr(cfg, "get_text_config", lambda: cfg)() if cfg is not None else None


def router_loss_spec(model, loss_cfg) -> RouterLossSpec | None:
    """The router loss the model's own forward with labels would add, or None (no MoE router loss:
    ``loss.router_loss`` off, or the model config does not set ``output_router_logits``).

    Raises :class:`CPConfigError` (same on every rank: it reads only the config) for a config that
    asks for a router loss the trainer cannot reproduce."""
    if not getattr(loss_cfg, "router_loss", True):
        return None
    text = _text_config(model)
    if text is None or not getattr(text, "output_router_logits", False):
        return None
    arch = getattr(text, "model_type", type(model).__name__)
    z = getattr(text, "router_z_loss_coef", None)
    if z:
        raise CPConfigError("model.config.router_z_loss_coef", f"{arch}: a router z-loss ({z}) is not "
                            "implemented by the trainer", fix="set router_z_loss_coef: 0 or loss.router_loss: false")
    n_exp = None
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        n_exp = getattr(text, name, None)
        if n_exp:
            break
    top_k = getattr(text, "num_experts_per_tok", None)
    coef = getattr(text, "router_aux_loss_coef", None)
    if not n_exp or not top_k or coef is None:
        raise CPConfigError("model.config.output_router_logits",
                            f"{arch} sets output_router_logits but declares no num_experts / num_local_experts "
                            f"({n_exp}), num_experts_per_tok ({top_k}) or router_aux_loss_coef ({coef})",
                            fix="set those fields or output_router_logits: false")
    domain = getattr(loss_cfg, "router_balance_domain", "global_micro_batch")
    if domain not in DOMAINS:
        raise CPConfigError("loss.router_balance_domain", f"unknown domain {domain!r}", fix=f"use one of {DOMAINS}")
    return RouterLossSpec(int(n_exp), int(top_k), float(coef), domain)


def router_spec(trainer) -> RouterLossSpec | None:
    """:func:`router_loss_spec` of ``trainer.model`` / ``trainer.cfg.loss``, computed once per trainer
    (cached as ``trainer._router_spec``)."""
    spec = getattr(trainer, "_router_spec", _UNSET)
    if spec is _UNSET:
        spec = router_loss_spec(trainer.model, trainer.cfg.loss)
        trainer._router_spec = spec
    return spec


_UNSET = object()


@dataclasses.dataclass
class RouterStats:
    """Sums over layers and valid tokens: ``counts [E]`` (no grad), ``prob_sum [E]`` (grad),
    ``rows`` (scalar, no grad) — local before :func:`router_aux_from_stats` reduces them."""
    counts: torch.Tensor
    prob_sum: torch.Tensor
    rows: torch.Tensor


def valid_input_mask(prepared, device) -> torch.Tensor | None:
    """[B * S_local] float mask of this rank's *input* tokens that are real (not padding, not CP
    padding), from the batch meta's ``key_doc`` (global, ``-1`` = padding); None = all valid."""
    local = getattr(prepared, "local", None)
    meta = getattr(local, "meta", None) if local is not None else None
    meta = meta if meta is not None else getattr(prepared, "meta", None)
    key_doc = getattr(meta, "key_doc", None)
    if key_doc is None:
        return None
    kd = meta.doc_slice(meta.q_index)                 # this rank's tokens (contiguous or balanced split)
    return (kd >= 0).reshape(-1).to(device=device, dtype=torch.float32)


def local_router_stats(router_logits, spec: RouterLossSpec, mask: torch.Tensor | None) -> RouterStats:
    """This rank's sums (module doc) from the model's ``router_logits`` (one ``[T_local, E]`` per
    MoE layer, T_local = B x S_local in row-major order), ``mask`` from :func:`valid_input_mask`."""
    if not isinstance(router_logits, (tuple, list)) or not router_logits:
        raise RuntimeError("router loss: the model returned no router_logits although its config sets "
                           "output_router_logits (set loss.router_loss: false to train without it)")
    E, k = spec.num_experts, spec.top_k
    dev = router_logits[0].device
    counts = torch.zeros(E, dtype=torch.float32, device=dev)
    prob_sum = torch.zeros(E, dtype=torch.float32, device=dev)
    rows = torch.zeros((), dtype=torch.float32, device=dev)
    for layer, g in enumerate(router_logits):
        if g.dim() != 2 or g.shape[-1] != E:
            raise RuntimeError(f"router loss: router_logits[{layer}] has shape {tuple(g.shape)}, expected "
                               f"[tokens, {E}] (model.config num_experts)")
        if mask is not None and mask.numel() != g.shape[0]:
            raise RuntimeError(f"router loss: router_logits[{layer}] has {g.shape[0]} rows, the batch shard "
                               f"{mask.numel()} tokens")
        probs = torch.softmax(g.to(dev).float(), dim=-1)
        sel = torch.topk(probs.detach(), k, dim=-1).indices.reshape(-1)
        w = (torch.ones(sel.numel(), dtype=torch.float32, device=dev) if mask is None
             else mask.to(dev).repeat_interleave(k))
        counts = counts + torch.zeros(E, dtype=torch.float32, device=dev).scatter_add_(0, sel, w)
        if mask is None:
            prob_sum = prob_sum + probs.sum(dim=0)
            rows = rows + g.shape[0]
        else:
            prob_sum = prob_sum + (probs * mask.to(dev).unsqueeze(-1)).sum(dim=0)
            rows = rows + mask.sum()
    return RouterStats(counts, prob_sum, rows)


def _group(mesh):
    """The process group of ``mesh`` (a 1-D DeviceMesh, or a process group itself); None when alone."""
    if mesh is None or not dist.is_initialized():
        return None
    group = mesh.get_group() if hasattr(mesh, "get_group") else mesh
    return None if dist.get_world_size(group) == 1 else group


def domain_sums(stats: RouterStats, spec: RouterLossSpec, mesh, tag: str = "router_loss.stats") -> RouterStats:
    """``stats`` summed over the domain ``mesh`` (one all-reduce; ``prob_sum`` keeps its gradient
    through the identity-backward sum, every rank of the domain holding the same sums)."""
    from ..distributed.context_parallel.collectives import all_reduce_sum_replicated

    E = spec.num_experts
    packed = torch.cat([stats.counts.detach(), stats.prob_sum, stats.rows.detach().reshape(1)])
    total = all_reduce_sum_replicated(packed, _group(mesh), tag=tag)
    return RouterStats(total[:E].detach(), total[E:2 * E], total[2 * E].detach())


def stage_router_stats(spec: RouterLossSpec, mesh, masks: list):
    """For a pipeline stage (``pipeline_parallel.router``): ``stats(router_logits, microbatch)`` -> the
    ``(counts, prob_sum, rows)`` of the stage's layers summed over the domain ``mesh``
    (:func:`domain_sums`), over the valid tokens of ``masks[microbatch]`` (:func:`valid_input_mask` of
    each micro-batch of the step, filled per step)."""
    def stats(router_logits, microbatch: int):
        total = domain_sums(local_router_stats(router_logits, spec, masks[microbatch]), spec, mesh,
                            tag="router_loss.stage_stats")
        return total.counts, total.prob_sum, total.rows
    return stats


def router_aux_from_stats(stats: RouterStats, spec: RouterLossSpec, mesh) -> tuple[torch.Tensor, torch.Tensor]:
    """(differentiable ``aux`` of the domain's whole micro-batch, identical on every rank of
    ``mesh``; the domain's token counts per expert ``[E]``, detached). ``mesh``: the domain's 1-D
    mesh (``dp_cp_mesh`` or ``cp_mesh``; None = this rank alone). One all-reduce."""
    total = domain_sums(stats, spec, mesh)
    rows = total.rows.clamp(min=1.0)
    aux = (total.counts / rows * (total.prob_sum / rows)).sum() * spec.num_experts
    return aux, total.counts
