"""Fixtures shared by both layers of the suite (helpers live in tests/helpers)."""

from __future__ import annotations

import copy
import logging
import signal
from pathlib import Path

import pytest

_SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP]


@pytest.fixture(autouse=True)
def fresh_process_state():
    """What a run in this process (``helpers.run_cli_here``, Hydra's launcher suites, a
    trainer) leaves behind is gone before the next test: Hydra's global state (GlobalHydra,
    the HydraConfig singleton, its version base), the run dirs ddpexp claimed, signal
    handlers and the logging handlers a worker installs. Each such test then starts as a
    fresh ``python -m ddpexp`` would."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.singleton import Singleton

    from ddpexp.config import rundir

    hydra_state = copy.deepcopy(Singleton.get_state())
    handlers = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    loggers = {name: (lg.handlers[:], lg.level, lg.propagate) for name, lg in
               [("", logging.getLogger()), *logging.Logger.manager.loggerDict.items()]
               if isinstance(lg, logging.Logger)}
    claimed = dict(rundir._CLAIMED)
    yield
    GlobalHydra.instance().clear()
    Singleton.set_state(hydra_state)
    rundir._CLAIMED.clear()
    rundir._CLAIMED.update(claimed)
    for sig, handler in handlers.items():
        if handler is not None:
            signal.signal(sig, handler)
    for name, lg in [("", logging.getLogger()), *logging.Logger.manager.loggerDict.items()]:
        if not isinstance(lg, logging.Logger):
            continue
        before, level, propagate = loggers.get(name, ([], logging.NOTSET, True))
        for handler in lg.handlers[:]:
            if handler not in before:
                lg.removeHandler(handler)
                handler.close()  # a worker's FileHandler holds the run's ddpexp.log open
        lg.handlers[:] = before
        lg.setLevel(level)
        lg.propagate = propagate


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A fresh directory to run the CLI in (its outputs/ land there)."""
    return tmp_path
