"""Atomic writes, safe reads and resume paths of checkpoints (checkpoint/io.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest
import torch

from ddpexp.checkpoint import files as ckpt_files
from ddpexp.checkpoint import io
from ddpexp.checkpoint import sharded as ckpt_sharded
from ddpexp.errors import CheckpointError


def test_save_atomic_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "last.pt"
    ckpt_files.save_atomic({"model": {"w": torch.ones(2)}, "step": 1}, path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.pt", "last.pt.sha256"]
    assert io.load(path)["step"] == 1


def test_a_saved_archive_loads_as_torch_saves_but_without_record_crcs(tmp_path):
    """The checkpoint's records carry no CRC-32 (the SHA-256 beside it is the check), the
    process-wide option stays as it was, and the file loads to what ``torch.save`` wrote."""
    state = {"model": {"w": torch.randn(64, 32), "tied": None}, "step": 3,
             "optimizer": {"state": {0: {"exp_avg": torch.randn(64, 32)}}}}
    state["model"]["tied"] = state["model"]["w"][1]
    ckpt_files.save_atomic(state, tmp_path / "last.pt")
    torch.save(state, tmp_path / "ref.pt")
    assert torch.serialization.get_crc32_options()
    with zipfile.ZipFile(tmp_path / "last.pt") as ours, zipfile.ZipFile(tmp_path / "ref.pt") as ref:
        assert [i.filename.split("/", 1)[1] for i in ours.infolist()] == \
            [i.filename.split("/", 1)[1] for i in ref.infolist()]
        assert {i.CRC for i in ours.infolist()} == {0}
        assert all(i.CRC for i in ref.infolist() if i.file_size)
    loaded = io.load(tmp_path / "last.pt")
    expected = torch.load(tmp_path / "ref.pt", weights_only=True)
    assert loaded["step"] == 3
    for key in ("w", "tied"):
        assert torch.equal(loaded["model"][key], expected["model"][key])
    exp_avg = loaded["optimizer"]["state"][0]["exp_avg"]
    assert torch.equal(exp_avg, expected["optimizer"]["state"][0]["exp_avg"])
    shared = loaded["model"]["tied"].untyped_storage().data_ptr()
    assert shared == loaded["model"]["w"].untyped_storage().data_ptr()  # still one storage


_FAILED_WRITE = """
import gc, sys, torch
from ddpexp.checkpoint.files import write_archive
class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot pickle")
with open(sys.argv[1], "wb") as f:
    try:
        write_archive({"w": torch.ones(3), "bad": Unpicklable()}, f)
    except RuntimeError as e:
        kept = e  # the traceback holds the writer past the file's close
del kept
gc.collect()
print("collected")
"""


def test_a_write_that_fails_midway_leaves_no_writer_to_abort_the_process_later(tmp_path):
    """A writer left unfinished would finish the file when collected, after the file was
    closed: the write raises inside a C++ destructor and the whole process aborts (a test
    worker died so, long after the failing save). Run apart, so an abort fails only this."""
    done = subprocess.run([sys.executable, "-c", _FAILED_WRITE, str(tmp_path / "x.pt")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "collected"


def test_a_sharded_save_stages_into_the_last_saves_buffers_while_the_layout_holds(gloo_group):
    """DCP's stager of the background sharded save: each save copies the shards into the
    buffers of the last (no new allocation, no deep copy of each DTensor), a copy that the
    loop's later steps do not reach, with the plain values of this save; a tensor whose
    shape changed gets fresh buffers."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    w = distribute_tensor(torch.arange(12.0).reshape(3, 4), mesh, [Shard(0)])
    state = {"model": {"w": w, "b": torch.ones(4)},
             "optimizer": {"state": {"w": {"step": torch.tensor(1.0)}},
                           "param_groups": [{"lr": 0.1, "params": ["w"]}]}}
    staging = ckpt_sharded.HostStaging()
    first = staging.stage(state)
    buffer = first["model"]["w"].to_local().data_ptr()
    assert torch.equal(first["model"]["w"].full_tensor(), torch.arange(12.0).reshape(3, 4))
    w.to_local().mul_(-1)  # the loop stepped on; the first save's write has ended
    state["optimizer"]["param_groups"][0]["lr"] = 0.2
    second = staging.stage(state)
    assert second["model"]["w"].to_local().data_ptr() == buffer
    assert torch.equal(second["model"]["w"].to_local(), w.to_local())
    assert second["optimizer"]["param_groups"][0]["lr"] == 0.2
    w.to_local().add_(5)
    assert torch.equal(second["model"]["w"].to_local(), -torch.arange(12.0).reshape(3, 4))
    state["model"]["b"] = torch.ones(5)
    third = staging.stage(state)
    assert third["model"]["b"].shape == (5,)
    assert third["model"]["w"].to_local().data_ptr() != buffer  # all made afresh
    staging.clear()


