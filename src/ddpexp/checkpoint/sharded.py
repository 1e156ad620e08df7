"""Sharded checkpoints (``last.pt`` of a ``strategy=fsdp`` run): a directory of
torch.distributed.checkpoint's files, each rank's shards of the weights and the optimizer
state written by that rank, plus ``meta.pt`` (everything else, one ``torch.save`` file).
Such a directory is written under a temporary name and renamed into place; while the rename
happens the previous one waits beside it as ``last.pt.previous``, which
:func:`ddpexp.checkpoint.io.find` falls back to. A file that replaces such a directory (a run
resumed under another strategy), or the reverse, is swapped in the same way. Its digests
(``SHA256SUMS``, :mod:`.files`) are written once every rank's shards are.

:func:`sharded_shapes` reads what a sharded checkpoint holds without a process group, for
the strategies and the checkpoint schema alike.
"""

from __future__ import annotations

import errno
import functools
import os
import pickle
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ddpexp.checkpoint.files import (
    SHARDED_DIGEST,
    TMP_MARK,
    check_digest,
    corrupt,
    disk_full,
    file_digest,
    fsync_dir,
    remove,
    swap_into,
    write_archive,
    write_small,
)
from ddpexp.errors import CheckpointError

META = "meta.pt"  # a sharded checkpoint's non-tensor entries
# The entries of a sharded checkpoint that torch.distributed.checkpoint holds.
SHARDED_KEYS = ("model", "raw_model", "optimizer")

def is_sharded(path: Path | str) -> bool:
    """Whether ``path`` is a sharded checkpoint directory."""
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file() and (path / META).is_file()


def save_sharded(tensors: dict, meta: dict | None, path: Path, is_main: bool) -> None:
    """Write a sharded checkpoint at ``path``; every rank calls it with its own shards in
    ``tensors`` (DTensors), global rank 0 also with ``meta``. A crash at any instant leaves
    the previous checkpoint readable (at ``path`` or, mid-rename, ``path.previous``)."""
    import torch.distributed.checkpoint as dcp

    tmp = _empty_sharded_tmp(path, is_main)
    # dcp.save returns once every rank's shards are written.
    _end_sharded(lambda: dcp.save(tensors, checkpoint_id=str(tmp)), tmp, meta, path, is_main)


