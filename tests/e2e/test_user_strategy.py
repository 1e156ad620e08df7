"""A user's own strategy (tests/plugins/userstrategy.py, a DDP subclass in the user's own
module) named on the command line, by dotted path and as a ``_target_`` node: it is the
class every rank builds, and the run trains as DDP does."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import only_run_dir, read_metrics, run_cli, run_cli_in_process, run_dirs

PLUGINS = str(Path(__file__).parents[1] / "plugins")
TINY = ["data=synthetic", "data.shape=[6]", "data.num_classes=3", "data.num_samples=256",
        "data.val_samples=101", "model=mlp", "model.hidden=[16]", "trainer.max_epochs=1"]

pytestmark = pytest.mark.slow


def user_env(marker_dir: Path) -> dict:
    path = os.pathsep.join(filter(None, [PLUGINS, os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "USERSTRATEGY_DIR": str(marker_dir)}


def markers(marker_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(marker_dir.glob("strategy-rank*.json"))]


def test_a_user_strategy_by_dotted_path_trains_two_workers(workdir):
    marks = workdir / "marks"
    marks.mkdir()
    res = run_cli([*TINY, "trainer.procs=2", "trainer.strategy=userstrategy.CountingDDP"],
                  workdir, env=user_env(marks))
    m = read_metrics(only_run_dir(workdir))
    assert m["status"] == "completed" and m["world_size"] == 2
    assert "2 worker(s): strategy=userstrategy.CountingDDP" in res.output
    # Each rank built the user's class, wrapped its model once in DDP, and sharded the data
    # by the strategy's data-parallel rank and size.
    assert [(k["cls"], k["wraps"], k["wrapped"], k["dp_rank"], k["dp_size"]) for k in markers(marks)] == [
        ("CountingDDP", 1, "DistributedDataParallel", 0, 2),
        ("CountingDDP", 1, "DistributedDataParallel", 1, 2)]


def test_a_user_strategy_as_a_target_node_gets_its_keyword_arguments(workdir):
    marks = workdir / "marks"
    marks.mkdir()
    res = run_cli_in_process(
        [*TINY, "trainer.strategy={_target_:userstrategy.CountingDDP,note:hello}"], workdir,
        env=user_env(marks))
    assert read_metrics(only_run_dir(workdir))["status"] == "completed"
    assert "1 worker(s): strategy=userstrategy.CountingDDP" in res.output
    assert [(k["cls"], k["note"], k["dp_size"]) for k in markers(marks)] == [("CountingDDP", "hello", 1)]


def test_an_unknown_strategy_is_refused_naming_the_allowed_ones(workdir):
    res = run_cli_in_process([*TINY, "trainer.strategy=dpp"], workdir, expect_ok=False)
    assert res.returncode != 0 and "Traceback" not in res.output
    assert ("trainer.strategy: Invalid value 'dpp', expected one of [auto, ddp, fsdp, dp, single], "
            "or a strategy class by its dotted path") in res.output
    assert run_dirs(workdir) == []  # refused before the first step: no run dir left
