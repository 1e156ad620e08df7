"""When a training loss counts as diverged (training/divergence.py)."""

from __future__ import annotations

import pytest

from ddpexp.training.divergence import Divergence, LossCeiling


@pytest.mark.parametrize("start, factor, limit", [
    (2.0, 10.0, 20.0),      # start >= 1: factor * start
    (0.1, 10.0, 9.1),       # start near 0: rise by factor - 1 in absolute terms
    (-3.0, 2.0, 0.0),       # a negative start: |start| is the floor's scale
])
def test_limit(start, factor, limit):
    c = LossCeiling(factor)
    c.set_start(start)
    assert c.limit == pytest.approx(limit)
    assert not c.exceeded(limit)
    assert c.exceeded(limit + 1e-6)


def test_no_factor_no_ceiling():
    c = LossCeiling(None)
    c.set_start(1.0)
    assert c.limit is None and not c.exceeded(1e30)


def test_nonfinite_start_no_ceiling():
    c = LossCeiling(10.0)
    c.set_start(float("inf"))
    assert c.start is None and c.limit is None


def test_check_nonfinite_names_own_loss():
    d = Divergence(10.0)
    assert not d
    d.check(1, float("nan"), 4, float("inf"), step=5, epoch=1)
    assert d and d.at == {"step": 5, "epoch": 1, "loss": float("inf")}
    assert not d.exploded
    assert d.warning() == "the training loss is not finite"


def test_check_nonfinite_elsewhere_has_no_loss():
    d = Divergence(None)
    d.check(2, 0.0, 4, 1.5, step=3, epoch=0)  # this rank's own loss is finite
    assert d.at == {"step": 3, "epoch": 0, "loss": None}


def test_check_first_divergence_stands():
    d = Divergence(2.0)
    d.ceiling.set_start(1.0)
    d.check(0, 30.0, 10, None, step=1, epoch=0)  # 3.0 > 2.0
    d.check(1, 0.0, 1, None, step=9, epoch=4)
    assert d.at == {"step": 1, "epoch": 0, "loss": 3.0}
    assert d.exploded
    assert d.warning() == "the training loss rose past trainer.divergence_factor times its start"


def test_check_nothing_seen():
    d = Divergence(2.0)
    d.ceiling.set_start(1.0)
    d.check(0, 0.0, 0, None, step=1, epoch=0)
    assert not d


def test_message_exploded():
    d = Divergence(100.0)
    d.ceiling.set_start(2.3)
    d.note(40, 1, 1234.5)
    assert d.message(0.1, 20, "32") == (
        "training diverged: the training loss became 1234 by step 40 (epoch 1), over "
        "trainer.divergence_factor=100 times its start (2.3), so the run was stopped; "
        "checkpoints/last.pt keeps the weights from before the rise (step 20). Try a smaller "
        "optimizer.lr (the last step used 0.1) or trainer.grad_clip=1.0")


def test_message_nan_without_checkpoint_in_bf16():
    d = Divergence(None)
    d.note(3, 0, float("nan"))
    text = d.message(1e6, None, "bf16")
    assert "became NaN by step 3 (epoch 0), so the run was stopped" in text
    assert "no checkpoint had been written yet" in text
    assert text.endswith("(the last step used 1e+06) or trainer.grad_clip=1.0, or trainer.precision=32")


def test_message_weights_nonfinite():
    d = Divergence(None)
    d.note(8, 2)
    text = d.message(0.01, 4, "32")
    assert "became NaN or infinite by step 8" in text
    assert "keeps the last finite weights (step 4)" in text
    assert not d.exploded
