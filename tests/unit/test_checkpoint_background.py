"""``trainer.async_save`` (checkpoint/background.py): the snapshot, and a trainer built in
this process whose checkpoints are written by the background thread while it trains on."""

from __future__ import annotations

import io
import logging
import os
import signal
import sys
import threading
import time

import pytest
import torch
from helpers import assert_same_tensors

from ddpexp import Callback
from ddpexp.callbacks import ModelCheckpoint
from ddpexp.checkpoint import background
from ddpexp.checkpoint import files as ckpt_files
from ddpexp.checkpoint import sharded as ckpt_sharded


def _bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_the_snapshot_is_a_copy_that_keeps_shared_storages():
    weight = torch.arange(12.0).reshape(3, 4)
    state = {"model": {"a": weight, "tied": weight.detach(), "row": weight[1]},
             "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "groups": [{"lr": 0.1}]},
             "history": [{"epoch": 0}], "name": "x"}
    before = _bytes(state)
    copy = background.snapshot(state)
    weight.mul_(-1)  # the loop steps the live tensors in place
    state["history"].append({"epoch": 1})
    state["optimizer"]["groups"][0]["lr"] = 0.2
    assert _bytes(copy) == before  # what a save at the snapshot's moment writes
    model = copy["model"]
    assert model["a"].untyped_storage().data_ptr() == model["tied"].untyped_storage().data_ptr()
    assert model["row"].untyped_storage().data_ptr() == model["a"].untyped_storage().data_ptr()
    assert background.state_bytes(state) == 12 * 4 + 4


def test_snapshots_one_after_another_copy_into_the_same_buffers():
    weight = torch.arange(12.0).reshape(3, 4)
    state = {"model": {"a": weight, "row": weight[1]}, "step": torch.tensor(1.0)}
    staging: background.Staging = {}
    first = background.snapshot(state, staging)
    buffer = first["model"]["a"].untyped_storage().data_ptr()
    weight.mul_(-1)  # the loop stepped on; the first snapshot's write has ended
    state["step"] = torch.tensor(2.0)
    before = _bytes(state)
    second = background.snapshot(state, staging)
    assert _bytes(second) == before
    assert second["model"]["a"].untyped_storage().data_ptr() == buffer  # no new copy
    assert second["model"]["row"].untyped_storage().data_ptr() == buffer
    assert len(staging) == 2  # this snapshot's storages, nothing left of the last one's
    weight.add_(5)
    assert _bytes(second) == before  # a copy still


class StagingSeen(Callback):
    """Records, after every step, where the saver's kept buffers are."""

    def __init__(self):
        self.seen: list[set[int]] = []

    def on_train_batch_end(self, trainer) -> None:
        trainer.saver.wait()
        self.seen.append({b.data_ptr() for b in trainer.saver._staging.values()})


def test_background_saves_every_step_reuse_one_copy_and_write_what_the_loop_would(
        trainer_factory):
    probes, runs = {}, {}
    for name, mode in (("async", True), ("sync", False)):
        probes[name] = StagingSeen()
        callbacks = {"checkpoint": ModelCheckpoint(every_n_steps=1), "probe": probes[name]}
        t = trainer_factory(name, callbacks=callbacks, samples=(48, 16, 0), async_save=mode)
        t.fit()
        runs[name] = torch.load(t.run_dir / "checkpoints" / ckpt_files.LAST, weights_only=True)
        if mode:
            assert not t.saver._staging  # let go of once the run saves no more
            weights_and_momenta = 2 * len(list(t.module.parameters()))
    # After each step the saves so far (the step's own comes after the probe): the weights'
    # and the momentum buffers' copies are the same buffers every time (the RNG states'
    # tensors, made afresh at each save, get buffers of their own).
    seen = probes["async"].seen
    assert len(seen) == 6 and not seen[0]
    assert len(set.intersection(*seen[1:])) >= weights_and_momenta
    for ckpt in runs.values():
        ckpt["config"]["trainer"].pop("async_save")  # the one key the two runs differ in
    assert_same_tensors(runs["async"], runs["sync"], "checkpoint")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_snapshot_of_cuda_tensors_lands_on_the_host_before_it_returns():
    live = torch.randn(1 << 22, device="cuda")
    state = {"w": live, "view": live[:10], "step": torch.tensor(1.0)}
    staging: background.Staging = {}
    for kept in (None, staging, staging):  # a fresh copy; into pinned buffers, then again
        want = live.cpu()
        copy = background.snapshot(state, kept)
        live.normal_()  # queued after the copies: they must have landed already
        torch.cuda.synchronize()
        assert copy["w"].device.type == "cpu" and torch.equal(copy["w"], want)
        assert torch.equal(copy["view"], want[:10])
    assert copy["w"].is_pinned()


