"""Process exit without interpreter teardown, for processes whose work is done.

Tearing down an interpreter that has torch (and torch._dynamo, TensorBoard) loaded takes
1-2 s on a 2-core machine: module teardown and garbage collection of a very large object
graph, none of which has an effect once every file is closed. Every worker of a run and the
``python -m ddpexp`` process itself pay it, in series, at the end of every run. This module
stays free of heavy imports, so ``__main__`` can use it.
"""

from __future__ import annotations

import logging
import os
import sys


def exit_now(code: int = 0) -> None:
    """Flush the logs and the standard streams, then end the process with ``code`` at once
    (``os._exit``: no interpreter teardown, no further atexit handlers)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
