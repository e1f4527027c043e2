"""Simulated link: give every collective a modelled cost (latency + bytes / bandwidth).

Off by default. When on, each collective issued through :mod:`.comm` reserves the link at
launch: it completes ``latency + bytes / bandwidth`` seconds after the link is free (one link
per process, collectives serialised on it in launch order), and its handle's ``wait()`` blocks
until then, *after* the real collective finished. ``bytes`` is the larger of what this rank
sends to and receives from other ranks (the :func:`~.comm.comm_counter` accounting).

Where the time goes: a sync collective is launch + wait, so its cost is spent on the caller's
thread (it is exposed). An async CP collective runs on the platform's communication thread
(:func:`~.comm.launch_chain`): its wait — and so its modelled cost — is spent there, while the
main thread computes; the main thread blocks only if it reaches the consumer before the link
delivered. This is what makes overlap measurable on CPU/gloo where loopback transfers are
almost free (``benchmarks/async_overlap_cpu.py``).

Set it with the environment (read once, at the first collective)::

    HYPER_PARALLEL_SIMLINK="gbps=5,latency_us=20"      # 5 GB/s, 20 us per collective

or in code with :func:`configure` / the :func:`simulated_link` context manager. ``gbps`` is
gigabytes (1e9 bytes) per second. Never on for a real run unless asked: the default is None.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from typing import Optional

__all__ = ["SimLink", "configure", "active", "reserve", "settle", "note_wait", "simulated_link", "parse_spec"]

ENV = "HYPER_PARALLEL_SIMLINK"


@dataclasses.dataclass
class SimLink:
    """One modelled link: ``latency_s`` per collective plus ``bytes / bandwidth_Bps``."""

    bandwidth_Bps: float
    latency_s: float = 0.0
    busy_until: float = 0.0
    modelled_s: float = 0.0          # total modelled cost reserved so far (for reports)
    count: int = 0
    main_wait_s: float = 0.0         # time the main thread spent blocked in collective waits

    def cost(self, nbytes: int) -> float:
        return self.latency_s + float(nbytes) / self.bandwidth_Bps

    def reserve(self, nbytes: int) -> float:
        """Book the link for ``nbytes``; return the monotonic time the collective completes."""
        with _LOCK:
            now = time.monotonic()
            start = max(now, self.busy_until)
            c = self.cost(nbytes)
            self.busy_until = start + c
            self.modelled_s += c
            self.count += 1
            return self.busy_until


_LOCK = threading.Lock()
_LINK: Optional[SimLink] = None
_ENV_READ = False


def parse_spec(spec: str) -> Optional[SimLink]:
    """``"gbps=5,latency_us=20"`` -> SimLink; ``""``/``"off"``/``"0"`` -> None; ValueError naming the field."""
    spec = (spec or "").strip()
    if spec in ("", "off", "0", "none"):
        return None
    fields = {}
    for part in spec.split(","):
        if not part.strip():
            continue
        key, sep, val = part.partition("=")
        key = key.strip()
        if not sep or key not in ("gbps", "latency_us"):
            raise ValueError(f"{ENV}: expected 'gbps=<GB/s>[,latency_us=<us>]', got {spec!r} (bad field {part!r})")
        try:
            fields[key] = float(val)
        except ValueError:
            raise ValueError(f"{ENV}: {key}={val!r} is not a number") from None
    if "gbps" not in fields or not fields["gbps"] > 0:     # gbps=inf: a zero-cost link that still counts
        raise ValueError(f"{ENV}: gbps must be given and > 0, got {spec!r}")
    if fields.get("latency_us", 0.0) < 0:
        raise ValueError(f"{ENV}: latency_us must be >= 0, got {spec!r}")
    return SimLink(bandwidth_Bps=fields["gbps"] * 1e9, latency_s=fields.get("latency_us", 0.0) * 1e-6)


def configure(gbps: Optional[float] = None, latency_us: float = 0.0) -> Optional[SimLink]:
    """Turn the simulated link on (``gbps`` > 0) or off (None); returns the active link."""
    global _LINK, _ENV_READ
    _ENV_READ = True          # an explicit setting wins over the environment
    _LINK = None if gbps is None else parse_spec(f"gbps={gbps},latency_us={latency_us}")
    return _LINK


def active() -> Optional[SimLink]:
    """The active link (the environment is read on first use), or None."""
    global _LINK, _ENV_READ
    if not _ENV_READ:
        _ENV_READ = True
        _LINK = parse_spec(os.environ.get(ENV, ""))
    return _LINK


def reserve(nbytes: int) -> Optional[float]:
    """Completion time of a collective moving ``nbytes`` on the active link; None when off."""
    link = active()
    return None if link is None else link.reserve(nbytes)


def note_wait(seconds: float) -> None:
    """Account ``seconds`` a collective wait blocked the calling thread (main thread only): with
    the link on, this is the communication the main thread did not hide."""
    link = _LINK
    if link is not None and threading.current_thread() is threading.main_thread():
        with _LOCK:
            link.main_wait_s += seconds


def settle(ready_at: Optional[float]) -> None:
    """Block the calling thread until ``ready_at`` (no-op for None or a time already past)."""
    if ready_at is None:
        return
    delay = ready_at - time.monotonic()
    if delay > 0:
        time.sleep(delay)


@contextlib.contextmanager
def simulated_link(gbps: Optional[float], latency_us: float = 0.0):
    """Run the body with a simulated link (None: a zero-cost link, i.e. off); restores the previous one."""
    global _LINK, _ENV_READ
    prev, prev_read = _LINK, _ENV_READ
    link = configure(gbps, latency_us)
    try:
        yield link
    finally:
        _LINK, _ENV_READ = prev, prev_read