class SaveTwiceThenStep(Callback):
    """At step ``at``: a save in the loop, then the same step's save in the background, whose
    writer is held until the loop has taken ``more`` further steps."""

    def __init__(self, at: int = 2, more: int = 2):
        self.at, self.more = at, more
        self.release = threading.Event()
        self.busy_while_training: list[bool] = []

    def setup(self, trainer) -> None:
        trainer.saver.before_write = lambda: self.release.wait(timeout=60)

    def on_train_batch_end(self, trainer) -> None:
        if trainer.step == self.at:
            out = trainer.run_dir / "checkpoints"
            trainer.saver.mode = False
            trainer.save_checkpoint(out / "sync.pt")
            trainer.saver.mode = True
            trainer.save_checkpoint(out / "async.pt")
            self.saved = {k: v.clone() for k, v in trainer.module.state_dict().items()}
        elif trainer.step > self.at:
            self.busy_while_training.append(trainer.saver.busy)
            if trainer.step == self.at + self.more:
                self.moved = any(not torch.equal(v, self.saved[k])
                                 for k, v in trainer.module.state_dict().items())
                self.release.set()


def test_a_background_save_equals_the_save_in_the_loop_while_training_moves_on(trainer_factory):
    probe = SaveTwiceThenStep()
    t = trainer_factory(callbacks={"probe": probe}, samples=(48, 16, 0), async_save=True)
    t.fit()
    assert probe.busy_while_training[:2] == [True, True]  # written while the loop stepped
    assert probe.moved  # the weights it was copied from changed in place meanwhile
    out = t.run_dir / "checkpoints"
    sync = torch.load(out / "sync.pt", weights_only=True)
    written = torch.load(out / "async.pt", weights_only=True)
    assert written["step"] == 2
    assert_same_tensors(written, sync, "checkpoint")
    ckpt_files.check_digest(out / "async.pt")


class Slow(Callback):
    """Holds every background write for ``hold_s``; records what the run's end saw."""

    def __init__(self, hold_s: float = 0.5):
        self.hold_s = hold_s

    def setup(self, trainer) -> None:
        trainer.saver.before_write = lambda: time.sleep(self.hold_s)

    def on_fit_end(self, trainer, result) -> None:
        self.busy_at_end = trainer.saver.busy
        self.last_step = torch.load(trainer.run_dir / "checkpoints" / "last.pt",
                                    weights_only=True)["step"]


def test_a_run_ends_tests_and_resumes_only_after_its_last_save(trainer_factory):
    """One epoch: its only best.pt is written in the background, held for half a second;
    the test of best.pt after training reads it whole, the end of the run sees last.pt of
    its last step, and a resume continues from there."""
    slow = Slow()
    t = trainer_factory(callbacks={"checkpoint": ModelCheckpoint(), "slow": slow},
                        async_save=True)
    result = t.fit()
    assert result["test"]["epoch"] == 0 and "test/acc" in result["test"]
    assert slow.busy_at_end is False and slow.last_step == t.step == 4
    assert not [p for p in (t.run_dir / "checkpoints").iterdir() if ".tmp-" in p.name]
    again = trainer_factory(t.run_dir.name, callbacks={"checkpoint": ModelCheckpoint(),
                                                       "slow": Slow()},
                            async_save=True, max_epochs=2)
    again.fit(resume_from=t.run_dir / "checkpoints" / "last.pt")
    assert again.step == 8
    assert torch.load(t.run_dir / "checkpoints" / "last.pt", weights_only=True)["step"] == 8


