"""``hyper-train CONFIG --explain``: one process, nothing started, every section printed; its
memory estimate within the bound docs/trainer.md states (15 %) of a measured tensor peak."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hyper_parallel.testing import scaled

from . import _workers as W

SECTIONS = ("== meshes ==", "== plan ==", "== parameters and optimizer (per rank) ==",
            "== activations and loss buffers (per rank) ==", "== communication per step (bytes sent per rank) ==",
            "== attention work spread of the first batch ==", "== estimated peak per rank ==")
BOUND = 0.15


def _cli(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": W.ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "hyper_parallel.trainer.cli", *args], cwd=W.ROOT, env=env,
                          capture_output=True, text=True, timeout=scaled(300))


def test_explain_prints_every_section_and_starts_nothing(tmp_path):
    """The console script as a real process (``--explain`` needs no rank)."""
    out = tmp_path / "run"
    p = _cli(tmp_path, "examples/train_cp2.yaml", "--explain", "data.seq_len=64", f"logging.out_dir={out}")
    assert p.returncode == 0, p.stderr[-3000:]
    print(p.stdout)
    at = [p.stdout.index(s) for s in SECTIONS]   # every section, in order
    assert at == sorted(at), at
    assert "cp: groups [[0, 1]]" in p.stdout and "CP plan: cp_size=2" in p.stdout
    assert "visible (q, k) pairs per CP rank [" in p.stdout and "max/mean " in p.stdout
    assert "FSDP2 over 2 ranks" in p.stdout and "per step = fwd K/V AllGather" in p.stdout
    assert "Traceback" not in p.stderr and "step 1/" not in p.stdout and not out.exists()   # no rank ran


def test_explain_config_error_is_one_line_exit_2(monkeypatch, capsys):
    """In-process ``cli.main`` (the error is raised before anything is built)."""
    from hyper_parallel.trainer import cli

    monkeypatch.chdir(W.ROOT)
    assert cli.main(["examples/train_cp2.yaml", "--explain", "accelerator.cp_size=two"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hyper-train: configuration error: [accelerator.cp_size]"), lines


def _measured_tensor_peak(cfg: dict, comm: dict | None = None) -> float:
    """This run's tensor peak per rank (GB), less what the warm pool process held before it (earlier
    tests' tensors not yet collected count in the process-wide peak, not in this run's). ``comm``:
    filled with the bytes this rank sent per collective tag during the steps."""
    import gc

    from hyper_parallel.platform import comm_counter

    from hyper_parallel.platform.host_memory import host_tensor_bytes
    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.text import TextTrainer

    gc.collect()
    before = host_tensor_bytes()
    trainer = TextTrainer(TrainerConfig.from_dict(cfg))
    with comm_counter() as records:
        res = trainer.train()
    for r in records if comm is not None else ():
        comm[r.tag] = comm.get(r.tag, 0) + r.bytes_sent
    baseline = 0 if before is None else before[0] / 1e9
    return res[-1].record()["peak_tensor_gb_per_rank"][trainer.rank] - baseline   # this rank's peak, its baseline


def _measured_peak_and_offload(cfg: dict) -> tuple[float, int, dict]:
    """(:func:`_measured_tensor_peak`, bytes activation offload moved to host in the run (0
    without), bytes sent per collective tag)."""
    import hyper_parallel.trainer.activation_offload as ao

    made = []
    init = ao.ActivationOffloader.__init__

    def record(self, *a, **k):
        init(self, *a, **k)
        made.append(self)

    ao.ActivationOffloader.__init__ = record
    comm: dict = {}
    try:
        peak = _measured_tensor_peak(cfg, comm)
    finally:
        ao.ActivationOffloader.__init__ = init
    return peak, sum(o.stats.packed_bytes for o in made), comm


def test_explain_estimate_within_the_bound_of_a_measured_run(ranks, tmp_path):
    """CP=2 Head-Tail, rows of 8192 tokens, one step: the estimated tensor peak per rank is within
    15 % of the counting allocator's measured peak (the figure a device allocator reports)."""
    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.explain import explain

    cfg = W.make_cfg("llama", cp=2, steps=1, seq_len=8192, micro_batch_size=1, method="head_tail",
                     out_dir=str(tmp_path / "run"), model__config={"max_position_embeddings": 8192})
    measured = max(ranks(2).run(_measured_tensor_peak, cfg, timeout=600.0))
    est = explain(TrainerConfig.from_dict(cfg), echo=lambda *a: None)["tensor_peak"] / 1e9
    err = est / measured - 1
    print(f"explain estimate {est:.4f} GB, measured tensor peak {measured:.4f} GB per rank: {100 * err:+.1f} % "
          f"(bound {100 * BOUND:.0f} %)")
    assert abs(err) <= BOUND


