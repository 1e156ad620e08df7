"""The stall watchdog: heartbeats in shared memory, the stalled rank found, its stack taken,
every worker gone; first with real processes that mark phases by hand, then a real run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from ddpexp.launch import watchdog as wd
from ddpexp.runtime import heartbeat as hb

# in its stack dump. Local ranks 0 and 1 are global ranks 2 and 3, as on a second node.
WORKER = textwrap.dedent("""
    import sys, time
    from ddpexp.runtime.heartbeat import heartbeat_from_env
    beat = heartbeat_from_env(int(sys.argv[1]), rank=int(sys.argv[1]) + 2)
    for phase in map(int, sys.argv[2].split(",")):
        beat.mark(phase, 7)

    def stuck_in_user_code():
        time.sleep(60)

    print("ready", flush=True)
    stuck_in_user_code()
""")


def test_watchdog_dumps_the_stalled_ranks_stack_and_kills_the_workers(tmp_path: Path):
    log_file = tmp_path / "ddpexp.log"
    log_file.write_text("")
    dog = wd.Watchdog(nprocs=2, stall_s=1.0, log_file=str(log_file))
    procs = []
    try:
        with dog:
            env = dict(os.environ)  # the watchdog put its variables in this process's env
            assert env[hb.ENV_SLOTS] == dog.path
            phases = {0: f"{hb.DATA},{hb.FORWARD},{hb.BACKWARD}", 1: f"{hb.DATA},{hb.FORWARD}"}
            for rank in (0, 1):
                procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(rank), phases[rank]],
                                              env=env, stdout=subprocess.PIPE, text=True))
            for p in procs:
                assert p.stdout.readline().strip() == "ready"
            deadline = time.time() + 20
            while dog.message is None and time.time() < deadline:
                time.sleep(0.1)
            codes = [p.wait(timeout=10) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert hb.ENV_SLOTS not in os.environ and not Path(dog.path).exists()
    assert dog.message is not None
    assert f"rank 3 (pid {procs[1].pid}) stalled in forward at step 7" in dog.message
    assert "(rank 2 waited" in dog.message
    assert codes == [-9, -9]  # every local worker killed
    log = log_file.read_text()
    assert "[rank3] stalled in forward at step 7" in log
    # faulthandler's dump of rank 1, taken before it was killed.
    assert "stuck_in_user_code" in log and "most recent call first" in log
