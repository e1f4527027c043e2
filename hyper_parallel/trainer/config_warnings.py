"""Config values that are legal but probably not what the user meant: one warning line each,
never an error (the run goes on). The trainer logs them on rank 0 before building anything."""
from __future__ import annotations

__all__ = ["config_warnings"]


def config_warnings(cfg, device_type: str | None) -> list[str]:
    """The warning lines of ``cfg`` (a TrainerConfig) on a ``device_type`` machine, each starting
    with the dotted field: ``schedule.warmup_steps`` above ``schedule.steps`` (the peak learning
    rate is never reached); ``model.dtype: float16`` on a CPU."""
    out = []
    s = cfg.schedule
    if s.steps and s.warmup_steps > s.steps:
        out.append(f"[schedule.warmup_steps] {s.warmup_steps} exceeds schedule.steps={s.steps}: the learning "
                   f"rate ends at {s.steps / s.warmup_steps:.2g} x optimizer.lr and never reaches its peak; "
                   f"lower warmup_steps to at most {s.steps} if that is not intended")
    if cfg.model.dtype == "float16" and device_type == "cpu":
        out.append("[model.dtype] float16 on a CPU: slow and overflow-prone (max 65504); use float32 "
                   "(the default)")
    return out
