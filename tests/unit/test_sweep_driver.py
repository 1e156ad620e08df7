"""The sweep driver's own logic (ddpexp.sweep.driver), which every backend shares: results in
order, fail_fast, resume=auto, time limits and the summary. The jobs are real Hydra jobs of a
tiny app, run in this process one at a time by a backend of this module."""

from __future__ import annotations

import pickle
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import summary_by_job
from hydra import initialize_config_dir
from hydra._internal.callbacks import Callbacks
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, run_job
from hydra.types import HydraContext, RunMode
from omegaconf import DictConfig, OmegaConf

from ddpexp.record import write_metrics
from ddpexp.sweep import driver
from ddpexp.sweep.backend import (
    Backend,
    Ended,
    HydraSetup,
    Job,
    JobFailed,
    JobSkipped,
    PackedReturn,
)
from ddpexp.sweep.settings import Sweep, SweepSettings

CONFIG = """\
x: 0
fail: false
hang: false
resume: null
hydra:
  sweep:
    subdir: ${hydra.job.num}
"""


def task(cfg: Any) -> float:
    """The app: fails when told to; else records a completed run whose best val/acc is x/10."""
    if cfg.fail:
        raise ValueError(f"x={cfg.x} is bad")
    value = cfg.x / 10
    write_metrics(Path(HydraConfig.get().runtime.output_dir),
                  {"status": "completed", "monitor": "val/acc", "best": {"val/acc": value}})
    return value


class InlineBackend(Backend):
    """One job at a time, run in this process by ``wait()``; a job of ``hang=true`` runs
    until it is forced to stop (it ignores the first, graceful stop)."""

    def __init__(self, hydra: HydraSetup) -> None:
        self.hydra = hydra
        self.job: Job | None = None
        self.started: list[int] = []
        self.stops: list[tuple[int, bool]] = []
        self.jobs: list[Job] = []

    def describe(self) -> str:
        return "one job at a time, in this process"

    @property
    def free(self) -> int:
        return 0 if self.job else 1

    def start(self, job: Job) -> bool:
        if self.job is not None:
            return False
        self.job, job.started = job, time.time()
        self.started.append(job.idx)
        self.jobs.append(job)
        assert job.config is not None and job.packed is None  # whole again to start it
        return True

    def wait(self, timeout: float) -> list[Ended]:
        job = self.job
        assert job is not None and job.config is not None
        if job.config.hang:
            if (job.idx, True) not in self.stops:
                return []
            self.job = None
            return [Ended(job, None, "it ended when forced to", "SIGKILL")]
        self.job = None
        ret = run_job(hydra_context=self.hydra.hydra_context, task_function=task,
                      config=job.config, job_dir_key="hydra.sweep.dir",
                      job_subdir_key="hydra.sweep.subdir")
        return [Ended(job, ret)]

    def stop(self, job: Job, force: bool = False) -> None:
        self.stops.append((job.idx, force))


class InlineLauncher:
    """A launcher whose sweep runs on :class:`InlineBackend`, set up as Hydra sets up one."""

    def __init__(self, config_dir: Path, sweep_dir: Path, **keys: Any) -> None:
        GlobalHydra.instance().clear()
        with initialize_config_dir(str(config_dir), version_base="1.3"):
            loader = GlobalHydra.instance().config_loader()
            config = loader.load_configuration("config", [f"hydra.sweep.dir={sweep_dir}"],
                                               run_mode=RunMode.MULTIRUN)
        self.backends: list[InlineBackend] = []
        self.sweep = Sweep.set_up(SweepSettings(**keys), "inline", self._backend,
                                  HydraContext(config_loader=loader, callbacks=Callbacks(config)),
                                  task, config)

    def _backend(self, settings: SweepSettings, hydra: HydraSetup) -> InlineBackend:
        self.backends.append(InlineBackend(hydra))
        return self.backends[-1]

    def launch(self, overrides: list[list[str]]) -> list:
        return list(driver.launch(self.sweep, overrides, initial_job_idx=0))


