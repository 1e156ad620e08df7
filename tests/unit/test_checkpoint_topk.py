"""Which checkpoints save_top_k keeps (checkpoint/topk.py)."""

from __future__ import annotations

import logging
import math

import pytest

from ddpexp.checkpoint.topk import PATTERN, TopK


def test_filename_has_no_equals_or_slash():
    k = TopK(2, "val/acc", "max")
    assert k.filename(3, 0.99441234) == "epoch003-val_acc-0.994412.pt"
    assert PATTERN.match(k.filename(12, -1.5e-7))


def test_mode_must_be_max_or_min():
    with pytest.raises(ValueError, match="mode 'up' is not one of max, min"):
        TopK(1, "val/loss", "up")


def test_keeps_k_best_and_drops_the_rest():
    k = TopK(2, "val/loss", "min")
    assert k.offer(0.5, 0) == ("epoch000-val_loss-0.5.pt", [])
    assert k.offer(0.7, 1) == ("epoch001-val_loss-0.7.pt", [])
    assert k.offer(0.6, 2) == ("epoch002-val_loss-0.6.pt", ["epoch001-val_loss-0.7.pt"])
    assert k.offer(0.9, 3) == (None, [])
    assert [e["epoch"] for e in k.kept] == [0, 2]


def test_max_mode_and_ties_keep_earlier():
    k = TopK(1, "val/acc", "max")
    k.offer(0.8, 0)
    assert k.offer(0.8, 1) == (None, [])
    assert k.offer(0.9, 2) == ("epoch002-val_acc-0.9.pt", ["epoch000-val_acc-0.8.pt"])


def test_nan_is_never_ranked():
    k = TopK(3, "val/loss", "min")
    assert k.offer(math.nan, 0) == (None, [])
    assert k.offer(None, 1) == (None, [])
    assert k.kept == []


def test_same_name_again_replaces_entry():
    k = TopK(2, "val/loss", "min")
    k.offer(0.5, 0)
    assert k.offer(0.5, 0) == ("epoch000-val_loss-0.5.pt", [])
    assert len(k.kept) == 1


def test_state_round_trip():
    k = TopK(2, "val/loss", "min")
    k.offer(0.3, 0)
    k.offer(0.2, 1)
    other = TopK(2, "val/loss", "min")
    other.load_state_dict(k.state_dict())
    assert other.kept == k.kept
    assert k.state_dict() == {"metric": "val/loss", "mode": "min", "kept": [
        {"name": "epoch001-val_loss-0.2.pt", "value": 0.2, "epoch": 1},
        {"name": "epoch000-val_loss-0.3.pt", "value": 0.3, "epoch": 0}]}


def test_other_metric_starts_afresh(caplog):
    k = TopK(2, "val/loss", "min")
    k.offer(0.3, 0)
    other = TopK(2, "val/acc", "max")
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        other.load_state_dict(k.state_dict())
    assert other.kept == []
    assert "the checkpoint ranked by val/loss (min), this run by val/acc (max)" in caplog.text
    other.load_state_dict(None)
    assert other.kept == []


def test_reconcile_drops_missing_and_names_strays(tmp_path, caplog):
    k = TopK(3, "val/loss", "min")
    kept, gone = k.offer(0.1, 0)[0], k.offer(0.2, 1)[0]
    (tmp_path / kept).write_bytes(b"x")
    (tmp_path / "epoch005-val_loss-0.05.pt").write_bytes(b"x")
    (tmp_path / "last.pt").write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        strays = k.reconcile(tmp_path)
    assert strays == ["epoch005-val_loss-0.05.pt"]
    assert [e["name"] for e in k.kept] == [kept]
    assert f"{gone} no longer on disk" in caplog.text
    assert k.reconcile(tmp_path / "absent") == []


def test_topk_min_mode_and_a_smaller_k_after_resume():
    top = TopK(3, "val/loss", "min")
    for epoch, value in enumerate([0.9, 0.3, 0.5]):
        top.offer(value, epoch)
    state = top.state_dict()
    fewer = TopK(1, "val/loss", "min")
    fewer.load_state_dict(state)
    name, dropped = fewer.offer(0.4, 3)
    assert name is None
    assert dropped == ["epoch002-val_loss-0.5.pt", "epoch000-val_loss-0.9.pt"]
    assert [e["value"] for e in fewer.kept] == [0.3]
