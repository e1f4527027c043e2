"""ShardingPlanner: plan_overrides + topology -> ShardingPlan (module specs + explicit CP intent).

The planner identifies boundaries (attention modules, decoder layers) and TP placements; it
never picks a CP method — each attention boundary's method is exactly what ``plan_overrides``
declares (:class:`~.resolver.PlanOverrideResolver`), then the refusals of :mod:`.rules` that
need the whole plan or the topology. Usage::

    plan = ShardingPlanner(plan_overrides={
        "model.layers.*.self_attn": ModuleShardingSpec(inner_target="self", inner_wrapper="sdpa_hf",
                                                       region_dispatch=False, when="cp"),
    }).plan(model, mesh, tp_size=1, cp_size=2, ep_size=1, sequence_parallel=False, loss_parallel=False)
    model, tp_grad_info = apply_sharding_plan(model, plan, mesh)   # proves the CP model (opt-out:
                                                                   # preflight_proof=False)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch.nn as nn

from ..context_parallel import catalogue
from ..context_parallel.balance.cost import profile_from_config
from ..context_parallel.balance.split import BalancedSplit
from ..context_parallel.meta import PACKED_DOCUMENTS
from ..context_parallel.model_spec import get_cp_model_spec, model_architecture
from ..errors import CPConfigError
from ..expert_parallel import find_ep_targets
from ..tensor_parallel import find_decoder_layers
from . import rules
from .resolver import PlanOverrideResolver, ResolvedPlan
from .spec import parse_plan_overrides

__all__ = ["ShardingPlan", "ShardingPlanner"]


@dataclasses.dataclass
class ShardingPlan:
    """What :func:`~.applier.apply_sharding_plan` applies, in order TP -> CP -> AC -> FSDP."""

    module_specs: dict                 # attention FQN -> the declared ModuleShardingSpec (explicit CP intent)
    cp_targets: list                   # list[ResolvedCPTarget]: fn, params, inner module per boundary
    resolved: ResolvedPlan             # the resolver's result (boundaries, skipped entries, summary)
    attention_boundaries: list         # every attention boundary FQN found in the model
    decoder_layers: list               # decoder-layer FQNs (TP / activation checkpointing / FSDP units)
    tp_layer_plan: dict                # decoder-layer-relative FQN -> "colwise" | "rowwise" ({} when tp 1)
    tp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    sequence_parallel: bool = False
    loss_parallel: bool = False
    batch_policy: Any = None  # shard_batch_for_cp policy (a string, or BalancedSplit with the model's profile; None cp 1)
    batch_prepare_fn: Optional[Callable] = None  # from a registered model spec, if any
    architecture: Optional[str] = None
    packed_documents: Optional[str] = None  # what a packed row means (context_parallel.meta.PACKED_DOCUMENTS)
    ep_targets: list = dataclasses.field(default_factory=list)  # list[EPTarget]: experts modules split over ep

    def hybrid_degrees(self) -> list[int]:
        return self.resolved.hybrid_degrees()

    def summary(self) -> str:
        lines = [f"sharding plan: arch={self.architecture} tp={self.tp_size} cp={self.cp_size} ep={self.ep_size} "
                 f"decoder_layers={len(self.decoder_layers)} batch_policy={self.batch_policy}"]
        if self.tp_layer_plan:
            lines.append("  TP per layer: " + ", ".join(f"{k}={v}" for k, v in self.tp_layer_plan.items()))
        if self.ep_targets:
            t = self.ep_targets[0]
            lines.append(f"  EP: {len(self.ep_targets)} experts module(s) ({t.fqn}, ...), {t.num_experts} experts, "
                         f"{t.num_experts // self.ep_size} per rank, tokens by all-to-all (dropless)")
        lines.append(self.resolved.summary())
        from ..context_parallel.wrappers.heads import head_layout_lines   # lazy: the planner does not import wrappers

        lines += head_layout_lines(self.cp_targets, self.cp_size, self.tp_size)   # Ulysses/Hybrid per-rank heads
        return "\n".join(lines)


class ShardingPlanner:
    """``ShardingPlanner(plan_overrides=...)``: the YAML list, the mapping form, or specs
    (normalised by :func:`~.spec.parse_plan_overrides`)."""

    def __init__(self, plan_overrides: Any = None, packed_documents: Optional[str] = None,
                 documents_field: str = "data.packed_documents"):
        if packed_documents not in (None,) + PACKED_DOCUMENTS:
            raise CPConfigError(documents_field, f"must be one of {list(PACKED_DOCUMENTS)}, got {packed_documents!r}")
        self.specs = parse_plan_overrides(plan_overrides)
        self.packed_documents = packed_documents
        self.documents_field = documents_field      # where the caller declares it (messages name it)

    def plan(self, model: nn.Module, device_mesh=None, *, tp_size: int = 1, cp_size: int = 1, ep_size: int = 1,
             sequence_parallel: bool = False, loss_parallel: bool = False, packed_rows: bool = False) -> ShardingPlan:
        """Resolve ``plan_overrides`` on ``model`` and check everything that needs the topology.

        ``device_mesh`` (a MeshContext, optional) must have been built with the same degrees.
        Runs :func:`.rules.check_topology`, :meth:`.resolver.PlanOverrideResolver.resolve`
        (global heads), :func:`.rules.tp_layer_plan`, :func:`.rules.check_target` on every target
        (TP-local heads with ``tp_size``, probe off) and :func:`.rules.batch_policy`. Local
        only: no collective, the model is not modified (``apply_sharding_plan`` applies the
        result). Raises :class:`~..errors.CPConfigError` naming the field, module and fix.

        ``packed_documents`` (:data:`~..context_parallel.meta.PACKED_DOCUMENTS`): what a packed row
        means; ``independent`` binds every declared method at cp_size 1 too (a CP group of one).
        ``packed_rows``: the rows will hold several documents, so a model whose result depends on
        the meaning (:func:`.rules.documents_matter`) needs it declared.
        """
        rules.check_topology(tp_size, cp_size, ep_size, sequence_parallel, loss_parallel, device_mesh)
        ep_targets = find_ep_targets(model, ep_size)
        rules.check_routing_noise(model, cp_size, ep_size)
        resolved = PlanOverrideResolver(self.specs, cp_size, self.packed_documents).resolve(model)
        if packed_rows and self.packed_documents is None:
            matter = rules.documents_matter(model, resolved)
            if matter:
                raise CPConfigError(
                    self.documents_field, f"the rows pack several documents, and {', '.join(matter[:3])}"
                    f"{' and others' if len(matter) > 3 else ''} compute differently whether each document is "
                    "independent or the packed row runs as plain transformers runs it",
                    fix=f"declare {self.documents_field}: {' | '.join(PACKED_DOCUMENTS)} (docs/wrappers.md, "
                        "\"Packed documents\")")
        arch = model_architecture(model)
        layers = find_decoder_layers(model)
        tp_plan = rules.tp_layer_plan(model, layers, tp_size, arch)
        spec = get_cp_model_spec(model)
        for t in resolved.targets:
            rules.check_target(t, spec, arch, cp_size, tp_size)
        policy = rules.batch_policy(resolved.targets, cp_size)
        if catalogue.token_layout(policy) == catalogue.BALANCED:   # balanced on this model's attention layers' work
            policy = BalancedSplit(profile_from_config(getattr(model, "config", None)))
        return ShardingPlan(
            module_specs={t.fqn: t.spec for t in resolved.targets},
            cp_targets=list(resolved.targets), resolved=resolved,
            attention_boundaries=list(resolved.boundaries), decoder_layers=layers, tp_layer_plan=tp_plan,
            tp_size=tp_size, cp_size=cp_size, ep_size=ep_size, sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel, batch_policy=policy,
            batch_prepare_fn=spec.batch_prepare_fn if spec is not None else None, architecture=arch,
            packed_documents=self.packed_documents, ep_targets=ep_targets)
