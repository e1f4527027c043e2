"""What expert parallelism costs per rank (``--explain`` and benchmarks/expert_parallel.py).

Uniform routing: each of a rank's ``tokens x top_k`` (token, choice) rows goes to the rank holding
its expert, another rank with probability ``(ep - 1) / ep``. Per MoE layer and micro-batch the
forward sends that many rows of ``hidden x elem`` bytes out (dispatch) and as many back (combine);
the backward does both again (recomputed forwards add a forward's worth). Dropless routing can send
one rank every row of the group (``ep x`` its share): :meth:`EPCost.worst_recv_rows` bounds the
receive buffer.
"""
from __future__ import annotations

import dataclasses

import torch.nn as nn


@dataclasses.dataclass(frozen=True)
class EPCost:
    layers: int                 # experts modules split over ep
    experts: int                # experts per module
    ep: int
    top_k: int
    hidden: int
    elem: int                   # bytes per activation element
    expert_bytes: float         # every experts module's parameters, all experts
    layer_expert_bytes: float   # the largest experts module, all experts (what FSDP alone gathers per layer)

    @property
    def experts_per_rank(self) -> int:
        return self.experts // self.ep

    def rows(self, tokens: int) -> int:
        """(token, choice) rows a rank routes per layer for ``tokens`` tokens per micro-batch."""
        return tokens * self.top_k

    def sent_per_layer(self, tokens: int) -> float:
        """Bytes a rank sends per layer and micro-batch in the forward (dispatch + combine)."""
        return 2 * self.rows(tokens) * self.hidden * self.elem * (self.ep - 1) / self.ep

    def worst_recv_rows(self, tokens: int) -> int:
        """Every row of the EP group routed to this rank's experts."""
        return self.rows(tokens) * self.ep


def ep_cost(model: nn.Module, targets: list, ep: int, elem: int) -> EPCost | None:
    """The figures above for ``model``'s EP ``targets``; None without EP targets."""
    if not targets:
        return None
    modules = dict(model.named_modules())
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    sizes = [sum(p.numel() * p.element_size() for p in modules[t.fqn].parameters()) for t in targets]
    return EPCost(layers=len(targets), experts=targets[0].num_experts, ep=ep,
                  top_k=int(getattr(text, "num_experts_per_tok", 1) or 1), hidden=int(text.hidden_size), elem=elem,
                  expert_bytes=float(sum(sizes)), layer_expert_bytes=float(max(sizes)))
