"""What ``hyper-train`` prints on rank 0 when a run ends well: the ``done:`` line (steps, loss
first -> last, held-out loss, tokens/s, peak memory) and where every artifact is, one per line
(absolute paths): JSON log, step stream, loss curve, TensorBoard, checkpoint, HF export.
Only artifacts that exist are listed. See docs/quickstart.md."""
from __future__ import annotations

from pathlib import Path

from .model import auto_class

__all__ = ["summary_lines"]


def summary_lines(trainer, results: list) -> list[str]:
    """The lines (no newline) for ``trainer`` (a :class:`~.base.BaseTrainer` whose ``train`` returned
    ``results``)."""
    log, cfg = trainer.run_log, trainer.cfg
    applied = [r for r in results if not r.nonfinite]   # skipped steps carry a NaN/Inf loss
    if applied:
        first = next(r for r in log.records if not r.get("nonfinite"))
        last = applied[-1]
        tps = sum(r.tokens_per_s for r in results) / len(results)
        skipped = (f" ({trainer.nonfinite.skipped} non-finite step(s) skipped, see {log.jsonl_path})"
                   if trainer.nonfinite.skipped else "")
        evals = [r for r in log.records if r.get("eval_loss") is not None]
        held = (f", held-out loss {evals[-1]['eval_loss']:.4f} (ppl {evals[-1]['eval_ppl']:.1f})"
                if evals else "")
        peak = log.records[-1].get("peak_mem_gb_per_rank") if log.records else None
        mem = f", peak memory {peak} GB/rank" if peak is not None else ""
        lines = [f"done: {trainer.step} steps{skipped}, loss {first['loss']:.4f} -> {last.loss:.4f}{held}, "
                 f"mean {tps:,.0f} tokens/s, {last.valid_tokens} valid tokens/step{mem}"]
    elif results:
        lines = [f"done: {trainer.step} steps, every one skipped as non-finite (see {log.jsonl_path})"]
    else:
        lines = [f"done: nothing to do (already at step {trainer.step})"]
    out = Path(cfg.logging.out_dir)
    found = [("JSON log", Path(log.json_path)), ("step stream", Path(log.jsonl_path))]
    if cfg.logging.plot:
        found.append(("loss curve", Path(log.plot_path)))
    if cfg.logging.tensorboard:
        found.append(("TensorBoard", out / "tensorboard"))
    if trainer.last_checkpoint is not None:
        found.append(("checkpoint", Path(trainer.last_checkpoint)))
    if cfg.logging.export_hf:
        found.append(("HF export", out / "hf"))
    lines.append("artifacts:")
    for name, path in found:
        if path.exists():
            auto = auto_class(cfg.data.source == "media").__name__     # the class the run built
            note = f"  ({auto} / AutoTokenizer.from_pretrained)" if name == "HF export" else ""
            lines.append(f"  {name:<12} {path.resolve()}{note}")
    return lines