@pytest.fixture
def app(tmp_path: Path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text(CONFIG)
    return lambda sweep="sweep", **keys: InlineLauncher(tmp_path / "conf", tmp_path / sweep, **keys)


def test_every_job_runs_and_returns_in_order_and_the_summary_has_a_row_each(app, tmp_path):
    launcher = app()
    rets = launcher.launch([["x=1"], ["x=2"], ["x=3"]])
    assert [r.status for r in rets] == [JobStatus.COMPLETED] * 3
    assert [r.return_value for r in rets] == [0.1, 0.2, 0.3]
    rows = summary_by_job(tmp_path / "sweep")
    assert sorted(rows) == ["0", "1", "2"] and {r["status"] for r in rows.values()} == {"completed"}
    assert rows["1"]["overrides"] == "x=2"


def test_a_sweeps_jobs_of_other_values_are_copies_whose_run_dirs_hold_their_own(app, tmp_path):
    """Hydra composes the first job; the others are copies (ddpexp.sweep.compose), and each
    job's .hydra/ files and result hold its own values."""
    launcher = app()
    rets = launcher.launch([["x=1"], ["x=2"], ["x=3", "fail=true"], ["x=4"]])
    assert [r.return_value for r in rets if r.status == JobStatus.COMPLETED] == [0.1, 0.2, 0.4]
    composer = launcher.sweep.hydra.composer
    assert composer is not None and composer.composed == 2  # x=..., and x=..., fail=...
    for num, x in [(0, 1), (1, 2), (3, 4)]:
        job = tmp_path / "sweep" / str(num) / ".hydra"
        assert OmegaConf.load(job / "config.yaml").x == x
        assert list(OmegaConf.load(job / "overrides.yaml")) == [f"x={x}"]
        assert OmegaConf.load(job / "hydra.yaml").hydra.job.override_dirname == f"x={x}"


def test_a_waiting_job_keeps_its_config_packed_and_an_ended_one_lets_it_go(app, tmp_path):
    launcher = app()
    rets = launcher.launch([["x=1"], ["x=2"], ["x=3"]])
    assert [r.return_value for r in rets] == [0.1, 0.2, 0.3]  # each ran its own config
    jobs = launcher.backends[0].jobs
    assert [j.subdir for j in jobs] == ["0", "1", "2"]
    assert all(j.config is None and j.packed is None for j in jobs)
    assert [r.cfg.x for r in rets] == [1, 2, 3]  # Hydra's contract: each result its config
    assert all(isinstance(r, PackedReturn) for r in rets)  # kept compressed to the end


def test_a_failed_job_fails_alone_unless_fail_fast(app, tmp_path, capsys):
    overrides = [["x=1"], ["x=2", "fail=true"], ["x=3"]]
    launcher = app()
    rets = launcher.launch(overrides)
    assert [r.status for r in rets] == [JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.COMPLETED]
    assert launcher.backends[0].started == [0, 1, 2]
    error = rets[1]._return_value
    # The job's own exception, wrapped to point at its log rather than re-raised here.
    assert isinstance(error, JobFailed) and "job 1 failed with ValueError: x=2 is bad" in str(error)
    assert isinstance(error.original, ValueError)

    launcher = app(sweep="fail_fast", fail_fast=True)
    capsys.readouterr()
    rets = launcher.launch(overrides)
    assert launcher.backends[0].started == [0, 1]
    assert isinstance(rets[2]._return_value, JobSkipped)
    assert "an earlier job failed and hydra.launcher.fail_fast=true" in str(rets[2]._return_value)
    rows = summary_by_job(tmp_path / "fail_fast")
    assert [rows[k]["status"] for k in "012"] == ["completed", "failed", "not run"]
    said = "".join(capsys.readouterr())
    assert "1 of 3 job(s) failed" in said and "1 of 3 job(s) not run" in said


def test_resume_auto_skips_completed_jobs_and_refuses_another_sweeps_dir(app):
    first = app()
    first.launch([["x=1", "resume=auto"], ["x=2", "resume=auto"]])
    again = app()
    rets = again.launch([["x=1", "resume=auto"], ["x=2", "resume=auto"]])
    assert again.backends[0].started == []  # both completed before: their stored metric
    assert [r.return_value for r in rets] == [0.1, 0.2]
    other = app()
    rets = other.launch([["x=5", "resume=auto"], ["x=2", "resume=auto"]])
    assert other.backends[0].started == []
    assert rets[0].status == JobStatus.FAILED and "holds a run with overrides x=1, not x=5" in \
        str(rets[0]._return_value)
    assert rets[1].return_value == 0.2


def test_a_sweep_whose_job_dir_a_live_run_holds_is_refused_whole(app, tmp_path):
    import json
    import os
    import socket

    from ddpexp.errors import RunDirBusy

    first = app()
    first.launch([["x=1", "resume=auto"], ["x=2", "resume=auto"]])
    sweep = tmp_path / "sweep"
    before = (sweep / "summary.csv").read_text()
    # Job 1 is live in another process (this test's parent, which runs).
    (sweep / "1" / "metrics.json").unlink()
    (sweep / "1" / ".lock").write_text(json.dumps(
        {"host": socket.gethostname(), "pid": os.getppid(), "start": "2026-12-03T08:00:00+00:00"}))
    again = app()
    with pytest.raises(RunDirBusy, match=rf"run dir {sweep / '1'} is in use by a live run \(pid "
                                         rf"{os.getppid()}"):
        again.launch([["x=1", "resume=auto"], ["x=2", "resume=auto"]])
    assert again.backends == [] or again.backends[0].started == []
    assert (sweep / "summary.csv").read_text() == before


def test_a_job_over_timeout_s_is_stopped_then_forced(app, tmp_path):
    launcher = app(timeout_s=0, kill_grace_s=0)
    (ret,) = launcher.launch([["hang=true"]])
    assert launcher.backends[0].stops[:2] == [(0, False), (0, True)]
    assert ret.status == JobStatus.FAILED
    assert str(ret._return_value) == ("job 0: it ended when forced to after running over "
                                      "hydra.launcher.timeout_s")
    assert summary_by_job(tmp_path / "sweep")["0"]["status"] == "failed"


@pytest.mark.parametrize("target,drives", [
    ("hydra_plugins.ddpexp_launcher.ddp_launcher.DdpLauncher", True),
    ("hydra._internal.core_plugins.basic_launcher.BasicLauncher", False),
    ("no_such_package.Launcher", False),
    (None, False),
])
def test_the_summary_callback_leaves_the_table_to_launchers_the_driver_runs(target, drives):
    """Under a launcher that offers a backend the driver writes the table; under any other
    (Hydra's basic, submitit) ddpexp's SweepSummary callback does."""
    from ddpexp import report

    assert report._drives_its_sweep(target) is drives


def test_an_ended_jobs_return_keeps_its_configs_as_bytes_until_read():
    """The launcher holds every ended job's return to the sweep's end: its configs are kept
    compressed, each read gives an equal copy, the rest of the return is as it was."""
    cfg = OmegaConf.create({"x": 1, "table": list(range(2000))})
    hydra_cfg = OmegaConf.create({"hydra": {"job": {"name": "train"}}})
    ret = JobReturn(overrides=["x=1"], cfg=cfg, hydra_cfg=hydra_cfg, working_dir="0",
                    task_name="train", status=JobStatus.COMPLETED, _return_value=0.5)
    packed = PackedReturn.of(ret)
    held = vars(packed)
    assert not any(isinstance(v, DictConfig) for v in held.values())
    kept = sum(len(v) for v in held.values() if isinstance(v, bytes))
    assert 0 < kept < len(pickle.dumps(cfg)) / 8  # 10 KiB for 123 KiB of pickled nodes
    assert packed.cfg == cfg and packed.cfg is not cfg
    assert packed.hydra_cfg.hydra.job.name == "train"
    assert (packed.overrides, packed.working_dir, packed.task_name) == (["x=1"], "0", "train")
    assert packed.return_value == 0.5
    assert PackedReturn.of(packed) is packed
    assert PackedReturn.of(JobReturn(status=JobStatus.FAILED)).cfg is None
