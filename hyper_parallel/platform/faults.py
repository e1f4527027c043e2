"""Test hook: make one rank freeze or die at a chosen point of training.

``HYPER_PARALLEL_FAULT_INJECT="rank=1,step=2,kind=stop[,at=step|forward]"`` makes global rank
``rank`` stop itself with SIGSTOP (``kind=stop``: a frozen peer), kill itself with SIGKILL
(``kind=kill``: a dead peer) or raise :class:`InjectedFault` (``kind=raise``: an error on one
rank only, such as bad data, which its peers must learn about within seconds) when the trainer is about to run optimizer step ``step`` (1-based,
as logged): ``at=step`` (default) before the step's first collective, ``at=forward`` after the
step's token-count all-reduce, just before the first forward (so the peer's next collective is
one of FSDP2's own all-gathers rather than a hyper_parallel one), ``at=save`` in the checkpoint
save of step ``step``, just before DCP writes (the peer's next collective is one of DCP's own),
``at=setup`` (with ``step=1``) in the CLI right after the config agreement, before the trainer
builds anything (the peer's next collective is the set-up's config-digest agreement). Unset: nothing happens. The
hook exists for the peer-failure tests (``tests/foundation/test_peer_failure.py``); never set
it in a real run. A malformed value raises ``ValueError`` naming the variable. The line it prints
before a stop or kill ends with ``t=<time.time()>``: the fault time, read by the tests.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time

ENV = "HYPER_PARALLEL_FAULT_INJECT"
KINDS = ("stop", "kill", "raise")
POINTS = ("step", "forward", "save", "setup")


class InjectedFault(RuntimeError):
    """The error ``kind=raise`` raises (on the chosen rank only)."""


@dataclasses.dataclass(frozen=True)
class FaultSpec:
    rank: int
    step: int
    kind: str
    at: str = "step"


def parse_fault_spec(text: str | None) -> FaultSpec | None:
    """``"rank=1,step=2,kind=stop,at=step"`` -> :class:`FaultSpec`; empty/None -> None."""
    if not text or not text.strip():
        return None
    fields: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{ENV}={text!r}: expected key=value items, got {item!r}")
        fields[key.strip()] = value.strip()
    unknown = set(fields) - {"rank", "step", "kind", "at"}
    missing = {"rank", "step", "kind"} - set(fields)
    if unknown or missing:
        raise ValueError(f"{ENV}={text!r}: unknown keys {sorted(unknown)}, missing keys {sorted(missing)} "
                         f"(want rank=R,step=S,kind=stop|kill|raise[,at=step|forward|save|setup])")
    spec = FaultSpec(int(fields["rank"]), int(fields["step"]), fields["kind"], fields.get("at", "step"))
    if spec.kind not in KINDS or spec.at not in POINTS or spec.step < 1 or spec.rank < 0:
        raise ValueError(f"{ENV}={text!r}: kind must be one of {KINDS}, at one of {POINTS}, step >= 1, rank >= 0")
    return spec


def maybe_inject_fault(rank: int, step: int, at: str) -> None:
    """Freeze, kill or fail this process if ``HYPER_PARALLEL_FAULT_INJECT`` names (rank, step, at)."""
    spec = parse_fault_spec(os.environ.get(ENV))
    if spec is None or (spec.rank, spec.step, spec.at) != (rank, step, at):
        return
    if spec.kind == "raise":
        raise InjectedFault(f"injected fault on rank {rank} at step {step} ({at}): a stand-in for bad input "
                            f"on this rank only")
    sig = signal.SIGSTOP if spec.kind == "stop" else signal.SIGKILL
    print(f"hyper_parallel fault injection: rank {rank} (pid {os.getpid()}) sends itself {sig.name} "
          f"at step {step} ({at}), t={time.time():.3f}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), sig)