def test_save_atomic_replaces(tmp_path):
    path = tmp_path / "last.pt"
    ckpt_files.save_atomic({"model": {}, "step": 1}, path)
    ckpt_files.save_atomic({"model": {}, "step": 2}, path)
    assert io.load(path)["step"] == 2


def test_copy_atomic(tmp_path):
    src, dst = tmp_path / "last.pt", tmp_path / "best.pt"
    ckpt_files.save_atomic({"model": {"w": torch.arange(3)}}, src)
    ckpt_files.copy_atomic(src, dst)
    assert torch.equal(io.load(dst)["model"]["w"], torch.arange(3))
    assert src.read_bytes() == dst.read_bytes()


def test_remove_stale_temporaries(tmp_path):
    (tmp_path / f"last.pt{ckpt_files.TMP_MARK}123").write_bytes(b"x")
    (tmp_path / "last.pt").write_bytes(b"x")
    removed = ckpt_files.remove_stale_temporaries(tmp_path)
    assert [p.name for p in removed] == [f"last.pt{ckpt_files.TMP_MARK}123"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


def test_load_missing(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint .*nope.pt does not exist"):
        io.load(tmp_path / "nope.pt")


def test_load_empty(tmp_path):
    (tmp_path / "last.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"is empty \(0 bytes\): no checkpoint was written "
                                              r"to it. Point resume= at another checkpoint"):
        io.load(tmp_path / "last.pt")


def test_load_text_file_names_alternative(tmp_path):
    (tmp_path / "best.pt").write_bytes(b"x")
    (tmp_path / "last.pt").write_text("<html>oops</html>")
    with pytest.raises(CheckpointError, match=r"is not a checkpoint: its 17 bytes begin b'<html>"
                                              r".*neither a zip archive nor a pickle.*resume=.*best.pt"):
        io.load(tmp_path / "last.pt")


def test_load_truncated(tmp_path):
    path = tmp_path / "last.pt"
    ckpt_files.save_atomic({"model": {"w": torch.randn(100)}}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    # It has a digest: that is what tells its bytes changed, and the message says so first.
    with pytest.raises(CheckpointError, match=r"changed since it was saved and no longer reads "
                                              r"as one \(truncated or corrupt: "):
        io.load(path)
    ckpt_files.digest_path(path).unlink()  # without one, what the bytes read as is all there is
    with pytest.raises(CheckpointError, match="is truncated or corrupt"):
        io.load(path)


@pytest.mark.parametrize("at", [0, 200])  # the zip's magic; a byte of the pickle
def test_a_byte_flipped_early_is_named_by_the_digest(tmp_path, at):
    path = tmp_path / "last.pt"
    ckpt_files.save_atomic({"model": {"w": torch.zeros(100)}, "epoch": 1}, path)
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as refused:
        io.load(path)
    assert str(refused.value).startswith(
        f"checkpoint {path} changed since it was saved and no longer reads as one (")
    assert "last.pt.sha256 recorded" in str(refused.value)


def test_load_refuses_unsafe_objects(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "obj": os.stat_result}, path)  # a class: only an unsafe load builds it
    with pytest.raises(CheckpointError, match="holds objects that only an unsafe pickle load "
                                              "could create"):
        io.load(path)


def test_load_needs_model_entry(tmp_path):
    torch.save({"weights": {}}, tmp_path / "x.pt")
    with pytest.raises(CheckpointError, match="is not a ddpexp checkpoint \\(no 'model' entry\\)"):
        io.load(tmp_path / "x.pt")


def test_load_fix_text(tmp_path):
    (tmp_path / "x.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="Train it again."):
        io.load(tmp_path / "x.pt", fix="Train it again.")


def test_verify(tmp_path):
    ckpt_files.save_atomic({"model": {"w": torch.ones(1)}}, tmp_path / "last.pt")
    io.verify(tmp_path / "last.pt")
    with pytest.raises(CheckpointError, match="is a directory, not a checkpoint"):
        io.verify(tmp_path)


def test_find(tmp_path):
    run = tmp_path / "run"
    assert io.find(None, run) is None and io.find("", run) is None
    assert io.find("auto", run) is None
    last = run / "checkpoints" / ckpt_files.LAST
    ckpt_files.save_atomic({"model": {}}, last)
    assert io.find("auto", run) == last
    assert io.find(str(run), tmp_path) == last
    assert io.find("run", tmp_path / "elsewhere", base=tmp_path) == last
    assert io.find(str(last), run) == last


def test_find_errors(tmp_path):
    (tmp_path / "empty_run").mkdir()
    with pytest.raises(CheckpointError, match=r"resume=.*checkpoints/last.pt does not exist \(the run "
                                              r"saved no checkpoint yet\)"):
        io.find(str(tmp_path / "empty_run"), tmp_path)
    with pytest.raises(CheckpointError, match="is neither auto, a run dir nor a checkpoint file"):
        io.find(str(tmp_path / "missing"), tmp_path)


def test_newest_last_none(tmp_path):
    assert io.newest_last(tmp_path) is None
    assert not ckpt_sharded.is_sharded(tmp_path)


def test_a_file_and_a_sharded_dir_replace_each_other_by_the_same_swap(tmp_path, gloo_group):
    """A run resumed under another strategy saves last.pt as the other kind: a file where
    a sharded dir was, and the reverse; nothing of the old one, nor a temporary, is left."""
    last = tmp_path / "checkpoints" / ckpt_files.LAST
    ckpt_sharded.save_sharded({"model": {"w": torch.ones(3)}}, {"step": 1}, last, is_main=True)
    assert ckpt_sharded.is_sharded(last)
    ckpt_files.save_atomic({"model": {"w": torch.zeros(3)}, "step": 2}, last)
    assert last.is_file() and io.load(last)["step"] == 2
    ckpt_sharded.save_sharded({"model": {"w": torch.full((3,), 2.0)}}, {"step": 3}, last, is_main=True)
    assert ckpt_sharded.is_sharded(last) and io.load(last)["step"] == 3
    assert torch.equal(io.load(last)["model"]["w"], torch.full((3,), 2.0))
    assert sorted(p.name for p in last.parent.iterdir()) == [ckpt_files.LAST]


def test_a_crash_mid_swap_leaves_the_old_checkpoint_found(tmp_path):
    previous = tmp_path / (ckpt_files.LAST + ".previous")  # the old file, moved aside; the new dir not in yet
    ckpt_files.save_atomic({"model": {}, "step": 1}, previous)
    assert io.newest_last(tmp_path) == previous
    assert io.find(str(tmp_path / ckpt_files.LAST), tmp_path) == previous


def _failed_save(*failures):
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    return CheckpointException("save failed", {rank: _wrap_exception(e)
                                               for rank, e in enumerate(failures)})


def test_a_failed_sharded_save_is_told_as_the_single_file_save_tells_it(tmp_path):
    import errno

    path = tmp_path / "last.pt"
    full = ckpt_sharded._sharded_save_error(_failed_save(RuntimeError("unexpected pos"),
                                               OSError(errno.ENOSPC, "No space left")), path)
    assert isinstance(full, OSError) and full.errno == errno.ENOSPC
    assert full.filename == str(path)
    denied = ckpt_sharded._sharded_save_error(_failed_save(PermissionError(errno.EACCES, "denied")), path)
    assert isinstance(denied, OSError) and denied.errno == errno.EACCES
    assert denied.filename == str(path)
    # A short write on a disk with room, and any other error: not called a full disk.
    other = ckpt_sharded._sharded_save_error(_failed_save(RuntimeError("unexpected pos 7 vs 3")), path)
    assert isinstance(other, RuntimeError) and not isinstance(other, OSError)
    assert f"saving the sharded checkpoint {path} failed: RuntimeError: unexpected pos" in str(other)


# ------------------------------------------------------------------ digests
def _flip_byte(path, at=None):
    """Flip one bit of ``path``'s bytes in place (by default in the middle of the file)."""
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_saved_file_carries_its_sha256_in_the_format_sha256sum_checks(tmp_path):
    import hashlib

    path = tmp_path / "last.pt"
    ckpt_files.save_atomic({"model": {"w": torch.arange(5.0)}}, path)
    sidecar = ckpt_files.digest_path(path)
    assert sidecar.name == "last.pt.sha256"
    assert sidecar.read_text() == f"{hashlib.sha256(path.read_bytes()).hexdigest()}  last.pt\n"
    ckpt_files.check_digest(path)
    assert torch.load(path, weights_only=True)["model"]["w"].tolist() == [0, 1, 2, 3, 4]


def test_a_changed_byte_is_refused_naming_the_file_and_the_way_out(tmp_path):
    path = tmp_path / "last.pt"
    ckpt_files.save_atomic({"model": {"w": torch.zeros(1000)}, "step": 3}, path)
    _flip_byte(path)
    before = path.read_bytes()
    for mmap in (False, True):
        with pytest.raises(CheckpointError, match=rf"checkpoint {path} changed since it was saved: "
                                                  r"its SHA-256 is [0-9a-f]{16}\.\.\., last.pt.sha256 "
                                                  rf"recorded .*delete {path}.sha256 to read it unchecked"):
            io.load(path, mmap=mmap)
    with pytest.raises(CheckpointError, match="changed since it was saved"):
        io.verify(path)
    assert path.read_bytes() == before  # refused, not repaired or removed
    ckpt_files.digest_path(path).unlink()  # the way out the message offers
    assert io.load(path)["step"] == 3


def test_a_checkpoint_without_a_digest_reads_as_before(tmp_path):
    path = tmp_path / "old.pt"
    torch.save({"model": {"w": torch.ones(2)}, "step": 7}, path)  # as earlier versions wrote it
    ckpt_files.check_digest(path)
    io.verify(path)
    assert io.load(path)["step"] == 7


def test_a_damaged_digest_file_is_named(tmp_path):
    path = tmp_path / "last.pt"
    ckpt_files.save_atomic({"model": {}}, path)
    ckpt_files.digest_path(path).write_text("not a digest\n")
    with pytest.raises(CheckpointError, match=rf"digest file {path}.sha256 is damaged .*delete it"):
        io.load(path)


def test_copies_carry_the_digest_and_replacing_keeps_it_true(tmp_path):
    last, best = tmp_path / "last.pt", tmp_path / "best.pt"
    ckpt_files.save_atomic({"model": {"w": torch.ones(3)}, "step": 1}, last)
    ckpt_files.copy_atomic(last, best)
    assert ckpt_files.digest_path(best).read_text() == ckpt_files.digest_path(last).read_text().replace("last.pt", "best.pt")
    ckpt_files.check_digest(best)
    ckpt_files.save_atomic({"model": {"w": torch.zeros(3)}, "step": 2}, last)
    ckpt_files.check_digest(last)
    assert len(ckpt_files.digest_path(last).read_text().splitlines()) == 1
    ckpt_files.copy_atomic(last, best)  # over the older best.pt
    ckpt_files.check_digest(best)
    assert io.load(best)["step"] == 2
    ckpt_files.remove(best)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", "last.pt.sha256"]


def test_a_copy_of_a_file_without_digest_has_none(tmp_path):
    old, copy = tmp_path / "old.pt", tmp_path / "best.pt"
    torch.save({"model": {}}, old)
    ckpt_files.save_atomic({"model": {}}, copy)  # a stale digest there must not outlive the copy
    ckpt_files.copy_atomic(old, copy)
    assert not ckpt_files.digest_path(copy).exists()
    io.load(copy)


def test_a_crash_mid_replace_leaves_either_file_accepted(tmp_path):
    """While last.pt is replaced, its digest file accepts the old bytes and the new: a crash
    before or after the rename leaves a file that reads."""
    last = tmp_path / "last.pt"
    ckpt_files.save_atomic({"model": {}, "step": 1}, last)
    old = ckpt_files.file_digest(last)
    new = tmp_path / "new.pt"
    torch.save({"model": {}, "step": 2}, new)
    ckpt_files._write_digests(ckpt_files.digest_path(last), last.name, [old, ckpt_files.file_digest(new)])  # first half
    ckpt_files.check_digest(last)  # crash before the rename: the old file
    os.replace(new, last)
    ckpt_files.check_digest(last)  # crash after it: the new one
    assert io.load(last)["step"] == 2


def test_a_sharded_checkpoint_lists_every_file_and_refuses_a_changed_shard(tmp_path, gloo_group):
    last = tmp_path / "checkpoints" / ckpt_files.LAST
    ckpt_sharded.save_sharded({"model": {"w": torch.arange(64.0)}}, {"step": 1}, last, is_main=True)
    sums = (last / ckpt_files.SHARDED_DIGEST).read_text().splitlines()
    listed = sorted(line.split("  ", 1)[1] for line in sums)
    assert listed == sorted(p.name for p in last.iterdir() if p.name != ckpt_files.SHARDED_DIGEST)
    assert {ckpt_sharded.META, ".metadata"} <= set(listed)
    io.verify(last)
    assert io.load(last)["step"] == 1
    (shard,) = [p for p in last.iterdir() if p.suffix == ".distcp"]
    _flip_byte(shard, at=shard.stat().st_size - 8)
    for read in (io.verify, io.load, ckpt_sharded.load_sharded):
        with pytest.raises(CheckpointError, match=rf"checkpoint {shard} changed since it was saved.*"
                                                  rf"{ckpt_files.SHARDED_DIGEST} recorded"):
            read(last)
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"checkpoint {last} is incomplete: {shard.name} listed"):
        io.verify(last)
