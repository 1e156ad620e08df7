"""``trainer.async_save``: a checkpoint copied to host memory at its step and written by a
background thread while training goes on.

The copy (:func:`snapshot`) is taken of every tensor's storage, so that what is written is
the state of the save step even though the loop then steps the very tensors it was read
from (a CPU run's optimizer mutates them in place; Lightning's thread-based async save was
reported to write state that had moved on). Storages shared by several tensors (tied
weights) stay shared in the copy, as ``torch.save`` keeps them, so the file holds the same
tensors a synchronous save of that step would.

At most one save is in flight (:meth:`Saver.save` waits for the previous one), so the
copies never cost more than one checkpoint's bytes of host memory. The write itself is the
synchronous one (:func:`ddpexp.checkpoint.files.save_atomic`: temporary file, fsync, rename),
so a process killed during it leaves the previous checkpoint whole. A write that failed is
raised once, in the loop's thread, at the next :meth:`Saver.poll` (each step) or
:meth:`Saver.wait` (the next save, the end of the run, a test of best.pt).

The writer runs at the lowest CPU priority (:func:`lower_priority`): where the loop and the
write both want a core, the loop's threads get it, and the write takes what they leave
(where the host's cores mostly wait, as in a GPU run, all of it). What the write cannot take
back from the loop is the kernel's own work of putting the bytes on disk.

``trainer.async_save=null`` (the default) writes in the background where the copy fits in
the memory the system has available (half of ``MemAvailable``), else in the loop with one
warning; ``true`` always in the background, ``false`` never.

A strategy whose every rank writes (fsdp: each its shards of a sharded ``last.pt``) saves
through :meth:`Saver.save_staged`: the strategy copies the state and starts the write in the
loop's thread (DCP's async save, :func:`ddpexp.checkpoint.sharded.start_sharded`), and the
writer's thread completes it. There the memory rule counts every rank of the host, and the
ranks agree on its verdict, since the two ways run different collectives.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ddpexp.checkpoint.sharded import HostStaging

log = logging.getLogger("ddpexp")

# The share of the host's available memory that a snapshot may take under the default:
# the rest is left to the loop, the data loaders and the page cache the write goes through.
_AVAILABLE_SHARE = 0.5
# The nice value of a background write's threads: the lowest priority Linux has.
WRITER_NICE = 19


def lower_priority() -> None:
    """Give the calling thread (and the threads it starts) the lowest CPU priority, where a
    thread can have one of its own (Linux: a thread's nice value). On an idle core it runs
    as fast as before; beside the loop's threads it yields to them: a 1.6 GB background
    save beside a 2-thread matmul loop on 2 cores slowed that loop by 4.5 s at the loop's
    priority, 1.4 s at this one (medians of 3, docs/benchmarks.md)."""
    if not sys.platform.startswith("linux"):
        return  # elsewhere PRIO_PROCESS with a thread's id would name some process
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, max(WRITER_NICE, os.getpriority(os.PRIO_PROCESS, tid)))
    except OSError:  # a sandbox that refuses it: the write runs at the loop's priority
        pass


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        local = getattr(obj, "_local_tensor", None)  # a DTensor: this rank's shard
        yield local if isinstance(local, torch.Tensor) else obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def state_bytes(obj: Any) -> int:
    """The bytes of the distinct tensor storages in ``obj`` (what :func:`snapshot` copies;
    of a DTensor, this rank's shard)."""
    seen: dict[tuple[str, int], int] = {}
    for t in _tensors(obj):
        storage = t.untyped_storage()
        seen[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def available_memory() -> int | None:
    """The bytes of memory the system can give without swapping (``MemAvailable`` of
    /proc/meminfo), or None where that is not known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


Staging = dict[tuple[str, int], torch.UntypedStorage]


def snapshot(obj: Any, staging: Staging | None = None) -> Any:
    """A copy of ``obj`` (dicts, lists, tuples, tensors and plain values) in host memory
    that nothing else refers to: every tensor's storage copied once (a CPU one cloned, a
    CUDA one copied to the host without blocking, then waited for), plain values deep-copied.

    ``staging``: the host buffers of the previous snapshot, which nothing may still read
    (its write has ended). A storage of the same place and size is copied into its buffer
    of last time instead of a new one (pinned where it comes from a GPU), and ``staging``
    then holds this snapshot's buffers: saves one after another reuse one copy's memory
    rather than allocate a fresh one each time, which the allocator does not always give
    back between saves.
    """
    storages: Staging = {}
    cuda = False

    def copy_storage(t: torch.Tensor) -> torch.UntypedStorage:
        nonlocal cuda
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key not in storages:
            raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            on_gpu = t.device.type == "cuda"
            cuda = cuda or on_gpu  # a CUDA copy overlaps the others, waited for once below
            kept = staging.get(key) if staging is not None else None
            if staging is not None and (kept is None or kept.nbytes() != storage.nbytes()):
                kept = torch.empty(storage.nbytes(), dtype=torch.uint8,
                                   pin_memory=on_gpu).untyped_storage()
            if kept is not None:
                torch.empty(0, dtype=torch.uint8).set_(kept).copy_(raw, non_blocking=on_gpu)
                storages[key] = kept
            elif t.device.type == "cpu":
                storages[key] = raw.clone().untyped_storage()
            else:
                storages[key] = raw.to("cpu", non_blocking=on_gpu).untyped_storage()
        return storages[key]

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            dense = value.layout == torch.strided and type(value) in (torch.Tensor, torch.nn.Parameter)
            if not dense:
                return value.detach().to("cpu", copy=True)  # sparse, a subclass: a plain copy
            out = torch.empty(0, dtype=value.dtype)
            out.set_(copy_storage(value), value.storage_offset(), value.size(), value.stride())
            return out
        if isinstance(value, dict):  # a state_dict's OrderedDict stays one: the same pickle
            items = [(k, walk(v)) for k, v in value.items()]
            return OrderedDict(items) if isinstance(value, OrderedDict) else dict(items)
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, tuple):
            return tuple(walk(v) for v in value)
        return copy.deepcopy(value)

    out = walk(obj)
    if cuda:
        torch.cuda.synchronize()  # the non-blocking copies have landed
    if staging is not None:
        staging.clear()
        staging.update(storages)
    return out


class Saver:
    """Writes checkpoints in the background, one at a time, or in the loop (``mode``: the
    value of ``trainer.async_save``; ``capable`` False for a strategy whose save can only
    run in the loop's thread; ``quiet`` on the ranks that do not log)."""

    def __init__(self, mode: bool | None, capable: bool = True, quiet: bool = False):
        self.mode, self.capable, self.quiet = mode, capable, quiet
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._warned = False
        # The host buffers of the last background snapshot, reused by the next one (of a
        # staged save's, kept by DCP's stager).
        self._staging: Staging = {}
        self._host_staging = HostStaging()
        #: A hook for tests and measurements: called in the writer's thread before it writes
        #: (for :meth:`save_staged`, in DCP's thread, on every rank that sets it).
        self.before_write: Callable[[], None] | None = None

    @property
    def busy(self) -> bool:
        """Whether a background write is in flight."""
        return self._thread is not None and self._thread.is_alive()

    def save(self, write: Callable[[Any], None], state: Any,
             then: Callable[[], None] | None = None) -> None:
        """Write ``state`` with ``write(state)``, then call ``then`` (files to delete once the
        new one is on disk). In the background: ``state`` is copied first (:func:`snapshot`)
        and this returns before the write ends. Waits for the previous save, raising its
        failure."""
        self.wait()
        if state is None or not self._in_background(state):
            write(state)
            if then is not None:
                then()
            return
        copied = snapshot(state, self._staging)
        self._start(write, copied, then, hold=True)

    def release(self) -> None:
        """Wait for the save in flight, then let go of the buffers kept for the next
        snapshot (the run saves no more: what follows, its test, needs the memory)."""
        self.wait()
        self._staging.clear()
        self._host_staging.clear()

    def save_staged(self, start: Callable[[Any, Callable[[], None] | None, HostStaging],
                                          Callable[[], None]],
                    write: Callable[[Any], None], state: Any,
                    then: Callable[[], None] | None = None,
                    agree: Callable[[bool], bool] | None = None, peers: int = 1) -> None:
        """The save of a strategy whose every rank writes (fsdp), called by every rank at the
        same point: in the background, ``start(state, before_write, staging)`` runs here, in
        the loop's thread (it copies ``state`` to host memory, into ``staging``'s buffers of
        the last save where they fit, runs the save's collectives that must stay in the
        loop and starts the write) and returns what completes the save,
        which the writer's thread then runs, followed by ``then``; else ``write(state)``
        here. Under ``mode=None`` the verdict on the memory (``peers`` ranks of this host
        each copy their shards at once) is made the same on every rank by ``agree`` (a
        collective: every rank must take the same path). Waits for the previous save,
        raising its failure."""
        self.wait()
        background = self._in_background(state, peers)
        if self.mode is None and self.capable and agree is not None:
            background = agree(background)
        if not background:
            write(state)
            if then is not None:
                then()
            return
        complete = start(state, self._in_dcp_thread, self._host_staging)
        self._start(lambda _: complete(), None, then, hold=False)

    def _in_dcp_thread(self) -> None:
        lower_priority()
        if self.before_write is not None:
            self.before_write()

    def _start(self, write: Callable[[Any], None], state: Any, then: Callable[[], None] | None,
               hold: bool) -> None:
        self._thread = threading.Thread(target=self._run, args=(write, state, then, hold),
                                        name="ddpexp-checkpoint-writer")
        self._thread.start()

    def _in_background(self, state: Any, peers: int = 1) -> bool:
        if not self.capable or self.mode is False:
            return False
        if self.mode is True:
            return True
        # The buffers kept from the last snapshot are taken already: counted as free.
        kept = sum(buffer.nbytes() for buffer in self._staging.values())
        need, free = state_bytes(state) * peers, available_memory()
        free = None if free is None else free + kept
        if free is None or need <= free * _AVAILABLE_SHARE:
            return True
        if not self._warned and not self.quiet:
            self._warned = True
            log.warning("trainer.async_save: the checkpoint's %.0f MiB do not fit in half of the "
                        "%.0f MiB of memory available, so it is written in the loop; "
                        "trainer.async_save=true forces the background write",
                        need / 2**20, free / 2**20)
        return False

    def _run(self, write: Callable[[Any], None], state: Any, then: Callable[[], None] | None,
             hold: bool) -> None:
        lower_priority()
        try:
            if hold and self.before_write is not None:
                self.before_write()
            write(state)
            if then is not None:
                then()
        except BaseException as exc:  # raised in the loop's thread by poll() or wait()
            self._error = exc

    def poll(self) -> None:
        """Raise the failure of a background write that has ended (once); never waits."""
        if self._thread is not None and not self._thread.is_alive():
            self._finish()

    def wait(self) -> None:
        """Wait for the save in flight, if any; raise its failure (once)."""
        if self._thread is not None:
            self._thread.join()
            self._finish()

    def _finish(self) -> None:
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