def _example(name: str, tmp_path, *overrides: str) -> dict:
    """``examples/cp/<name>.yaml`` read as hyper-train reads it, with ``overrides``."""
    import yaml

    from hyper_parallel.trainer.config import apply_overrides

    with open(os.path.join(W.ROOT, "examples", "cp", name + ".yaml")) as fh:
        data = yaml.safe_load(fh)
    return apply_overrides(data, ["schedule.steps=1", "schedule.warmup_steps=0", "logging.progress=false",
                                  "logging.plot=false", f"logging.out_dir={tmp_path}", *overrides])


def _lfm2(tmp_path, seq: int, attention: str = "sdpa_hf") -> dict:
    """Tiny LFM2 (one gated short conv, one attention layer): the short-conv halo method."""
    cfg = W.make_cfg("llama", cp=2, steps=1, seq_len=seq, micro_batch_size=1, method="colossal",
                     out_dir=str(tmp_path))
    cfg["model"] = {"architecture": "lfm2", "seed": 0, "config": {
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "layer_types": ["conv", "full_attention"],
        "conv_L_cache": 3, "max_position_embeddings": seq, "block_auto_adjust_ff_dim": False}}
    inner = {"region_dispatch": False, "inner_target": "self", "when": "cp"}
    cfg["plan_overrides"] = [{"match": "model.layers.1.self_attn", "inner_wrapper": attention, **inner},
                             {"match": "model.layers.0.conv", "inner_wrapper": "short_conv_halo", **inner}]
    return cfg


