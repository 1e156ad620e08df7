"""A sweep job's console lines carry its ``#N`` (runtime/jobtag.py): its own process's
handlers and its workers' (launch/worker.py setup_logging), on stdout and stderr; the run's
log file stays untagged. (tests/e2e/test_launcher.py runs a real sweep of two jobs.)"""

from __future__ import annotations

import logging

import pytest

from ddpexp.runtime.jobtag import JOB_TAG_ENV, TaggedFormatter, tag_console


@pytest.fixture
def root_handlers():
    """The root logger's handlers and level, put back after the test."""
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    yield root
    for handler in list(root.handlers):
        root.removeHandler(handler)
        if handler not in before:
            handler.close()
    for handler in before:
        root.addHandler(handler)
    root.setLevel(level)


def test_a_workers_console_lines_carry_the_job_tag_and_its_file_not(tmp_path, monkeypatch, capsys,
                                                                    root_handlers):
    from ddpexp.launch.worker import setup_logging

    monkeypatch.setenv(JOB_TAG_ENV, "#3")
    log_file = tmp_path / "ddpexp.log"
    setup_logging(1, str(log_file))  # rank 1: its warnings, on stderr
    logging.getLogger("ddpexp").warning("two\nlines")
    err = capsys.readouterr().err
    assert err.splitlines()[0].startswith("#3 [") and err.splitlines()[0].endswith(
        "][ddpexp][WARNING][rank1] - two")
    assert err.splitlines()[1] == "#3 lines"  # every line of a message
    assert log_file.read_text().startswith("[")  # the job's own file: untagged
    setup_logging(0, str(log_file))
    logging.getLogger("ddpexp").info("rank 0")
    assert capsys.readouterr().out.startswith("#3 [")


def test_tagging_is_once_and_only_in_a_sweep_job(monkeypatch, root_handlers):
    stream = logging.StreamHandler()
    stream.setFormatter(logging.Formatter("%(message)s"))
    root_handlers.addHandler(stream)
    monkeypatch.delenv(JOB_TAG_ENV, raising=False)
    tag_console()
    assert not isinstance(stream.formatter, TaggedFormatter)  # no sweep job: as it was
    monkeypatch.setenv(JOB_TAG_ENV, "#0")
    tag_console()
    tag_console()
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello", None, None)
    assert stream.format(record) == "#0 hello"
