"""Run log: per-step records -> JSON file + loss-curve PNG (rank 0), tqdm progress bar."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path


class RunLog:
    """Collects step records; rank 0 writes ``<out_dir>/<json_log>`` and the loss curve."""

    def __init__(self, out_dir: str | Path, *, json_name: str = "train_log.json",
                 plot_name: str = "loss_curve.png", is_main: bool = True, meta: dict | None = None):
        self.out_dir = Path(out_dir)
        self.json_path = self.out_dir / json_name
        self.plot_path = self.out_dir / plot_name
        self.is_main = is_main
        self.meta = dict(meta or {})
        self.records: list[dict] = []
        self.started = time.time()

    def load_previous(self, upto_step: int) -> None:
        """Keep the records of a resumed run (steps <= upto_step) so the curve continues."""
        if not self.json_path.exists():
            return
        try:
            old = json.loads(self.json_path.read_text())
        except (OSError, ValueError):
            return
        self.records = [r for r in old.get("steps", []) if r.get("step", 0) <= upto_step]

    def append(self, record: dict) -> None:
        self.records.append(record)

    def write(self, plot: bool = True) -> None:
        if not self.is_main:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        body = {"meta": self.meta, "steps": self.records,
                "wall_time_s": round(time.time() - self.started, 3)}
        tmp = self.json_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body, indent=1))
        os.replace(tmp, self.json_path)
        if plot and self.records:
            plot_loss_curve(self.records, self.plot_path, title=self.meta.get("title", "training loss"))


def plot_loss_curve(records: list[dict], path: str | Path, title: str = "training loss") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    losses = [r["loss"] for r in records]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    ax.plot(steps, losses, marker="." if len(steps) < 60 else None, lw=1.4)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (global token mean)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(str(path))
    plt.close(fig)


class Progress:
    """tqdm bar on the main rank only (no-op elsewhere or when disabled)."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, desc: str = "train"):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, leave=True)

    def update(self, loss: float, tokens_per_s: float, lr: float, peak_mem_gb: float | None = None) -> None:
        """One step; ``peak_mem_gb`` is the largest rank's peak memory so far."""
        if self.bar is not None:
            mem = "" if peak_mem_gb is None else f" mem={peak_mem_gb:.2f}GB"
            self.bar.set_postfix_str(f"loss={loss:.4f} tok/s={tokens_per_s:,.0f} lr={lr:.2e}{mem}")
            self.bar.update(1)

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
