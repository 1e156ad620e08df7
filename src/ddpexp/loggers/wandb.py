"""Weights & Biases as a logger: one W&B run per ddpexp run or sweep job, whatever the number
of workers, continued on resume with every point once.

Global rank 0 alone builds it, and every call comes from its writer thread
(:mod:`ddpexp.loggers.writer`), so a slow upload never holds up training. It is offline by
default: the run's files go to ``<run dir>/wandb/`` and ``wandb sync <run dir>/wandb`` uploads
them later. ``logger.wandb.mode=online`` (or ``WANDB_MODE=online``) sends them as they come and
needs credentials (``wandb login`` or ``WANDB_API_KEY``), checked before the first step.

Steps: every point carries ``trainer/global_step`` (the run's optimizer step), which every
other metric is plotted against (``define_metric``); W&B's own ``_step`` only counts the calls.
A resumed session continues the same W&B run id (kept in the checkpoint and in
``<run dir>/wandb/ddpexp-run-id``) and drops the points it replays after the checkpoint that
the W&B run already holds: offline, read from the earlier sessions' ``.wandb`` files; online,
from the run's summary, where each flush records the last step of every key.

wandb is an optional dependency (``pip install -e ".[wandb]"``), imported only when this logger
opens its run: building it, and the launching process's ``prepare``, never start W&B's service
process, so each forked sweep job starts one of its own.
"""

from __future__ import annotations

import importlib
import json
import logging
import netrc
import os
import secrets
import string
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ddpexp.errors import ConfigError
from ddpexp.loggers.base import SUCCESS_STATUSES, Logger, RunInfo, StoreRefused, run_name

log = logging.getLogger(__name__)

STEP_KEY = "trainer/global_step"
# The summary key that holds, online, the last step stored of every metric.
STORED_KEY = "ddpexp/stored_steps"
RUN_ID_FILE = "ddpexp-run-id"
MODES = ("offline", "online", "disabled")
DEFAULT_HOST = "https://api.wandb.ai"


def require_wandb() -> Any:
    """Import wandb, or raise the ConfigError that says how to install it."""
    try:
        return importlib.import_module("wandb")
    except ImportError as exc:
        raise ConfigError(
            f"the W&B logger needs wandb, which does not import here ({exc}): "
            'pip install -e ".[wandb]" (or pip install wandb), or pick another logger '
            "(logger=tensorboard, logger=csv)") from exc


def resolve_mode(mode: str | None) -> str:
    """``logger.wandb.mode``, else ``WANDB_MODE``, else offline (W&B's ``dryrun`` is
    offline, ``run`` online)."""
    given = mode or os.environ.get("WANDB_MODE") or "offline"
    given = {"dryrun": "offline", "run": "online"}.get(given, given)
    if given not in MODES:
        raise ConfigError(f"mode={given!r}: W&B's mode is one of {', '.join(MODES)}")
    return given


def has_credentials(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether W&B can log in without asking: ``WANDB_API_KEY``, or an entry for the W&B host
    (``WANDB_BASE_URL``, default api.wandb.ai) in the netrc file (``NETRC`` or ~/.netrc),
    where ``wandb login`` writes it."""
    if environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(environ.get("WANDB_BASE_URL") or DEFAULT_HOST).hostname or ""
    path = environ.get("NETRC") or str(Path("~/.netrc").expanduser())
    try:
        entry = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def new_run_id() -> str:
    """A W&B run id as W&B makes them: 8 lowercase letters and digits."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def sweep_group(run: RunInfo) -> str | None:
    """The W&B group of a sweep job: its sweep dir's display name
    (``multirun/2026-12-01/10-20-00``); None for a single run."""
    return run_name(run.sweep_dir) if run.sweep_dir is not None else None


# The .wandb file: W&B's 7-byte header, then LevelDB's log format (32 KiB blocks of records,
# each a 7-byte header: CRC, length, type) around protobuf Records.
_W_HEADER = 7
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path: Path) -> Iterator[bytes]:
    """The records of a ``.wandb`` file, in order; a record cut off at the end (the process
    was killed while writing) is left out."""
    data = path.read_bytes()
    pos, parts = _W_HEADER, b""
    while pos + 7 <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < 7:  # the block's tail is padding
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        body = data[pos + 7:pos + 7 + length]
        if kind == 0 or len(body) < length:
            return
        pos += 7 + length
        if kind == _FULL:
            yield body
        elif kind == _FIRST:
            parts = body
        elif kind == _MIDDLE:
            parts += body
        elif kind == _LAST:
            yield parts + body
            parts = b""


def stored_steps(wandb_dir: Path, run_id: str) -> dict[str, int]:
    """The last ``trainer/global_step`` of every metric that the offline sessions of W&B run
    ``run_id`` under ``wandb_dir`` stored."""
    from wandb.proto import wandb_internal_pb2 as pb

    steps: dict[str, int] = {}
    for path in sorted(Path(wandb_dir).glob(f"*-{run_id}/run-{run_id}.wandb")):
        for raw in _records(path):
            record = pb.Record()  # pyright: ignore[reportAttributeAccessIssue]  # generated protobuf
            try:
                record.ParseFromString(raw)
            except Exception:  # protobuf's DecodeError: a damaged record ends the file
                break
            if record.WhichOneof("record_type") != "history":
                continue
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item}
            step = items.get(STEP_KEY)
            if not isinstance(step, (int, float)):
                continue
            for key in items:
                if not key.startswith("_") and key != STEP_KEY:
                    steps[key] = max(steps.get(key, -1), int(step))
    return steps