class HostStaging:
    """Where a background sharded save copies this rank's shards (DCP's stager for
    :func:`start_sharded`): host buffers made at the first save and copied into at each
    later one, while the state's layout (every tensor's place, shape and dtype) stays the
    same. DCP's default stager builds fresh buffers at every save, deep-copying each CPU
    DTensor on the way: on the CPU a 150M-parameter model's save stopped the loop for
    1.6 s, of which the copy was 0.14 s. A buffer is written again only by the next save,
    which starts after this one's write ended (one save in flight). Pinned where the
    state is on a GPU; :meth:`clear` lets go of the buffers."""

    # The copy is done when stage() returns: DCP has nothing to wait for after it.
    should_synchronize_after_execute = False

    def __init__(self) -> None:
        self._buffers: Any = None
        self._layout: tuple = ()

    def stage(self, state_dict: dict) -> dict:
        from torch.distributed._state_dict_utils import _copy_state_dict

        layout = tuple(_layout(state_dict))
        if self._buffers is None or layout != self._layout:
            self._buffers = None  # the old buffers go before the new ones are made
            self._buffers, self._layout = _host_buffers(state_dict), layout
        return _copy_state_dict(state_dict, self._buffers, type_check=False)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` copies before it returns."""

    def close(self) -> None:
        """The buffers are kept for the next save (:meth:`clear` lets go of them)."""

    def clear(self) -> None:
        self._buffers, self._layout = None, ()


def _host_buffers(obj: Any) -> Any:
    """Empty host tensors shaped as those of ``obj`` (a DTensor's: this rank's shard, in a
    DTensor of the same mesh and placements; pinned for a GPU's tensor), in the same
    containers; other values as they are (the copy takes each save's own). Made directly:
    DCP's own ``_create_cpu_state_dict`` deep-copies every CPU DTensor, data included."""
    if isinstance(obj, torch.Tensor):
        from torch.distributed.tensor import DTensor

        if not isinstance(obj, DTensor):
            return torch.empty(obj.shape, dtype=obj.dtype, pin_memory=obj.is_cuda)
        local = obj.to_local()
        buffer = torch.empty(local.shape, dtype=local.dtype, pin_memory=local.is_cuda)
        return DTensor.from_local(buffer, obj.device_mesh, obj.placements, run_check=False,
                                  shape=obj.shape, stride=obj.stride())
    if isinstance(obj, dict):
        return {key: _host_buffers(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        values = [_host_buffers(value) for value in obj]
        return values if isinstance(obj, list) else tuple(values)
    return obj


def _layout(obj: Any, path: str = "") -> Iterator[tuple]:
    """(path, device, type, shape, local shape, dtype) of every tensor in ``obj``, and the
    path of every container: what must stay the same for staged buffers to be reused."""
    if isinstance(obj, torch.Tensor):
        local = getattr(obj, "_local_tensor", obj)  # a DTensor's shard
        yield (path, str(obj.device), type(obj).__name__, tuple(obj.shape),
               tuple(local.shape), obj.dtype)
    elif isinstance(obj, dict):
        yield (path, "dict", len(obj))
        for key, value in obj.items():
            yield from _layout(value, f"{path}/{key}")
    elif isinstance(obj, (list, tuple)):
        yield (path, type(obj).__name__, len(obj))
        for i, value in enumerate(obj):
            yield from _layout(value, f"{path}/{i}")


def start_sharded(tensors: dict, meta: dict | None, path: Path, is_main: bool, group: Any,
                  before_write: Callable[[], None] | None = None,
                  staging: HostStaging | None = None) -> Callable[[], None]:
    """:func:`save_sharded` in the background (``torch.distributed.checkpoint.async_save``):
    every rank calls it in the loop's thread, at the same point. Each copies its shards to
    host memory before it returns (what is written is the state of this moment), and DCP's
    thread then writes them, its collectives over ``group`` (a process group of its own, so
    that they never meet the loop's on the default group). Returns what completes the save:
    called once in a thread of this rank's, it waits for the write (which returns on every
    rank only once every rank's shards and DCP's metadata are on disk) and on global rank 0
    writes ``meta.pt`` and the digests and renames the directory into place, all without a
    collective; a failed write is raised there, as :func:`save_sharded` raises it.
    ``before_write`` is called in DCP's thread before this rank writes (for tests);
    ``staging``: the host buffers kept from the last save, reused where they fit."""
    import torch.distributed.checkpoint as dcp

    tmp = _empty_sharded_tmp(path, is_main)
    stager: Any = staging if staging is not None else HostStaging()
    future = dcp.async_save(tensors, storage_writer=_hooked_writer(tmp, before_write),
                            process_group=group, async_stager=stager)
    assert isinstance(future, Future)  # staged in this thread: only the write's future
    # On a failure the barrier is the writers' own group's, which nothing else uses then.
    return functools.partial(_end_sharded, future.result, tmp, meta, path, is_main, group)


def _end_sharded(write: Callable[[], Any], tmp: Path, meta: dict | None, path: Path,
                 is_main: bool, group: Any = None) -> None:
    """The end of a sharded save into ``tmp``: ``write()`` returns once every rank's shards
    are on disk, then rank 0 writes ``meta`` and the digests and renames ``tmp`` to ``path``.
    A failed write reaches every rank (each says the same); the shards written so far go
    once every rank has judged them (a barrier over ``group``; the previous checkpoint was
    not touched)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        write()
    except CheckpointException as exc:
        error = _sharded_save_error(exc, path)
        if dist.is_initialized():
            dist.barrier(group=group)
        if is_main:
            remove(tmp)
        raise error from None
    if is_main:
        assert meta is not None
        _complete_sharded(tmp, meta, path)


def _hooked_writer(path: Path, before_write: Callable[[], None] | None) -> Any:
    """torch's FileSystemWriter (as ``dcp.save`` makes one) into ``path`` that calls
    ``before_write`` in the writing thread before it writes."""
    writer = _hooked_writer_class()(str(path))
    writer.hook = before_write
    return writer


@functools.cache
def _hooked_writer_class() -> type:
    from torch.distributed.checkpoint import FileSystemWriter

    class HookedWriter(FileSystemWriter):
        hook: Callable[[], None] | None = None

        def write_data(self, plan: Any, planner: Any) -> Any:
            if self.hook is not None:
                self.hook()
            return super().write_data(plan, planner)

    return HookedWriter


def _empty_sharded_tmp(path: Path, is_main: bool) -> Path:
    """The temporary directory a sharded checkpoint of ``path`` is written into, empty on
    every rank's return (a barrier: nobody writes into it before rank 0 has emptied it)."""
    import torch.distributed as dist

    tmp = path.with_name(f"{path.name}{TMP_MARK}sharded")
    if is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove(tmp)
    if dist.is_initialized():
        dist.barrier()
    return tmp


def _complete_sharded(tmp: Path, meta: dict, path: Path) -> None:
    """Rank 0's part once every rank's shards are in ``tmp``: meta.pt, the digests, the rename."""
    with open(tmp / META, "wb") as f:
        write_archive(meta, f)
        f.flush()
        os.fsync(f.fileno())
    _write_sharded_digests(tmp)
    fsync_dir(tmp)
    swap_into(tmp, path)


def _write_sharded_digests(directory: Path) -> None:
    """``SHA256SUMS`` in the sharded checkpoint ``directory``: every rank's files, once
    every rank has written them (dcp.save has returned), hashed side by side."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name != SHARDED_DIGEST)
    with ThreadPoolExecutor(max_workers=min(len(files), os.cpu_count() or 1)) as pool:
        digests = list(pool.map(file_digest, files))
    write_small(directory / SHARDED_DIGEST,
                 "".join(f"{d}  {p.name}\n" for p, d in zip(files, digests, strict=True)))


def _sharded_save_error(exc: Any, path: Path) -> BaseException:
    """What a failed ``dcp.save`` means, as the single-file save says it: a full disk (the
    usual cause) is ``OSError(ENOSPC)`` naming ``path``; another OS error keeps its errno."""
    failures = [failure for failure, _ in exc.failures.values()]
    os_errors = [e for e in failures if isinstance(e, OSError) and e.errno is not None]
    full = any(e.errno == errno.ENOSPC for e in os_errors) or (
        # torch's archive writer reports a short write without the errno (see save_atomic)
        any(isinstance(e, RuntimeError) for e in failures) and disk_full(path.parent))
    if full:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    if os_errors:
        return OSError(os_errors[0].errno, os_errors[0].strerror, str(path))
    first = failures[0] if failures else exc
    return RuntimeError(f"saving the sharded checkpoint {path} failed: "
                        f"{type(first).__name__}: {first}")


def load_sharded(path: Path, keys: Sequence[str] = ("model", "raw_model"),
                 template: dict | None = None) -> dict:
    """A sharded checkpoint's ``meta.pt`` entries plus its tensors. With ``template``
    (every rank of the run that reads it, each passing its own shards: DTensors or whole
    tensors), the tensors are read into it, resharded to this run's layout; without, this
    process alone reads ``keys`` as whole tensors on the CPU."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    if template is None:
        # One process reads it: here it is checked. Every rank of a run reading into its
        # shards was started after verify() checked it.
        check_digest(path)
    meta = load_meta(path)
    if template is not None:
        dcp.load(template, checkpoint_id=str(path))
        return {**meta, **template}
    # torch's loader without a template: the tensors of ``keys`` as the metadata describes
    # them, whole, read by this process alone (no process group needed).
    tensors: dict = {}
    _load_state_dict(state_dict=tensors, storage_reader=dcp.FileSystemReader(str(path)),
                     planner=_EmptyStateDictLoadPlanner(keys=set(keys)), no_dist=True)
    return {**meta, **tensors}


def load_meta(path: Path) -> dict:
    meta_file = path / META
    try:
        meta = torch.load(meta_file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as exc:
        raise corrupt(meta_file, exc) from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} is not a ddpexp checkpoint ({META} holds no dict)")
    return meta


def sharded_shapes(path: Path) -> dict[str, dict[str, torch.Size]]:
    """The tensors a sharded checkpoint holds, by entry: {"model": {name: global shape}}."""
    import torch.distributed.checkpoint as dcp

    out: dict[str, dict[str, torch.Size]] = {}
    for fqn, meta in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata.items():
        entry, _, name = fqn.partition(".")
        size = getattr(meta, "size", None)  # tensors have one; bytes entries do not
        if size is not None:
            out.setdefault(entry, {})[name] = size
    return out
