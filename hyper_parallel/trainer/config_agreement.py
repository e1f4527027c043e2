"""Every rank must run the same configuration (checked before the first model collective).

A per-rank difference in the config (another YAML, another override on one node) would pair
different collectives across ranks and hang or corrupt the run; this module turns it into one
named error on every rank.
"""
from __future__ import annotations

import hashlib
import json

import torch.distributed as dist

from ..distributed.errors import CPConfigError
from ..platform import all_gather_object

__all__ = ["section_digests", "check_same_config_on_every_rank"]


def section_digests(cfg) -> dict:
    """``{section: sha256 of its JSON}`` for every section of ``cfg.to_dict()``."""
    return {name: hashlib.sha256(json.dumps(section, sort_keys=True, default=str).encode()).hexdigest()
            for name, section in sorted(cfg.to_dict().items())}


def check_same_config_on_every_rank(cfg) -> None:
    """One object all-gather of per-section digests over the world group; on a mismatch every
    rank raises the same ``CPConfigError`` naming the first differing section and the ranks.
    No-op without a process group or with one rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    digests = section_digests(cfg)
    everyone = all_gather_object(digests)
    for name in digests:
        differ = [r for r, d in enumerate(everyone) if d.get(name) != everyone[0].get(name)]
        if differ:
            raise CPConfigError(name, f"the '{name}' section differs between ranks: rank(s) {differ} "
                                f"were launched with another '{name}' than rank 0",
                                fix="launch every rank with the same YAML and the same overrides")
