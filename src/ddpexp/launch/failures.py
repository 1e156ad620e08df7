"""What a failed run leaves behind and how an operating-system error is told to the user.

:func:`guard_run` wraps the task function: whatever way a run fails, the run dir ends in a
state the user can act on. A run dir this process created that holds nothing but Hydra's
config and the log is removed (a config mistake leaves no empty run behind); a resume that
failed before it wrote a checkpoint takes its ``.hydra/resume-N`` with it; a second Ctrl-C
marks ``metrics.json`` interrupted instead of leaving it ``running``; and an ``OSError``
(an unreadable ``data.root``, a read-only or full disk) becomes one message naming the file
and the fix. :func:`explain_os_error` does the last for workers too.
"""

from __future__ import annotations

import errno
import functools
import shutil
import signal
import threading
from pathlib import Path
from typing import Any, Callable, Optional

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

from ddpexp.config.rundir import claimed_dirs
from ddpexp.errors import ConfigError, DdpexpError, RunInterrupted
from ddpexp.record import record_failure, run_started

# Files Hydra itself writes into a run dir before the task runs.
_HYDRA_ONLY = {".hydra"}


def explain_os_error(exc: OSError, data_root: Optional[str] = None,
                     run_dir: Optional[str] = None) -> DdpexpError:
    """``exc`` as one message: which file, what is wrong, which key or action fixes it."""
    name = exc.filename or "a file"
    where = _key_for(name, data_root, run_dir)
    if exc.errno == errno.ENOSPC:
        return ConfigError(
            f"no space left on the device that holds {name}. Free some space there, or point "
            f"{where} at another disk (nothing already saved was replaced by a partial file)")
    if exc.errno == errno.EDQUOT:
        return ConfigError(f"disk quota exceeded writing {name}. Free some space, or point "
                           f"{where} at another disk")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return ConfigError(f"permission denied: {name}. Give this user access to it, or "
                           f"point {where} at a place it can use")
    if exc.errno == errno.EROFS:
        return ConfigError(f"{name} is on a read-only file system; point {where} at a "
                           "writable place")
    return ConfigError(f"{exc.strerror or exc}: {name} (check {where})")


def _key_for(filename: str, data_root: Optional[str], run_dir: Optional[str]) -> str:
    path = Path(str(filename)).absolute()
    for key, base in (("data.root", data_root), ("hydra.run.dir", run_dir)):
        if base and (path == Path(base).absolute() or Path(base).absolute() in path.parents):
            return key
    return "data.root or hydra.run.dir"


def guard_run(task: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Wrap the task function (``launch.run``) with the clean-up described above."""

    @functools.wraps(task)
    def guarded(cfg: Any) -> Any:
        hydra_cfg = HydraConfig.get()
        run_dir = Path(hydra_cfg.runtime.output_dir)
        config_dir = _newest_config_dir(run_dir)
        last = run_dir / "checkpoints" / "last.pt"
        last_before = _stamp(last)
        started = run_started()
        try:
            return task(cfg)
        except KeyboardInterrupt:
            exc: BaseException = RunInterrupted(
                "stopped by a second SIGINT before a checkpoint was saved; the last one (if "
                f"any) is in {run_dir}/checkpoints", signal="SIGINT")
            record_failure(run_dir, exc, started)
            _ignore_further_interrupts()
            raise exc from None
        except OSError as err:
            root = _select(cfg, "data.root")
            exc = explain_os_error(err, str(root) if root else None, str(run_dir))
            record_failure(run_dir, exc, started)
            raise exc from None
        except BaseException as exc:
            if isinstance(exc, RunInterrupted):
                _ignore_further_interrupts()
            _tidy(run_dir, config_dir, last, last_before, fresh=_fresh(run_dir, hydra_cfg))
            raise

    return guarded


def _ignore_further_interrupts() -> None:
    """A run stopped by Ctrl-C has saved what it could and is reporting how to continue; a
    second Ctrl-C in that moment would only replace the message by a traceback. (Each run
    installs its own handlers while it trains.)"""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _tidy(run_dir: Path, config_dir: Path, last: Path, last_before: Any, fresh: bool) -> None:
    """Remove what a failed run added without doing any work."""
    if fresh and run_dir.is_dir():
        left = {p.name for p in run_dir.iterdir() if p.suffix != ".log"}
        if left <= _HYDRA_ONLY:
            shutil.rmtree(run_dir, ignore_errors=True)
            return
    if config_dir.name.startswith("resume-") and _stamp(last) == last_before:
        shutil.rmtree(config_dir, ignore_errors=True)


def _newest_config_dir(run_dir: Path) -> Path:
    """The ``.hydra`` subdir Hydra just wrote this run's config to: ``.hydra/resume-N`` with
    the largest N when the dir held a run already. (Resolving ``hydra.output_subdir`` again
    would name the next one.)"""
    resumes = [p for p in (run_dir / ".hydra").glob("resume-*") if p.name[7:].isdigit()]
    if not resumes:
        return run_dir / ".hydra"
    return max(resumes, key=lambda p: int(p.name[7:]))


def _fresh(run_dir: Path, hydra_cfg: Any) -> bool:
    """Whether this process created ``run_dir`` for this run (not a resumed or named dir)."""
    return hydra_cfg.mode == RunMode.RUN and str(run_dir) in claimed_dirs()


def _stamp(path: Path) -> Optional[int]:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def _select(cfg: Any, key: str) -> Any:
    try:
        return OmegaConf.select(cfg, key, default=None)
    except Exception:  # noqa: BLE001 - an unresolvable value is no root to name
        return None
