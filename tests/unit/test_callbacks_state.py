"""RunState and Best (ddpexp.callbacks.state): the run's counters as one object, and their
round trip through a checkpoint in the format 0.1.0 wrote."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ddpexp.callbacks.state import Best, RunState
from ddpexp.checkpoint import files as ckpt_files
from ddpexp.checkpoint import io as ckpt_io
from ddpexp.training.checkpoint_state import FORMAT

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "rundirs"
COUNTER_KEYS = ("epoch", "batch", "step", "best", "metrics", "history")


def _midway() -> RunState:
    """A run two validations in, part-way through its third epoch."""
    run = RunState(Best("val/acc", "max"))
    for epoch, acc in ((0, 0.81), (1, 0.93)):
        run.epoch, run.step = epoch, 23 * (epoch + 1)
        run.metrics = {"val/loss": 1.0 - acc, "val/acc": acc}
        run.history.append({"epoch": epoch, "step": run.step, **run.metrics})
        run.best.update(acc, epoch)
    run.epoch, run.batch, run.step = 2, 7, 53
    return run


def test_best_keeps_the_first_strictly_better_finite_value():
    best = Best("val/loss", "min")
    assert best.update(0.5, 0) and best.improved and (best.value, best.epoch) == (0.5, 0)
    assert not best.update(0.5, 1) and not best.improved  # a tie keeps the earlier epoch
    assert not best.update(math.nan, 2) and not best.update(math.inf, 3)
    assert best.update(0.25, 4) and (best.value, best.epoch) == (0.25, 4)
    assert not best.update(0.3, 5) and best.epoch == 4
    high = Best("val/acc", "max")
    assert high.update(0.1, 0) and high.update(0.2, 1) and not high.update(0.15, 2)
    assert high.state_dict() == {"metric": "val/acc", "value": 0.2, "epoch": 1}


def test_round_trip_through_state_dict():
    run = _midway()
    saved = run.state_dict()
    assert tuple(saved) == COUNTER_KEYS
    assert (saved["epoch"], saved["batch"], saved["step"]) == (2, 7, 53)
    assert saved["best"] == {"metric": "val/acc", "value": 0.93, "epoch": 1}
    back = RunState(Best("val/acc", "max"))
    back.load_state_dict(saved)
    assert back.state_dict() == saved
    assert (back.epoch, back.batch, back.step, back.metrics, back.history) == \
        (run.epoch, run.batch, run.step, run.metrics, run.history)
    # The checkpoint read is the newest one: a divergence names its step.
    assert back.last_saved_step == 53 and back.status == "running" and not back.best.improved
    # Lists are the resumed run's own: what it appends is not written into the saved dict.
    back.history.append({"epoch": 2})
    assert len(saved["history"]) == 2


def test_a_finished_epoch_resumes_at_the_next():
    run = _midway()
    run.epoch_finished = True
    assert run.resume_point() == (3, 0)
    assert (run.state_dict()["epoch"], run.state_dict()["batch"]) == (3, 0)


def test_a_checkpoint_written_and_read_back_is_equal(tmp_path):
    run = _midway()
    path = tmp_path / "checkpoints" / ckpt_files.LAST
    ckpt_files.save_atomic({"format": FORMAT, "model": {"w": torch.ones(2)}, **run.state_dict()}, path)
    read = ckpt_io.load(path)  # weights_only=True
    back = RunState(Best("val/acc", "max"))
    back.load_state_dict(read)
    assert back.state_dict() == run.state_dict()


def test_a_checkpoint_of_0_1_0_loads_unchanged():
    """The keys and values RunState gives back are those a checkpoint written before it
    holds, so its format needs no new number."""
    ckpt = ckpt_io.load(FIXTURES / "ddp_topk_ema" / "checkpoints" / ckpt_files.LAST)
    assert ckpt["format"] == FORMAT
    run = RunState(Best(ckpt["best"]["metric"], "max"))
    run.load_state_dict(ckpt)
    assert run.state_dict() == {key: ckpt[key] for key in COUNTER_KEYS}


def test_the_paths_earlier_versions_documented_still_import():
    """A user's callback written against ``ddpexp.training.state.RunState`` or
    ``ddpexp.training.signals.Interrupted`` keeps importing the same classes."""
    from ddpexp.callbacks.state import RunState
    from ddpexp.runtime.signals import Interrupted
    from ddpexp.training.signals import Interrupted as OldInterrupted
    from ddpexp.training.state import RunState as OldRunState

    assert OldRunState is RunState and OldInterrupted is Interrupted