class Terminate(Callback):
    """Sends this process SIGTERM at step ``at``, as a scheduler's preemption does."""

    def __init__(self, at: int = 3):
        self.at = at

    def on_train_batch_end(self, trainer) -> None:
        if trainer.step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_sigterm_ends_the_run_once_its_checkpoint_is_written(trainer_factory, caplog):
    """Saves every 2 steps, each write held for half a second: SIGTERM at step 3 comes while
    the save of step 2 is in flight; the stop's own save waits for it, and the run returns
    (interrupted, "checkpoint saved" logged) only once last.pt holds step 3."""
    t = trainer_factory(callbacks={"checkpoint": ModelCheckpoint(every_n_steps=2),
                                   "slow": Slow(), "term": Terminate()},
                        samples=(64, 16, 0), async_save=True)
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        result = t.fit()
    assert result["status"] == "interrupted" and t.step == 3
    assert not t.saver.busy
    assert torch.load(t.run_dir / "checkpoints" / "last.pt", weights_only=True)["step"] == 3
    assert any("checkpoint saved" in r.getMessage() for r in caplog.records)


class WaitForTheWriter(Callback):
    """At the step after ``at``, lets the background write end before the loop goes on, so
    that the step where its failure is raised is known."""

    def __init__(self, at: int = 2):
        self.at = at
        self.steps: list[int] = []

    def on_before_optimizer_step(self, trainer) -> None:
        if trainer.step == self.at:  # the step after the save at step `at` is being taken
            while trainer.saver.busy:
                time.sleep(0.01)

    def on_train_batch_end(self, trainer) -> None:
        self.steps.append(trainer.step)


def test_a_failed_background_save_fails_the_run_at_the_next_step_once(trainer_factory):
    t = trainer_factory(callbacks={"checkpoint": ModelCheckpoint(every_n_steps=2),
                                   "wait": (wait := WaitForTheWriter())},
                        samples=(64, 16, 0), async_save=True)
    (t.run_dir / "checkpoints").write_text("a file where the checkpoints dir should be")
    with pytest.raises(FileExistsError):
        t.fit()
    assert wait.steps == [1, 2]  # raised at step 3, before its callbacks
    assert t.step == 3 and not t.saver.busy
    t.wait_for_saves()  # reported once: nothing is raised again


def test_the_default_writes_in_the_loop_where_the_copy_does_not_fit(trainer_factory, caplog,
                                                                   monkeypatch):
    monkeypatch.setattr(background, "_AVAILABLE_SHARE", 1e-12)  # no state fits
    t = trainer_factory(callbacks={"checkpoint": ModelCheckpoint(every_n_steps=1)},
                        samples=(24, 16, 0))
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        t.fit()
    warned = [r for r in caplog.records if "trainer.async_save" in r.getMessage()]
    assert len(warned) == 1 and "written in the loop" in warned[0].getMessage()
    assert t.saver._thread is None  # nothing was written in the background


def test_async_save_false_never_starts_a_thread(trainer_factory):
    t = trainer_factory(callbacks={"checkpoint": ModelCheckpoint(every_n_steps=1)},
                        samples=(24, 16, 0), async_save=False)
    started: list[str] = []
    t.saver.before_write = lambda: started.append("thread")
    t.fit()
    assert started == [] and (t.run_dir / "checkpoints" / "last.pt").is_file()


def test_a_strategy_whose_save_is_collective_writes_in_the_loop():
    """A strategy whose save runs collectives and that has no staged save (the base class's
    flags both off) keeps its saves in the loop's thread even where
    ``trainer.async_save=true``; fsdp has one (DCP's async save, below)."""
    from ddpexp.strategies.base import Strategy
    from ddpexp.strategies.fsdp import FSDP

    assert Strategy.staged_save is False and FSDP.background_save is False and FSDP.staged_save
    saver = background.Saver(True, capable=False)
    threads: list[str] = []
    saver.save(lambda state: threads.append(threading.current_thread().name), {"w": torch.ones(2)})
    assert threads == [threading.main_thread().name] and not saver.busy


