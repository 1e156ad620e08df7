"""Checkpoint files: atomic saves that survive SIGKILL at any instant, safe loading that
refuses code-running pickles, and clear messages (through the CLI too) for bad files."""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import random
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import assert_same_tensors, build_trainer, read_metrics, run_cli_here

from ddpexp.checkpoint import files as ckpt_files
from ddpexp.checkpoint import io as checkpoint
from ddpexp.errors import CheckpointError

TINY = [
    "data=synthetic", "data.shape=[1,4,4]", "data.num_classes=3", "data.num_samples=32",
    "data.val_samples=16", "data.batch_size=8", "model=mlp", "model.hidden=[8]",
    "trainer.max_epochs=1",
]


def _payload(i: int) -> dict:
    # ~4 MB, every tensor filled with i: a torn or mixed file would show.
    return {"model": {"w": torch.full((1 << 19,), float(i), dtype=torch.float64),
                      "b": torch.full((7,), float(i))}, "step": i}


def _save_forever(path: str, first: int) -> None:
    """The child: save (and every other time copy to best.pt) as fast as it can."""
    target = Path(path)
    for i in range(first + 1, 1 << 30):
        ckpt_files.save_atomic(_payload(i), target)
        if i % 2 == 0:
            ckpt_files.copy_atomic(target, target.with_name(ckpt_files.BEST))


def _assert_consistent(ckpt: dict) -> int:
    i = ckpt["step"]
    assert torch.equal(ckpt["model"]["w"], torch.full((1 << 19,), float(i), dtype=torch.float64))
    assert torch.equal(ckpt["model"]["b"], torch.full((7,), float(i)))
    return i


def test_sigkill_during_saves_never_leaves_an_unloadable_checkpoint(tmp_path):
    last = tmp_path / "checkpoints" / ckpt_files.LAST
    ckpt_files.save_atomic(_payload(0), last)
    rng = random.Random(1234)
    # A fork server that has imported torch but never run an op: each child starts in
    # milliseconds, and without the thread pools that make a fork of this process hang.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "ddpexp.checkpoint.io"])
    seen, stray = set(), 0
    for k in range(40):
        child = ctx.Process(target=_save_forever, args=(str(last), 1000 * k), daemon=True)
        inode = last.stat().st_ino
        child.start()
        # Kill at a random moment after this child completed at least one save (a rename
        # gives last.pt a new inode), so that the test does not depend on the machine's speed.
        deadline = time.time() + 60
        while last.stat().st_ino == inode and time.time() < deadline:
            time.sleep(0.001)
        time.sleep(rng.uniform(0.0, 0.1))
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        assert child.exitcode == -signal.SIGKILL
        stray += sum(ckpt_files.TMP_MARK in p.name for p in last.parent.iterdir())
        seen.add(_assert_consistent(checkpoint.load(last)))
        best = last.with_name(ckpt_files.BEST)
        if best.exists():
            _assert_consistent(checkpoint.load(best))
        removed = ckpt_files.remove_stale_temporaries(last.parent)
        assert all(ckpt_files.TMP_MARK in p.name for p in removed)
        names = sorted(p.name for p in last.parent.iterdir())
        files = [n for n in names if not n.endswith(ckpt_files.DIGEST_SUFFIX)]
        assert files in (["last.pt"], ["best.pt", "last.pt"])
        # A digest never outlives its file (each file was checked by the loads above).
        assert {n.removesuffix(ckpt_files.DIGEST_SUFFIX) for n in names} == set(files)
    # Every child got at least one save through before its kill.
    assert len(seen) == 40, seen
    print(f"{stray} of 40 kills caught a save half-way")  # typically most of them


