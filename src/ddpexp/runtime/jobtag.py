"""The tag of a sweep job's console lines: ``#N``, the job's number, as the launcher's own
lines name the job (``#0 : seed=0``).

Jobs that run at once write to one terminal; without a tag their lines cannot be told apart.
The sweep hands each job's process its tag (:data:`JOB_TAG_ENV`, which the job's workers
inherit), and the console handlers of the job's process and of its workers put it before each
line (:func:`tag_console`). The run's own log file is one per job and stays untagged.
"""

from __future__ import annotations

import logging
import os

# The tag a sweep job's process and its workers put before their console lines.
JOB_TAG_ENV = "DDPEXP_JOB_TAG"


class TaggedFormatter(logging.Formatter):
    """``inner``'s lines, each (a traceback's too) after ``tag`` and a space."""

    def __init__(self, inner: logging.Formatter, tag: str) -> None:
        super().__init__()
        self.inner, self.tag = inner, tag

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(f"{self.tag} {line}" for line in self.inner.format(record).split("\n"))


def tag_console(logger: logging.Logger | None = None) -> None:
    """Put this process's job tag (:data:`JOB_TAG_ENV`) before the lines of ``logger``'s
    (default: the root logger's) console handlers, not its files; nothing outside a sweep
    job. Called again, it tags nothing twice."""
    tag = os.environ.get(JOB_TAG_ENV)
    if not tag:
        return
    for handler in (logger or logging.getLogger()).handlers:
        if (isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
                and not isinstance(handler.formatter, TaggedFormatter)):
            handler.setFormatter(TaggedFormatter(handler.formatter or logging.Formatter(), tag))