class WandbLogger(Logger):
    """One W&B run per ddpexp run: the resolved config, every metric point against
    ``trainer/global_step``, the final and best metrics and the status in its summary.

    ``project``, ``entity``, ``name`` (None = the run's display name), ``group`` (None = the
    sweep dir's name for a sweep job), ``job_type``, ``tags``, ``notes`` are W&B's own; ``mode``
    None = ``WANDB_MODE`` or offline; ``dir`` None = the run dir (W&B adds ``wandb/``)."""

    def __init__(self, project: str = "ddpexp", entity: str | None = None,
                 mode: str | None = None, name: str | None = None, group: str | None = None,
                 job_type: str | None = None, tags: list[str] | tuple[str, ...] = (),
                 notes: str | None = None, dir: str | None = None,
                 flush_every_points: int = 1000, flush_every_s: float = 5.0):
        self.mode = resolve_mode(mode)
        self.project, self.entity, self.name, self.group = project, entity, name, group
        self.job_type, self.tags, self.notes, self.dir = job_type, list(tags or ()), notes, dir
        self.flush_every_points, self.flush_every_s = int(flush_every_points), float(flush_every_s)
        self.run: Any = None
        self.run_id: str | None = None
        self._saved: dict = {}
        self._stored: dict[str, int] = {}
        self._last: dict[str, int] = {}
        self._dir: Path | None = None
        self._finished = False
        # A call failed (W&B's service gone): the writer has warned; the end says no more.
        self._broken = False

    @classmethod
    def prepare(cls, node: dict, outputs_root: Path) -> None:
        """wandb imports and, online, credentials are there; nothing of W&B starts here."""
        require_wandb()
        mode = resolve_mode(node.get("mode"))
        if mode == "online" and not has_credentials():
            raise StoreRefused(
                "mode", "online", "no W&B credentials here (no WANDB_API_KEY, no netrc entry "
                "for the W&B host): run wandb login or set WANDB_API_KEY, or log offline "
                "(logger.wandb.mode=offline) and upload later with wandb sync")

    def load_state_dict(self, state: dict) -> None:
        self._saved = dict(state or {})

    def state_dict(self) -> dict:
        return {"run_id": self.run_id} if self.run_id else dict(self._saved)

    def open(self, run: RunInfo) -> None:
        wandb = require_wandb()
        base = Path(self.dir) if self.dir else Path(run.run_dir)
        self._dir = base / "wandb"
        self._dir.mkdir(parents=True, exist_ok=True)
        id_file = self._dir / RUN_ID_FILE
        run_id = self._saved.get("run_id") or (id_file.read_text().strip() if id_file.is_file() else None)
        self.run_id = run_id or new_run_id()
        id_file.write_text(self.run_id + "\n")
        group = self.group or sweep_group(run)
        tags = self.tags or ([f"{k}={v}"[:64] for k, v in run.hparams.items()] if group else [])
        # W&B's service writes the offline .wandb file when a 32 KiB block fills, and by its
        # own default flushes it every 15 s: a job killed with its service (a cgroup, a
        # scheduler) lost every point since. At flush_every_s a kill loses at most that.
        cadence = ({"x_transaction_log_flush_interval": self.flush_every_s}
                   if "x_transaction_log_flush_interval" in getattr(wandb.Settings, "model_fields", {})
                   else {})
        settings = wandb.Settings(silent=True, console="off", save_code=False,
                                  x_save_requirements=False, **cadence)
        self.run = wandb.init(
            project=self.project, entity=self.entity, id=self.run_id, resume="allow",
            dir=str(base), mode=self.mode, name=self.name or run.name, group=group,
            job_type=self.job_type or ("sweep-job" if group else "train"), tags=tags,
            notes=self.notes, config=run.config, settings=settings, reinit="create_new")
        if run.resumed:
            self.run.config.update(run.config, allow_val_change=True)
            self._stored = self._stored_before()
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)

    def _stored_before(self) -> dict[str, int]:
        """The last step of each key that earlier sessions of this W&B run stored."""
        assert self._dir is not None and self.run_id is not None
        if self.mode == "offline":
            return stored_steps(self._dir, self.run_id)
        held = self.run.summary.get(STORED_KEY) if self.run is not None else None
        return {str(k): int(v) for k, v in dict(held or {}).items()}

    def log_metrics(self, metrics: Mapping[str, float], step: int, epoch: int) -> None:
        fresh = {k: v for k, v in metrics.items() if step > self._stored.get(k, -1)}
        if not fresh:
            return
        try:
            self.run.log({**fresh, STEP_KEY: step})
        except Exception:
            self._broken = True  # the writer counts the points lost and warns once
            raise
        for key in fresh:
            self._last[key] = step

    def flush(self) -> None:
        if self.run is not None and self.mode == "online" and self._last:
            self.run.summary[STORED_KEY] = {**self._stored, **self._last}

    def finalize(self, status: str) -> None:
        if self.run is None or self._finished:
            return
        self._finished = True
        try:
            self.run.summary["status"] = status
            self.run.finish(exit_code=0 if status in SUCCESS_STATUSES else 1)
        except Exception:
            # Its service is gone: let go of the client, or its exit hook prints a traceback.
            # Already warned (the points it lost) is warned enough.
            _let_go()
            if self._broken:
                return
            raise
        if self.mode == "offline" and self._dir is not None:
            log.info("W&B run %s written offline under %s; upload it with: wandb sync %s",
                     self.run_id, self._dir, self._dir)


def _let_go() -> None:
    """End this process's W&B client whatever state its service is in."""
    try:
        require_wandb().teardown()
    except Exception:  # the connection is already lost: nothing more to end
        pass
