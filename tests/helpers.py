"""In-process helpers: compose the real config with Hydra's compose API and build a
one-process trainer from it, so that seams and arithmetic are tested without a subprocess."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from hydra import compose, initialize_config_module
from omegaconf import OmegaConf, open_dict

from ddpexp.config import register_configs

register_configs()


def compose_config(*overrides: str, config_dir: Optional[Path] = None) -> dict:
    """The resolved config (plain Python, as workers receive it) for ``overrides``, with the
    task's monitor filled in as a run's parent does. ``config_dir`` is a user's own config dir
    (``--config-dir``)."""
    from hydra.core.singleton import Singleton
    from hydra.version import VersionBase

    from ddpexp.launch import _resolve_monitor

    extra = [f"hydra.searchpath=[file://{config_dir}]"] if config_dir else []
    try:
        with initialize_config_module(version_base="1.3", config_module="ddpexp.conf"):
            cfg = compose("config", overrides=[*overrides, *extra])
    finally:
        # initialize_* leaves its version base in a process-wide singleton; Hydra's launcher
        # suites, later in this process, expect the unspecified (pre-1.2) default.
        Singleton._instances.pop(VersionBase, None)
    with open_dict(cfg):
        cfg.pop("hydra", None)
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    plain["trainer"]["strategy"] = "single"
    _resolve_monitor(plain)
    return plain


def build_trainer(run_dir: Path, overrides: Sequence[str] = (), config_dir: Optional[Path] = None):
    """A one-process :class:`ddpexp.trainer.Trainer` built from the composed config."""
    from ddpexp.dist import DistContext
    from ddpexp.trainer import Trainer

    plain = compose_config("trainer.progress_bar=false", *overrides, config_dir=config_dir)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return Trainer.from_config(plain, DistContext(), Path(run_dir))


def run_cli_here(args: Sequence[str], cwd: Path, monkeypatch, capsys) -> tuple[int, str]:
    """``python -m ddpexp ARGS`` in this process (Hydra's ``main`` included): its exit status
    and everything it printed. Milliseconds instead of a subprocess's seconds; for runs of
    one worker (several need processes of their own anyway)."""
    import sys

    import pytest

    import ddpexp.proc
    from ddpexp.__main__ import cli

    def exit_now(code: int = 0) -> None:  # the real one ends the process: end the call
        raise SystemExit(code)

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["ddpexp", *args])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(ddpexp.proc, "exit_now", exit_now)
    capsys.readouterr()  # what the test printed before is not the CLI's
    with pytest.raises(SystemExit) as exited:
        cli()
    code = exited.value.code
    out = capsys.readouterr()
    status = code if isinstance(code, int) else 1  # sys.exit("message") exits 1
    return status, out.out + out.err + (code if isinstance(code, str) else "")