class _TouchOnLoad:
    """A pickle that creates a file when it is unpickled (what a malicious file would do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _malicious(path: Path, marker: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": {"w": torch.zeros(2)}, "x": _TouchOnLoad(marker)}, path)
    return path


def test_malicious_checkpoint_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    path = _malicious(tmp_path / "evil.pt", marker)
    for mmap in (False, True):
        with pytest.raises(CheckpointError, match=r"unsafe pickle load.*refuses it"):
            checkpoint.load(path, mmap=mmap)
    assert not marker.exists()
    # The payload is live: an unsafe load would have run it.
    torch.load(path, weights_only=False)
    assert marker.exists()


def _real_checkpoint(workdir: Path, monkeypatch, capsys) -> Path:
    run_dir = workdir / "outputs" / "run"
    code, text = run_cli_here([*TINY, f"hydra.run.dir={run_dir}"], workdir, monkeypatch, capsys)
    assert code == 0, text
    return run_dir


def test_stale_temporaries_are_removed_and_never_read(tmp_path):
    ckpt_dir = tmp_path / "checkpoints"
    ckpt_files.save_atomic(_payload(1), ckpt_dir / "last.pt")
    stale = ckpt_dir / f"last.pt{ckpt_files.TMP_MARK}999999"
    stale.write_bytes(b"half a checkpoint")
    assert _assert_consistent(checkpoint.load(ckpt_dir / "last.pt")) == 1
    assert ckpt_files.remove_stale_temporaries(ckpt_dir) == [stale]
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["last.pt", "last.pt.sha256"]


def test_truncated_checkpoint_names_the_file(tmp_path):
    good = tmp_path / "good.pt"
    ckpt_files.save_atomic(_payload(3), good)
    data = good.read_bytes()
    for n in (2, 10, 100, len(data) // 2, len(data) - 100, len(data) - 1):
        bad = tmp_path / "checkpoints" / "last.pt"
        bad.parent.mkdir(exist_ok=True)
        bad.write_bytes(data[:n])
        for mmap in (False, True):
            with pytest.raises(CheckpointError, match=rf"checkpoint {bad} is truncated or corrupt"):
                checkpoint.load(bad, mmap=mmap)


def test_best_and_top_k_survive_damage_to_last_pt(tmp_path):
    """A run whose last epoch is its best writes last.pt, best.pt and the top-k file from one
    state: three files, not three names of one, so a last.pt cut short (a full disk, a bad
    copy) leaves the other two whole."""
    build_trainer(tmp_path, [*TINY, "trainer.save_top_k=1", "trainer.test=false"]).fit()
    ckpts = tmp_path / "checkpoints"
    last, best = ckpts / ckpt_files.LAST, ckpts / ckpt_files.BEST
    (top,) = ckpts.glob("epoch000-*.pt")
    assert len({p.stat().st_ino for p in (last, best, top)}) == 3
    saved = torch.load(last, weights_only=True)
    with open(last, "r+b") as f:
        f.truncate(last.stat().st_size // 2)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        checkpoint.load(last)
    for survivor in (best, top):
        assert_same_tensors(torch.load(survivor, weights_only=True), saved, survivor.name)


def _not_a_checkpoint(path: Path) -> Path:
    """4 KB of random bytes, as a failed download or a mixed-up file leaves them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    noise = random.Random(0).randbytes(4096)
    assert noise[:1] not in (b"P", b"\x80")  # begins as neither of torch.save's formats
    path.write_bytes(noise)
    return path


def test_each_unreadable_file_is_named_for_what_it_is(tmp_path):
    """Bytes that are no checkpoint, an empty file, a checkpoint cut short and a real
    checkpoint holding objects that only an unsafe load builds: one message each."""
    good = tmp_path / "good.pt"
    ckpt_files.save_atomic(_payload(3), good)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with_path = tmp_path / "with_path.pt"  # a pathlib object: weights_only refuses its class
    torch.save({"model": {"w": torch.zeros(2)}, "data_root": pathlib.PurePosixPath("/data")}, with_path)
    cases = {
        _not_a_checkpoint(tmp_path / "noise.pt"): rf"{tmp_path}/noise.pt is not a checkpoint: its "
                                                  r"4096 bytes begin b'.*', neither a zip archive nor a pickle",
        empty: rf"checkpoint {empty} is empty \(0 bytes\)",
        cut: rf"checkpoint {cut} is truncated or corrupt \(PytorchStreamReader failed",
        with_path: rf"checkpoint {with_path} holds objects that only an unsafe pickle load could create",
    }
    for path, message in cases.items():
        for mmap in (False, True):
            with pytest.raises(CheckpointError) as caught:
                checkpoint.load(path, mmap=mmap)
            assert re.match(message, str(caught.value)), (str(caught.value), message)
            assert ("unsafe pickle" in str(caught.value)) == (path == with_path)


