"""One run at a time in a run dir: a second process that resumes into a live run is refused,
naming the holder, and changes nothing in the dir; once the first run ends its lock is gone
and the resume works."""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path

import pytest
from helpers import finish, read_metrics, run_cli, start_cli, stop_session, wait_for
from test_checkpoint_signals import HUGE, LONG


def snapshot(run_dir: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file under ``run_dir``: its size, mtime and bytes (and every dir, empty ones
    included, by its name)."""
    found: dict[str, tuple[int, int, bytes]] = {}
    for path in sorted(run_dir.rglob("*")):
        rel = str(path.relative_to(run_dir))
        if path.is_dir():
            found[rel + "/"] = (0, 0, b"")
        else:
            stat = path.stat()
            found[rel] = (stat.st_size, stat.st_mtime_ns, path.read_bytes())
    return found


@pytest.mark.slow
def test_resume_into_a_live_run_is_refused_until_it_ends(workdir):
    run_dir = workdir / "outputs" / "live"
    first = start_cli([*LONG, HUGE, f"hydra.run.dir={run_dir}"], workdir)
    try:
        wait_for(run_dir / "checkpoints" / "last.pt", first)
        held = json.loads((run_dir / ".lock").read_text())
        # The run's own process holds it: the CLI process, which runs its one worker.
        assert (held["host"], held["pid"]) == (socket.gethostname(), first.pid)
        # Frozen (alive, writing nothing) while the second process tries, so that whatever
        # changes in the dir meanwhile is the second process's doing.
        stop_session(first.pid)
        before = snapshot(run_dir)
        # Refused before Hydra starts (resume= names the dir), and by the run's own claim
        # of the lock (a run dir the command line names only through an interpolation).
        for args, env in (([f"resume={run_dir}"], None),
                          (["hydra.run.dir=${oc.env:LIVE_RUN}", "resume=auto"],
                           {"LIVE_RUN": str(run_dir)})):
            second = run_cli(args, workdir, timeout=120, env=env, expect_ok=False)
            assert second.returncode != 0, second.output
            assert "Traceback" not in second.output, second.output
            assert second.stderr.strip().startswith(
                f"run dir {run_dir} is in use by a live run (pid {first.pid} on host "
                f"{socket.gethostname()}, since {held['start'][:10]}"), second.stderr
            assert second.stdout == "", second.stdout
            assert snapshot(run_dir) == before
        os.killpg(first.pid, signal.SIGCONT)
        first.send_signal(signal.SIGTERM)
        res = finish(first, 90)
    finally:
        try:
            os.killpg(first.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert res.returncode != 0 and not res.leftovers
    assert read_metrics(run_dir)["status"] == "interrupted"
    assert not (run_dir / ".lock").exists()
    steps = read_metrics(run_dir)["steps"]
    again = run_cli([*LONG, f"resume={run_dir}", f"trainer.max_steps={steps + 2}"], workdir,
                    timeout=150)
    assert "taking over the lock" not in again.output
    done = read_metrics(run_dir)
    assert done["status"] == "completed" and done["steps"] == steps + 2
    assert (run_dir / ".hydra" / "resume-1" / "config.yaml").exists()
    assert not (run_dir / ".lock").exists()
