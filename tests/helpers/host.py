"""What the tests that change the host share: one package install at a time."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator

LOCK = os.path.join(tempfile.gettempdir(), "ddpexp-tests-apt.lock")


@contextlib.contextmanager
def apt_lock() -> Iterator[None]:
    """Held around apt-get: test processes running side by side (pytest -n 2) each install
    what they miss, one after the other, instead of failing on dpkg's lock."""
    with open(LOCK, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
