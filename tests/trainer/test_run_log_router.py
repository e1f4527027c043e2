"""MoE runs show the router loss where a user looks (issue 24 item 5): the progress bar's postfix and
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
