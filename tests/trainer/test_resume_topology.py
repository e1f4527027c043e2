"""Resume at another topology: a CP=2 checkpoint loads at CP=1, CP=4 and at another
DP size; DCP reshards model and optimizer state (the loaded state equals the saved one, bit for
bit), the data position carries over, and with the same global batch the resumed run continues
the uninterrupted CP=2 loss curve within the fp32 tolerance below. Another TP size is refused by
name before anything is built."""
from __future__ import annotations

import json
import math

from . import _workers as W

# CP=1/4 vs CP=2 arithmetic differs in summation order only (fp32): the losses of the 2 steps after
# the resume agree to this relative error (measured ~1e-7)
LOSS_RTOL = 2e-5
KW = dict(cp=2, steps=4, warmup=2, min_doc_len=16, lr_schedule="cosine")


def _cfg(out_dir, **kw):
    args = {**KW, **kw}
    sched = args.pop("lr_schedule")
    return W.make_cfg("llama", out_dir=str(out_dir), schedule__lr_schedule=sched, **args)


def _full_state(trainer) -> dict:
    """{name: full fp32 CPU tensor} of the model parameters and every optimizer-state tensor
    (collective under FSDP: every rank gets the full state)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(trainer.model, trainer.optimizer, options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v.detach().float().cpu().clone() for k, v in msd.items()}
    for fqn, fields in osd["state"].items():
        for field, v in fields.items():
            out[f"optim.{fqn}.{field}"] = v.detach().float().cpu().clone()
    return out


def train_and_save(cfg: dict, save_at: int):
    """Train ``save_at`` steps, save; return the losses, the checkpoint and the full state saved."""
    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.text import TextTrainer

    trainer = TextTrainer(TrainerConfig.from_dict(cfg))
    res = trainer.train(steps=save_at)
    path = str(trainer.save_checkpoint())
    return {"losses": [r.loss for r in res], "path": path, "state": _full_state(trainer)}


def resume_and_train(cfg: dict):
    """Build a trainer that resumes ``cfg``'s checkpoint: the full state right after the load,
    the step and data position it restored, then the losses of the remaining steps."""
    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.text import TextTrainer

    trainer = TextTrainer(TrainerConfig.from_dict(cfg))
    loaded = {"state": _full_state(trainer), "step": trainer.step, "position": trainer.data.position,
              "lr": trainer.scheduler.get_last_lr()[0]}
    res = trainer.train()
    return {**loaded, "losses": [r.loss for r in res], "end_step": trainer.step,
            "topology": (trainer.mesh.sizes.cp, trainer.mesh.dp_size, trainer.mesh.world_size)}


def _same_state(saved: dict, loaded: dict) -> None:
    assert sorted(saved) == sorted(loaded)
    bad = [k for k in saved if not (saved[k].shape == loaded[k].shape and (saved[k] == loaded[k]).all())]
    assert not bad, f"{len(bad)} tensors differ after the resharded load, first: {bad[:3]}"


def test_cp2_checkpoint_resumes_at_cp1_cp4_and_another_dp_size(ranks, tmp_path):
    [straight, _] = ranks(2).run(W.train_losses, _cfg(tmp_path / "straight"))
    first = ranks(2).run(train_and_save, _cfg(tmp_path / "a"), 2)
    assert first[0]["losses"] == straight["losses"][:2]
    path, saved = first[0]["path"], first[0]["state"]
    assert any(k.startswith("optim.") and k.endswith(".exp_avg_sq") for k in saved)

    cases = {  # name -> (pool size, config changes); the same global batch as the CP=2 run (one DP rank)
        "cp2->cp1 (1 rank)": (1, dict(cp=1)),
        "cp2->cp4 (4 ranks)": (4, dict(cp=4)),
    }
    for name, (world, change) in cases.items():
        outs = ranks(world).run(resume_and_train, _cfg(tmp_path / name.split()[0], schedule__resume_from=path,
                                                       **change))
        for out in outs:
            _same_state(saved, out["state"])
            assert (out["step"], out["position"], out["end_step"]) == (2, 2, 4), name
        got, want = outs[0]["losses"], straight["losses"][2:]
        err = max(abs(g - w) / abs(w) for g, w in zip(got, want))
        print(f"{name}: losses {got} vs uninterrupted CP=2 {want}: max rel err {err:.2e} (tol {LOSS_RTOL})")
        assert len(got) == 2 and err <= LOSS_RTOL, name

    # another DP size (cp 1 x dp_shard 2: a different global batch, so no loss-curve reference): the
    # state is resharded exactly, the step, LR schedule and data position carry over, training goes on
    outs = ranks(2).run(resume_and_train, _cfg(tmp_path / "dp2", cp=1, dp_shard=2, schedule__resume_from=path))
    for out in outs:
        _same_state(saved, out["state"])
        assert out["topology"] == (1, 2, 2)
        assert (out["step"], out["position"], out["end_step"]) == (2, 2, 4)
        assert len(out["losses"]) == 2 and all(math.isfinite(x) for x in out["losses"])
    assert outs[0]["lr"] == outs[1]["lr"] and outs[0]["losses"] == outs[1]["losses"]


def test_another_tp_size_is_refused_by_name(ranks, tmp_path):
    first = ranks(2).run(train_and_save, _cfg(tmp_path / "a", steps=1), 1)
    errs = ranks(2).run(W.build_error, _cfg(tmp_path / "b", cp=1, tp=2, steps=1,
                                            schedule__resume_from=first[0]["path"]))
    assert errs[0] == errs[1] and errs[0][0] == "CPConfigError", errs
    msg = errs[0][1]
    assert msg.startswith("[schedule.resume_from] checkpoint ") and "\n" not in msg, msg
    assert "accelerator.tp_size=1 but this run has accelerator.tp_size=2" in msg, msg
    assert "Fix: resume with accelerator.tp_size=1" in msg, msg
    assert not (tmp_path / "b" / "train_log.jsonl").exists()


def test_packed_stream_resumes_at_another_dp_size_on_the_same_curve(ranks, tmp_path):
    """data.source: files (packed documents): a CP=2 run (1 DP rank x 2 rows) stopped at step 2 and
    resumed at cp 1 x dp_shard 2 (2 DP ranks x 1 row) sees the same global rows (the stream state
    counts global rows) and continues the uninterrupted CP=2 loss curve within LOSS_RTOL."""
    from . import _data_workers as D

    docs = D.short_docs_jsonl(str(tmp_path / "docs.jsonl"), n_docs=24, lo=10, hi=150)

    def cfg(name, mbs, **kw):
        data = D.data_cfg(docs, str(tmp_path / "cache"), seq_len=64, micro_batch_size=mbs)
        c = D.trainer_cfg(data, method="colossal", steps=4, out_dir=str(tmp_path / name), **kw)
        c["schedule"]["checkpoint_dir"] = str(tmp_path / "ckpt")
        return c

    pool = ranks(2)
    full = pool.run(D.resume_run, cfg("full", 2, cp=2), 4, timeout=300)
    first = pool.run(D.resume_run, cfg("split", 2, cp=2), 4, 2, timeout=300)
    rest = pool.run(D.resume_run, cfg("dp2", 1, cp=1, dp_shard=2), 4, None, first[0]["path"], timeout=300)
    assert first[0]["losses"] == full[0]["losses"][:2]
    got, want = rest[0]["losses"], full[0]["losses"][2:]
    err = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    print(f"cp2 x dp1 -> cp1 x dp2 (packed files): {got} vs uninterrupted {want}: max rel err {err:.2e}")
    assert len(got) == 2 and err <= LOSS_RTOL
    assert rest[0]["tokens"] == full[0]["tokens"][2:] and rest[0]["losses"] == rest[1]["losses"]
    assert rest[0]["state"]["rows_consumed"] == full[0]["state"]["rows_consumed"] == 8


def test_cli_resume_at_another_cp_size(tmp_path, cli_saved):
    """hyper-train under torchrun: a CP=2 checkpoint resumes at cp 1 x dp_shard 2 (exit 0, the reshard
    logged on rank 0, step 2 trained after step 1, no traceback). The TP refusal is
    test_another_tp_size_is_refused_by_name (the CLI turns any such CPConfigError into exit 2 with
    one line: test_checkpoint_failures.cli_refusal)."""
    from .test_checkpoint_failures import _rank_stderr, _torchrun

    d = cli_saved / "checkpoints" / "step_1"      # read only: the resumed run writes to its own out_dir
    out = tmp_path / "dp2"
    p = _torchrun(["schedule.steps=2", f"schedule.resume_from={d}", f"logging.out_dir={out}",
                   "accelerator.cp_size=1", "accelerator.dp_shard_size=2"], tmp_path / "logs")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    err0, err1 = _rank_stderr(tmp_path / "logs", 0), _rank_stderr(tmp_path / "logs", 1)
    assert "at another topology (cp_size 2 -> 1, dp_shard_size 1 -> 2)" in err0, err0[-3000:]
    assert "Traceback" not in err0 + err1
    steps = json.loads((out / "train_log.json").read_text())["steps"]
    assert [r["step"] for r in steps] == [2]