def test_cli_resume_from_bytes_that_are_no_checkpoint(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    build_trainer(run_dir, [*TINY, "trainer.test=false"]).fit()
    last = _not_a_checkpoint(run_dir / "checkpoints" / "last.pt")
    before = _snapshot(run_dir)
    code, text = run_cli_here([*TINY, f"resume={run_dir}"], tmp_path, monkeypatch, capsys)
    # The digest tells that the bytes changed; the message says what they read as now too.
    _assert_clean_failure(code, text, f"checkpoint {last} changed since it was saved and no "
                          "longer reads as one (its 4096 bytes begin")
    assert text.count("no longer reads as one") == 1 and "unsafe" not in text
    after = _snapshot(run_dir)
    assert {k: after.get(k) for k in before} == before  # nothing it held was touched


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def _assert_clean_failure(code: int, text: str, *needles: str) -> None:
    """The CLI (run in this process) exited non-zero with each of ``needles`` and no traceback."""
    assert code != 0
    assert "Traceback" not in text, text
    for needle in needles:
        assert needle in text, text


def test_cli_refuses_bad_checkpoints_and_keeps_the_run(tmp_path, monkeypatch, capsys):
    workdir = tmp_path
    run_dir = _real_checkpoint(workdir, monkeypatch, capsys)
    before = _snapshot(run_dir)
    last = run_dir / "checkpoints" / "last.pt"

    # Truncated last.pt of a finished run, resumed by dir.
    good = last.read_bytes()
    last.write_bytes(good[: len(good) // 2])  # in place: best.pt is a file of its own
    before["checkpoints/last.pt"] = last.read_bytes()
    code, text = run_cli_here([*TINY, f"resume={run_dir}"], workdir, monkeypatch, capsys)
    _assert_clean_failure(code, text, f"checkpoint {last} changed since it was saved and no "
                          "longer reads as one (truncated or corrupt",
                          f"resume={run_dir / 'checkpoints' / 'best.pt'}")

    # A code-running pickle, resumed by file: refused, never run.
    marker = workdir / "pwned"
    evil = _malicious(run_dir / "checkpoints" / "evil.pt", marker)
    before["checkpoints/evil.pt"] = evil.read_bytes()
    code, text = run_cli_here([*TINY, f"resume={evil}"], workdir, monkeypatch, capsys)
    _assert_clean_failure(code, text, f"checkpoint {evil} holds objects that only an unsafe pickle")
    assert not marker.exists()

    # Everything the run had written is still there, byte for byte (Hydra only adds the
    # config of each attempt under .hydra/resume-N/).
    after = _snapshot(run_dir)
    assert {k: v for k, v in after.items() if not k.startswith(".hydra/resume-")
            and k != "ddpexp.log"} == {k: v for k, v in before.items() if k != "ddpexp.log"}
    assert read_metrics(run_dir)["status"] == "completed"


def test_cli_missing_resume_path(tmp_path, monkeypatch, capsys):
    workdir = tmp_path
    missing = workdir / "no" / "such" / "run"
    code, text = run_cli_here([*TINY, f"resume={missing}"], workdir, monkeypatch, capsys)
    _assert_clean_failure(code, text, f"resume={missing} is neither auto, a run dir nor a checkpoint file")
    empty = workdir / "empty_run"
    empty.mkdir()
    code, text = run_cli_here([*TINY, f"resume={empty}"], workdir, monkeypatch, capsys)
    _assert_clean_failure(code, text, f"{empty}/checkpoints/last.pt does not exist")


def _flip_a_weight_byte(path: Path) -> None:
    """Flip one bit inside the bytes of a weight of checkpoint ``path``, in place: the
    archive stays well-formed, only the weights differ (what a bad disk sector does)."""
    weight = next(iter(torch.load(path, weights_only=True)["model"].values()))
    data = bytearray(path.read_bytes())
    at = data.find(weight.numpy().tobytes())
    assert at > 0
    data[at + 1] ^= 0x01
    path.write_bytes(bytes(data))


def test_cli_refuses_a_last_pt_whose_bytes_changed(tmp_path, monkeypatch, capsys):
    run_dir = _real_checkpoint(tmp_path, monkeypatch, capsys)
    last = run_dir / "checkpoints" / "last.pt"
    _flip_a_weight_byte(last)
    before = _snapshot(run_dir)
    code, text = run_cli_here([*TINY, f"resume={run_dir}"], tmp_path, monkeypatch, capsys)
    _assert_clean_failure(code, text, f"checkpoint {last} changed since it was saved",
                          f"resume={run_dir / 'checkpoints' / 'best.pt'}",
                          f"delete {last}.sha256 to read it unchecked")
    assert text.count("changed since it was saved") == 1
    assert _snapshot(run_dir) == before  # the checkpoint as it was, nothing else written
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == ["run"]  # no new run dir


def test_eval_refuses_a_best_pt_whose_bytes_changed(tmp_path, monkeypatch, capsys):
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from ddpexp import eval as ddpexp_eval

    run_dir = _real_checkpoint(tmp_path, monkeypatch, capsys)
    best = run_dir / "checkpoints" / "best.pt"
    _flip_a_weight_byte(best)
    before = _snapshot(run_dir)
    for target in (run_dir, best):
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            code = ddpexp_eval.main([str(target)])
        assert code == 1 and out.getvalue() == ""
        text = err.getvalue()
        assert f"checkpoint {best} changed since it was saved" in text, text
        assert "Evaluate another checkpoint of the run" in text
        assert text.count("\n") == 1 and "Traceback" not in text
        assert _snapshot(run_dir) == before  # no eval-*.json, the checkpoint as it was
