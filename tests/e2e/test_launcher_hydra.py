"""The ddp launcher against Hydra's own launcher test suites, plus plugin discovery.

The suites run real sweeps through the launcher: every job is a real child process.
"""

from __future__ import annotations

import pytest
from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from hydra.test_utils.launcher_common_tests import IntegrationTestSuite, LauncherTestSuite

from hydra_plugins.ddpexp_launcher.ddp_launcher import DdpLauncher

pytestmark = pytest.mark.slow


def test_discovery() -> None:
    """Hydra finds the launcher through the hydra_plugins namespace package."""
    assert DdpLauncher.__name__ in [c.__name__ for c in Plugins.instance().discover(Launcher)]


@pytest.mark.parametrize("launcher_name, overrides", [("ddp", [])])
class TestDdpLauncher(LauncherTestSuite):
    """Hydra's LauncherTestSuite, run in this process (jobs are child processes)."""


@pytest.mark.parametrize(
    "task_launcher_cfg, extra_flags",
    [({"defaults": [{"override hydra/launcher": "ddp"}]}, ["-m"])],
)
class TestDdpLauncherIntegration(IntegrationTestSuite):
    """Hydra's IntegrationTestSuite: whole apps started as processes, sweeping with ddp."""
