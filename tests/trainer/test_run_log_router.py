"""MoE runs show the router loss where a user looks: the progress bar's postfix and
a second panel of the loss plot; runs without it keep the one-panel plot."""
from PIL import Image

from hyper_parallel.trainer.metrics import Progress, plot_loss_curve


def _records(router: bool) -> list:
    out = []
    for i in range(1, 6):
        rec = {"step": i, "loss": 5.0 - 0.1 * i}
        if router:
            rec.update(router_loss=1.0 + 0.01 * i, expert_load={"max": 40.0, "mean": 32.0, "max_over_mean": 1.25})
        out.append(rec)
    return out


def test_loss_plot_gains_a_router_panel(tmp_path):
    plot_loss_curve(_records(False), tmp_path / "plain.png")
    plot_loss_curve(_records(True), tmp_path / "moe.png")
    h_plain = Image.open(tmp_path / "plain.png").size[1]
    h_moe = Image.open(tmp_path / "moe.png").size[1]
    print("plot heights", h_plain, h_moe)
    assert h_moe > 1.4 * h_plain, (h_plain, h_moe)


def test_progress_bar_shows_router_loss(capsys):
    bar = Progress(3, enabled=True, desc="t")
    bar.update(2.5, 1000.0, 1e-3, 1.25, router_loss=1.0625)
    bar.close()
    err = capsys.readouterr().err
    print(err)
    assert "router=1.0625" in err and "mem=1.25GB" in err and "loss=2.5000" in err


def test_resume_rewrites_the_stream_without_truncating_it_under_a_reader(tmp_path):
    """Every rank reads the JSONL stream in load_previous while rank 0 rewrites it: a reader that
    opened the file just before the rewrite still reads the whole old stream (the new one is renamed
    over it, not truncated in place), and a later reader sees exactly the kept records."""
    import json

    from hyper_parallel.trainer.metrics import RunLog, read_jsonl

    first = RunLog(tmp_path, meta={"title": "t"})
    for step in (1, 2, 3):
        first.append({"step": step, "loss": 1.0 / step})
    first.write(plot=False)
    old = first.jsonl_path.read_text()
    with open(first.jsonl_path, encoding="utf-8") as reader:       # another rank, mid-read
        resumed = RunLog(tmp_path, meta={"title": "t"})
        resumed.load_previous(2)                                    # rank 0 rewrites
        assert reader.read() == old
    meta, steps = read_jsonl(first.jsonl_path)
    assert [r["step"] for r in steps] == [1, 2] and [r["step"] for r in resumed.records] == [1, 2]
    resumed.append({"step": 3, "loss": 0.5})
    assert [json.loads(x).get("step") for x in first.jsonl_path.read_text().splitlines()[1:]] == [1, 2, 3]
    assert not list(tmp_path.glob("*.tmp*")), "the temporary stream was left behind"
