"""What every benchmark records about the machine it ran on (the project's CPUs differ)."""
from __future__ import annotations

import platform


def cpu_name() -> str:
    """``model name`` from /proc/cpuinfo (else ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
