"""Fixtures shared by both layers of the suite (helpers live in tests/helpers)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A fresh directory to run the CLI in (its outputs/ land there)."""
    return tmp_path