SEQ = 4096
#: feature -> (ranks, config builder): the features and methods --explain models beyond the attention
#: methods above, each measured on a tiny model at 4096 tokens (Hybrid needs cp 4: 1 < degree < cp)
FEATURES = {
    "tiled_mlp": (2, lambda p: W.make_cfg("llama", cp=2, steps=1, seq_len=SEQ, micro_batch_size=1, method="head_tail",
                                          out_dir=str(p),   # a wide MLP: untiled, its intermediates are 2/3 of the peak
                                          model__config={"max_position_embeddings": SEQ, "intermediate_size": 1024},
                                          schedule__tiled_mlp=True, schedule__tiled_mlp_chunk_size=512)),
    "activation_offload": (2, lambda p: W.make_cfg("llama", cp=2, steps=1, seq_len=SEQ, micro_batch_size=1,
                                                   method="head_tail", ac=True, out_dir=str(p),
                                                   model__config={"max_position_embeddings": SEQ},
                                                   schedule__activation_offload=True)),
    "hybrid": (4, lambda p: W.make_cfg("qwen3", cp=4, steps=1, seq_len=SEQ, micro_batch_size=1, method="hybrid",
                                       out_dir=str(p), model__config={"max_position_embeddings": SEQ})),
    "gated_deltanet_ulysses": (2, lambda p: _example("qwen3_next_cp2", p, f"data.seq_len={SEQ}",
                                                     "data.micro_batch_size=1",
                                                     f"model.config={{max_position_embeddings: {SEQ}}}")),
    "gated_deltanet_state_passing": (2, lambda p: _example("qwen3_5_text_cp2", p, f"data.seq_len={SEQ}",
                                                           "data.micro_batch_size=1",
                                                           f"model.config={{max_position_embeddings: {SEQ}}}")),
    "mamba2_state_passing": (2, lambda p: _example("nemotron_h_cp2", p, f"data.seq_len={SEQ}",
                                                   "data.micro_batch_size=1",
                                                   f"model.config={{max_position_embeddings: {SEQ}}}")),
    "short_conv_halo": (2, lambda p: _lfm2(p, SEQ)),
    # the balanced split of packed rows: Colossal's exchanges on the permuted row, and a mixer next to it
    # moving its tokens to the contiguous layout and back (one all-to-all each way, forward and backward)
    "balanced": (2, lambda p: W.make_cfg("llama", cp=2, steps=1, seq_len=SEQ, micro_batch_size=1, method="balanced",
                                         out_dir=str(p), model__config={"max_position_embeddings": SEQ})),
    "short_conv_halo_next_to_balanced": (2, lambda p: _lfm2(p, SEQ, attention="sdpa_hf_balanced")),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_explain_models_the_feature_within_the_bound(ranks, tmp_path, feature):
    """The tiled MLP, activation offload, Hybrid and the token-mixer methods: the estimated tensor
    peak per rank within 15 % of the measured one, the CP bytes each rank sends in the step
    (platform.comm_counter, tags ``cp.*``) within 15 % of the estimate, and nothing printed as
    "not modelled". Offload:
    the bytes estimated to go to host equal those the run's offloader moved (on CPU the host
    buffers are the same memory, so the peak alone would not tell)."""
    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.explain import explain

    n, build = FEATURES[feature]
    cfg = build(tmp_path / "run")
    lines = []
    est = explain(TrainerConfig.from_dict(cfg), echo=lines.append)
    text = "\n".join(lines)
    assert "not modelled" not in text, text
    assert feature.split("_")[0] in text.lower().replace(" ", "_") or feature == "hybrid" and "Hybrid" in text, text
    got = ranks(n).run(_measured_peak_and_offload, cfg, timeout=600.0)
    measured = max(g[0] for g in got)
    err = est["tensor_peak"] / 1e9 / measured - 1
    print(f"{feature}: explain estimate {est['tensor_peak'] / 1e9:.4f} GB, measured tensor peak {measured:.4f} GB "
          f"per rank: {100 * err:+.1f} % (bound {100 * BOUND:.0f} %); comm {est['comm']}")
    sent = {}
    for g in got:
        for tag, b in g[2].items():
            sent[tag] = max(sent.get(tag, 0), b)
    cp_sent = sum(b for tag, b in sent.items() if tag.startswith("cp."))
    cp_est = sum(v for k, v in est["comm"].items() if k != "fsdp")
    print(f"CP bytes sent per rank in the step: estimate {cp_est / 1e6:.3f} MB, measured {cp_sent / 1e6:.3f} MB; "
          f"by tag {sent}")
    assert abs(err) <= BOUND
    assert cp_sent > 0 and abs(cp_est / cp_sent - 1) <= BOUND
    if feature == "activation_offload":
        host = max(g[1] for g in got)
        print(f"offloaded to host: estimate {est['offloaded_host'] / 1e6:.3f} MB, "
              f"the run's offloader {host / 1e6:.3f} MB")
        assert host > 0 and abs(est["offloaded_host"] / host - 1) <= BOUND


def test_work_spread_of_the_first_batch_under_each_layout():
    """Visible (query, key) pairs per rank of one packed row (documents of 900, 100, 40 and 1008
    tokens; positions restart per document): every layout counts all pairs once, and the balanced
    split's own permutation (which balances engine tiles, 64-token blocks) spreads the pairs less
    than the contiguous split and Head-Tail."""
    from hyper_parallel.distributed.context_parallel.balance.layout_spread import work_spread

    lens = [900, 100, 40, 1008]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    batch = {"input_ids": torch.zeros_like(pos), "position_ids": pos}
    total = sum(n * (n + 1) // 2 for n in lens)
    for cp in (2, 4):
        spreads = {lay: work_spread(batch, lay, cp) for lay in ("contiguous", "head_tail", "balanced")}
        print(cp, spreads)
        assert all(sum(s) == total for s in spreads.values()), spreads
        ratio = {lay: max(s) * cp / total for lay, s in spreads.items()}
        assert ratio["balanced"] < min(ratio["contiguous"], ratio["head_tail"]), ratio
