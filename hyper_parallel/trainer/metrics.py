"""Run log: per-step records -> JSONL stream + JSON summary + loss-curve PNG (rank 0), tqdm bar.

Rank 0 appends one JSON line per optimizer step to ``<out_dir>/<json_log stem>.jsonl`` (default
``train_log.jsonl``) and flushes it, so a crash loses at most the step in flight. The first line
is ``{"meta": ...}``; every other line is one step record. The JSON summary (``json_log``, with
``meta``, ``steps`` and ``wall_time_s``) and the PNG are rebuilt from that file at checkpoints
and at the end; after a crash, ``python -m hyper_parallel.trainer.metrics <out_dir>`` rebuilds them.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path


class RunLog:
    """Collects step records; rank 0 writes ``<out_dir>/<json_log>`` and the loss curve."""

    def __init__(self, out_dir: str | Path, *, json_name: str = "train_log.json",
                 plot_name: str = "loss_curve.png", is_main: bool = True, meta: dict | None = None,
                 tensorboard_dir: str | Path | None = None):
        self.tensorboard = TensorBoardLog(tensorboard_dir) if is_main and tensorboard_dir is not None else None
        self.out_dir = Path(out_dir)
        self.json_path = self.out_dir / json_name
        self.jsonl_path = jsonl_path_for(self.json_path)
        self.plot_path = self.out_dir / plot_name
        self.is_main = is_main
        self.meta = dict(meta or {})
        self.records: list[dict] = []
        self.started = time.time()
        self._stream = None   # the open JSONL file (rank 0), opened (truncated) on first use

    def _open(self, records: list[dict]) -> None:
        """Start the JSONL file afresh with the meta line and ``records``. The new file is written
        beside the old one and renamed over it, so a rank reading the stream at that moment (every
        rank reads it in :meth:`load_previous` while rank 0 rewrites it) sees the old file or the new
        one, never a truncated one."""
        if self._stream is not None:
            self._stream.close()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.jsonl_path.with_name(self.jsonl_path.name + f".tmp{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps({"meta": self.meta}) + "\n")
            for r in records:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, self.jsonl_path)
        self._stream = open(self.jsonl_path, "a", encoding="utf-8")

    def load_previous(self, upto_step: int) -> None:
        """Keep the records of a resumed run (steps <= upto_step) so the curve continues: from the
        JSONL stream when there is one (it survives a crash), else from the JSON summary. Rank 0
        rewrites the stream with exactly those records."""
        old = read_jsonl(self.jsonl_path)[1] if self.jsonl_path.exists() else None
        if old is None and self.json_path.exists():
            try:
                old = json.loads(self.json_path.read_text()).get("steps", [])
            except (OSError, ValueError, AttributeError):
                old = None
        self.records = [r for r in (old or []) if r.get("step", 0) <= upto_step]
        if self.is_main:
            self._open(self.records)

    def append(self, record: dict) -> None:
        """One step record: kept, and on rank 0 written as one flushed JSONL line."""
        self.records.append(record)
        if self.is_main:
            if self._stream is None:
                self._open([])
            self._stream.write(json.dumps(record) + "\n")
            self._stream.flush()
            if self.tensorboard is not None:
                self.tensorboard.add(record)

    def write(self, plot: bool = True) -> None:
        """Rank 0: rebuild the JSON summary (and with ``plot`` the PNG) from the JSONL stream."""
        if not self.is_main:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if self._stream is None:
            self._open(self.records)
        self._stream.flush()
        _, steps = read_jsonl(self.jsonl_path)
        self.records = steps
        body = {"meta": self.meta, "steps": steps,
                "wall_time_s": round(time.time() - self.started, 3)}
        tmp = self.json_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body, indent=1))
        os.replace(tmp, self.json_path)
        if plot and self.records:
            plot_loss_curve(self.records, self.plot_path, title=self.meta.get("title", "training loss"))


class TensorBoardLog:
    """``logging.tensorboard``: rank 0 writes TensorBoard event files under ``log_dir``
    (``torch.utils.tensorboard.SummaryWriter``, the ``tensorboard`` package), one point per optimizer
    step for each of :data:`TENSORBOARD_SCALARS` present in the step record, flushed every step
    (a crash keeps what was logged). Open it with ``tensorboard --logdir <out_dir>/tensorboard``."""

    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def add(self, record: dict) -> None:
        step = int(record["step"])
        for key, tag in TENSORBOARD_SCALARS.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(tag, float(value), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


#: step-record key -> TensorBoard tag (peak_mem_gb is the largest rank's peak)
TENSORBOARD_SCALARS = {"loss": "train/loss", "lr": "train/lr", "tokens_per_s": "train/tokens_per_s",
                       "grad_norm": "train/grad_norm", "peak_mem_gb": "train/peak_mem_gb",
                       "router_loss": "train/router_loss"}


def _writable_dir(field: str, d: Path) -> None:
    """Create ``d`` (parents too) and prove it writable with a probe file; CPConfigError naming ``field``."""
    from ..distributed.errors import CPConfigError

    for parent in (d, *d.parents):
        if parent.exists() and not parent.is_dir():
            raise CPConfigError(field, f"{d} cannot be a directory: {parent} is a file",
                                fix=f"point {field} at a directory (or move the file {parent} away)")
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".hyper_parallel_write_probe_{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise CPConfigError(field, f"cannot write in {d} ({type(exc).__name__}: {exc.strerror or exc})",
                            fix=f"choose a writable directory for {field}") from None


def check_output_paths(logging_cfg, checkpoint_dir: str | Path | None = None, *, plot: bool | None = None) -> None:
    """Before the first step (local, no collective): every output path of the run can be written.

    ``logging.out_dir`` is created and writable; ``json_log`` (and its ``.jsonl`` stream) and, when
    plotting, ``plot_file`` are not directories, their folders are created and writable, and the
    plot's extension is an image format matplotlib can write (no extension = PNG);
    ``checkpoint_dir`` (when given) is created and writable. Raises :class:`CPConfigError` naming
    the first bad field."""
    from ..distributed.errors import CPConfigError

    out = Path(logging_cfg.out_dir)
    _writable_dir("logging.out_dir", out)
    plot = logging_cfg.plot if plot is None else plot
    targets = [("logging.json_log", out / logging_cfg.json_log)]
    targets.append(("logging.json_log", jsonl_path_for(out / logging_cfg.json_log)))
    if plot:
        targets.append(("logging.plot_file", out / logging_cfg.plot_file))
    for field, f in targets:
        if f.is_dir():
            raise CPConfigError(field, f"{f} is a directory, not a file", fix=f"give {field} a file name")
        _writable_dir(field, f.parent)
    if plot:
        ext = Path(logging_cfg.plot_file).suffix.lstrip(".").lower()
        if ext:
            from matplotlib.backend_bases import FigureCanvasBase

            formats = sorted(FigureCanvasBase.get_supported_filetypes())
            if ext not in formats:
                raise CPConfigError("logging.plot_file", f"{logging_cfg.plot_file!r} has an image format matplotlib "
                                    f"cannot write ({ext!r}; supported: {', '.join(formats)})",
                                    fix="use .png (or .pdf / .svg), or set logging.plot: false")
    if checkpoint_dir is not None:
        _writable_dir("schedule.checkpoint_dir", Path(checkpoint_dir))


def jsonl_path_for(json_path: str | Path) -> Path:
    """``train_log.json`` -> ``train_log.jsonl`` (beside it)."""
    json_path = Path(json_path)
    if json_path.suffix == ".jsonl":   # json_log itself named .jsonl: keep the two apart
        return json_path.with_name(json_path.stem + ".steps.jsonl")
    return json_path.with_name(json_path.stem + ".jsonl")


def read_jsonl(path: str | Path) -> tuple[dict, list[dict]]:
    """(meta, step records) of a JSONL run log; a torn last line (a crash mid-write) is skipped."""
    meta, steps = {}, []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and set(obj) == {"meta"}:
            meta = obj["meta"]
        elif isinstance(obj, dict):
            steps.append(obj)
    return meta, steps


def rebuild(out_dir: str | Path, json_name: str = "train_log.json", plot_name: str | None = "loss_curve.png") -> dict:
    """Rebuild ``<out_dir>/<json_name>`` (and the PNG unless ``plot_name`` is None) from the JSONL
    stream, e.g. after a crash; returns the summary written."""
    out_dir = Path(out_dir)
    meta, steps = read_jsonl(jsonl_path_for(out_dir / json_name))
    body = {"meta": meta, "steps": steps, "wall_time_s": None}
    tmp = (out_dir / json_name).with_suffix(".tmp")
    tmp.write_text(json.dumps(body, indent=1))
    os.replace(tmp, out_dir / json_name)
    if plot_name and steps:
        plot_loss_curve(steps, out_dir / plot_name, title=meta.get("title", "training loss"))
    return body


def plot_loss_curve(records: list[dict], path: str | Path, title: str = "training loss") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    losses = [r["loss"] for r in records]
    router = [(r["step"], r["router_loss"]) for r in records if r.get("router_loss") is not None]
    marker = "." if len(steps) < 60 else None
    fig, axes = plt.subplots(2 if router else 1, 1, figsize=(6, 5.6 if router else 3.6), dpi=110, squeeze=False,
                             sharex=True)
    ax = axes[0][0]
    ax.plot(steps, losses, marker=marker, lw=1.4, label="train")
    held_out = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    if held_out:    # data.eval_every: the held-out loss (evaluate.py) on the same axes
        ax.plot([s for s, _ in held_out], [v for _, v in held_out], marker="o", lw=1.4, color="tab:green",
                label="eval (held-out)")
        ax.legend(loc="upper right")
    ax.set_ylabel("loss (global token mean)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if router:      # MoE: the router's load-balancing loss (before its coefficient), per step
        rax = axes[1][0]
        rax.plot([s for s, _ in router], [v for _, v in router], marker=marker, lw=1.4, color="tab:orange")
        rax.set_ylabel("router aux loss")
        rax.grid(alpha=0.3)
    axes[-1][0].set_xlabel("optimizer step")
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

    def update(self, loss: float, tokens_per_s: float, lr: float, peak_mem_gb: float | None = None,
               router_loss: float | None = None) -> None:
        """One step; ``peak_mem_gb`` is the largest rank's peak memory so far, ``router_loss`` the MoE
        router's load-balancing loss (None: not an MoE run)."""
        if self.bar is not None:
            mem = "" if peak_mem_gb is None else f" mem={peak_mem_gb:.2f}GB"
            router = "" if router_loss is None else f" router={router_loss:.4f}"
            self.bar.set_postfix_str(f"loss={loss:.4f}{router} tok/s={tokens_per_s:,.0f} lr={lr:.2e}{mem}")
            self.bar.update(1)

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


if __name__ == "__main__":  # python -m hyper_parallel.trainer.metrics OUT_DIR [JSON_NAME [PLOT_NAME]]
    import sys

    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m hyper_parallel.trainer.metrics OUT_DIR [JSON_NAME [PLOT_NAME]]")
    summary = rebuild(*sys.argv[1:4])
    print(f"rebuilt {Path(sys.argv[1]) / (sys.argv[2] if len(sys.argv) > 2 else 'train_log.json')}: "
          f"{len(summary['steps'])} steps")