def test_a_staged_save_starts_in_the_loop_and_completes_in_the_writer_thread():
    """The save of a strategy whose every rank writes (fsdp): its start (the copy, the
    collectives that stay in the loop) runs in the caller's thread with the writer's hook,
    its completion and ``then`` in the writer's thread; the next save waits for it."""
    saver = background.Saver(True)
    hooked: list[int] = []
    saver.before_write = lambda: hooked.append(_nice())
    release, seen, stagings = threading.Event(), [], []

    def start(state, hook, staging):
        stagings.append(staging)  # the buffers of the last save, for the next
        # DCP's thread calls the hook before it writes: the test's before_write, at the
        # writer's priority.
        dcp_thread = threading.Thread(target=hook)
        dcp_thread.start()
        dcp_thread.join()
        seen.append(("start", threading.current_thread().name, state["step"],
                     hooked.pop() == _writer_nice()))

        def complete():
            release.wait(timeout=60)
            seen.append(("complete", threading.current_thread().name, state["step"]))
        return complete

    def in_loop(state):
        raise AssertionError("written in the loop")

    saver.save_staged(start, in_loop, {"step": 1}, then=lambda: seen.append(("then",)))
    assert saver.busy and seen == [("start", "MainThread", 1, True)]
    release.set()
    saver.save_staged(start, in_loop, {"step": 2})  # waits for the first
    saver.wait()
    assert seen == [("start", "MainThread", 1, True), ("complete", "ddpexp-checkpoint-writer", 1),
                    ("then",), ("start", "MainThread", 2, True),
                    ("complete", "ddpexp-checkpoint-writer", 2)]
    assert isinstance(stagings[0], ckpt_sharded.HostStaging) and stagings[1] is stagings[0]


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _writer_nice() -> int:
    """The nice value a writer's thread has: the lowest priority on Linux, else the loop's."""
    return background.WRITER_NICE if sys.platform.startswith("linux") else _nice()


def test_the_writer_thread_yields_the_cpu_to_the_loop_and_the_loop_keeps_its_priority():
    saver = background.Saver(True)
    seen: list[int] = []
    saver.before_write = lambda: seen.append(_nice())
    loop_nice = _nice()
    saver.save(lambda state: seen.append(_nice()), {"w": torch.ones(3)})
    saver.wait()
    assert seen == [_writer_nice(), _writer_nice()]  # before_write, then the write itself
    assert _nice() == loop_nice


def test_under_the_default_every_rank_takes_the_way_they_agree_on():
    """``mode=None``: the memory verdict is handed to ``agree`` (a collective under fsdp);
    where another rank says no, this one writes in the loop too. ``true`` and ``false`` ask
    nobody."""
    asked, written = [], []

    def start(state, hook, staging):
        return lambda: written.append("background")

    def in_loop(state):
        written.append("loop")

    def nobody(flag):
        asked.append(flag)
        return False

    background.Saver(None).save_staged(start, in_loop, {"w": torch.zeros(4)}, agree=nobody, peers=2)
    assert asked == [True] and written == ["loop"]
    for mode, way in ((True, "background"), (False, "loop")):
        saver = background.Saver(mode)
        saver.save_staged(start, in_loop, {"w": torch.zeros(4)}, agree=nobody)
        saver.wait()
        assert written[-1] == way
    assert asked == [True]


def test_a_staged_save_that_fails_is_reported_once():
    saver = background.Saver(True)

    def start(state, hook, staging):
        def complete():
            raise OSError(28, "No space left on device", "last.pt")
        return complete

    saver.save_staged(start, lambda state: None, {"step": 1})
    while saver.busy:
        time.sleep(0.01)
    with pytest.raises(OSError, match="No space left"):
        saver.poll()
    saver.poll()
    saver.wait()  # reported once: nothing is raised again
