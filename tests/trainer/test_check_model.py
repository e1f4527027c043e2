"""``launch._check_model``, the launcher's meta-device check of the model before any rank starts: a
model the meta device cannot build is left to the ranks (one line on stderr when a check was skipped,
none when there was nothing to check); an unexpected exception of the checks propagates (a bug is not
hidden); a CPConfigError propagates as the refusal it is."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.nn as nn

from hyper_parallel.distributed.errors import CPConfigError
from hyper_parallel.trainer import launch


def _cfg(cp=1, overrides=()):
    return SimpleNamespace(
        model=SimpleNamespace(), plan_overrides=list(overrides),
        accelerator=SimpleNamespace(tp_size=1, cp_size=cp, ep_size=1, sequence_parallel=False, loss_parallel=False),
        schedule=SimpleNamespace(tiled_mlp=False, tiled_mlp_chunk_size=0, activation_offload=False),
        data=SimpleNamespace(source="bytes", packing=False, packed_documents=None))


@pytest.fixture
def seams(monkeypatch):
    import hyper_parallel.distributed.plan as plan
    import hyper_parallel.trainer.model as model
    import hyper_parallel.trainer.vocab_rule as vocab

    state = {"build": lambda: nn.Linear(2, 2), "plan": lambda: None}
    monkeypatch.setattr(vocab, "build_vocab", lambda cfg: 8)
    monkeypatch.setattr(model.HyperAutoModel, "from_config",
                        staticmethod(lambda cfg, meta=False, vocab_size=None, image_text=False: state["build"]()))
    monkeypatch.setattr(plan.ShardingPlanner, "plan", lambda self, m, **kw: state["plan"]())
    return state


def _raise(exc):
    def f():
        raise exc
    return f


def test_a_model_the_meta_device_cannot_build_is_left_to_the_ranks(seams, capsys):
    seams["build"] = _raise(NotImplementedError("Cannot copy out of meta tensor; no data!"))
    launch._check_model(_cfg(cp=2))                       # no exception: the ranks build and check it
    err = capsys.readouterr().err
    print(err)
    assert err.count("\n") == 1 and "meta device" in err and "NotImplementedError" in err and "ranks" in err, err
    launch._check_model(_cfg(cp=1))                       # nothing was to be checked: silent
    assert capsys.readouterr().err == ""


def test_an_unexpected_exception_of_the_checks_is_not_hidden(seams, capsys):
    seams["plan"] = _raise(KeyError("planner bug"))
    with pytest.raises(KeyError, match="planner bug"):
        launch._check_model(_cfg(cp=2))
    seams["plan"] = lambda: None
    seams["build"] = lambda: nn.Linear(2, 2)
    launch._check_model(_cfg(cp=2))                       # a model that builds and plans: silent, no error
    assert capsys.readouterr().err == ""


def test_a_refusal_propagates(seams):
    seams["plan"] = _raise(CPConfigError("plan_overrides[0]", "no module matches", fix="fix the match"))
    with pytest.raises(CPConfigError, match="no module matches"):
        launch._check_model(_cfg(cp=2))
    seams["build"] = _raise(CPConfigError("model.name", "unknown model", fix="name a model"))
    with pytest.raises(CPConfigError, match="unknown model"):
        launch._check_model(_cfg(cp=2))
