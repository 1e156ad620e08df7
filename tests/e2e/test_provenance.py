"""Provenance, diff and rerun on a user's own git repo: a model module and a config dir of
their own, committed, then edited without a commit, as researchers work.

Every run is tiny (a character model of one embedding and one linear layer, a few steps on
a few hundred characters) and runs in this process."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import read_metrics, run_cli_here, run_cli_in_process

from ddpexp import diff, provenance, report, rerun

MODEL = textwrap.dedent('''
    from torch import nn


    class TinyLM(nn.Module):
        def __init__(self, vocab_size, dim=8):
            super().__init__()
            self.embed = nn.Embedding(vocab_size, dim)
            self.head = nn.Linear(dim, vocab_size)

        def forward(self, x):
            return self.head(self.embed(x))
''')
CORPUS = "the quick brown fox jumps over the lazy dog. " * 12


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                          check=True, capture_output=True, text=True, timeout=30).stdout


@pytest.fixture(autouse=True)
def forget_the_user_module():
    """Each test's repo has its own ``mynet``: none is left imported for the next test (a
    sweep in this process imports it outside the helpers that forget it)."""
    sys.modules.pop("mynet", None)
    yield
    sys.modules.pop("mynet", None)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A git repo holding the user's model module and config dir, committed; the data file
    lives outside it."""
    root = tmp_path / "proj"
    (root / "conf" / "model").mkdir(parents=True)
    (root / "mynet.py").write_text(MODEL)
    (root / "conf" / "model" / "tiny.yaml").write_text(
        "_target_: mynet.TinyLM\nvocab_size: ${data.num_classes}\ndim: 8\n")
    (tmp_path / "corpus.txt").write_text(CORPUS)
    _git(root, "init", "-q", "-b", "main")
    _git(root, "add", ".")
    _git(root, "commit", "-qm", "the model")
    return root


def _args(repo: Path, name: str, *extra: str) -> list[str]:
    return ["--config-dir", "conf", "model=tiny", "task=lm", "data=text",
            f"data.path={repo.parent / 'corpus.txt'}", "data.block_size=8", "data.batch_size=16",
            "trainer.max_epochs=1", "trainer.max_steps=4", "trainer.log_every_n_steps=2",
            "logger=csv", f"hydra.run.dir=outputs/{name}", *extra]


def _run(repo: Path, name: str, *extra: str) -> Path:
    run_cli_in_process(_args(repo, name, *extra), repo, env={"PYTHONPATH": str(repo)})
    return repo / "outputs" / name


def _diff(capsys, *args: str) -> tuple[int, str]:
    code = diff.main(list(args))
    out = capsys.readouterr()
    return code, out.out + out.err


def _edit_model(repo: Path, text: str) -> None:
    """Change the model's signature (its ``dim=...`` and what follows) to ``text``,
    uncommitted."""
    path = repo / "mynet.py"
    path.write_text(re.sub(r"dim=[^)]*\):", f"{text}):", path.read_text()))


def test_record_names_the_commit_and_the_uncommitted_change(repo: Path, capsys):
    _edit_model(repo, "dim=4 + 4")
    run = _run(repo, "a")
    record = provenance.read(run)
    code = record["code"]["repos"][0]
    assert code["path"] == str(repo.resolve())
    assert code["commit"] == _git(repo, "rev-parse", "HEAD").strip()
    assert code["branch"] == "main" and code["dirty"] and code["changed"] == ["mynet.py"]
    assert {"cwd", "config-dir", "_target_ mynet"} <= set(code["roles"])
    patch = (run / "code.patch").read_text()
    assert "+    def __init__(self, vocab_size, dim=4 + 4):" in patch
    assert code["patch"] == provenance.PATCH_FILE
    assert record["command"]["argv"] == _args(repo, "a")
    assert record["command"]["cwd"] == str(repo)
    [data] = record["data"]["files"]
    assert data["path"] == str(repo.parent / "corpus.txt") and data["size"] == len(CORPUS)
    assert record["packages"]["torch"] and record["versions"]["python"]
    assert record["machine"]["world"] == {"launcher": "ddpexp", "ranks": 1, "ranks_per_node": 1,
                                          "nodes": 1, "restart": 0}
    assert record["code"]["ddpexp"]["version"]

    # A second run that differs only in the learning rate: that one key, and nothing else
    # made it.
    other = _run(repo, "b", "optimizer.lr=0.1")
    code_, out = _diff(capsys, str(run), str(other), "--json")
    assert code_ == 0
    sections = json.loads(out)["sections"]
    assert sections["config"]["changes"] == [{"key": "optimizer.lr", "a": 0.05, "b": 0.1}]
    for name in ("code", "packages", "machine and environment", "data"):
        assert sections[name]["same"], (name, sections[name])
    assert not sections["results"]["same"]
    _, text = _diff(capsys, str(run), str(other))
    assert "config: 1 difference\n  optimizer.lr: 0.05 -> 0.1\n" in text
    assert "code: same\npackages: same\nmachine and environment: same\ndata: same\n" in text

    # An uncommitted edit of the model file, then a run: the code section shows that change.
    _edit_model(repo, "dim=2 * 4")
    (repo.parent / "corpus.txt").write_text(CORPUS + "and again. ")
    edited = _run(repo, "c")
    _, text = _diff(capsys, str(run), str(edited))
    assert "config: same\n" in text
    assert (f"code: 1 difference\n  mynet.py ({repo.resolve()}): the uncommitted changes differ\n"
            "    a only: +    def __init__(self, vocab_size, dim=4 + 4):\n"
            "    b only: +    def __init__(self, vocab_size, dim=2 * 4):\n") in text
    # ... and the changed data file shows under data.
    assert f"data: 1 difference\n  file {repo.parent / 'corpus.txt'}: {len(CORPUS)} bytes" in text

    # The report names what set run c apart beyond its overrides (it has none of its own).
    rows = {r.job: r for r in report.collect(repo / "outputs")}
    assert rows["c"].apart == ["other uncommitted changes", "other data"]
    assert rows["a"].apart == rows["b"].apart == []
    table = report.format_rows(list(rows.values()))
    assert "set apart by" in table.splitlines()[0]
    assert "other uncommitted changes, other data" in table


def test_a_sweep_diffs_as_its_swept_keys(repo: Path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(repo))
    args = [a for a in _args(repo, "x") if not a.startswith("hydra.run.dir")]
    code, out = run_cli_here(["-m", *args, "hydra/launcher=basic", "optimizer.lr=0.1,0.2",
                              "hydra.sweep.dir=outputs/sweep"], repo, monkeypatch,
                             capsys)
    assert code == 0, out
    code, text = _diff(capsys, str(repo / "outputs" / "sweep"))
    assert code == 0, text
    assert text.startswith(f"sweep {repo / 'outputs' / 'sweep'}: 2 jobs\n")
    assert "config: 1 key(s) vary\n  optimizer.lr: 0=0.1, 1=0.2\n  same in every job (" in text
    assert "code: same in every job" in text and "data: same in every job" in text
    result = diff.compare_sweep(repo / "outputs" / "sweep")
    assert {"seed", "data.block_size"} <= set(result["sections"]["config"]["same"])


def test_bad_input_is_one_message_and_exit_2(tmp_path: Path, capsys):
    code, text = _diff(capsys, str(tmp_path), str(tmp_path / "nothing"))
    assert code == 2 and text.count("\n") == 1 and "is not a run dir" in text
    assert rerun.main([str(tmp_path)]) == 2
    assert "holds no provenance.json" in capsys.readouterr().err
    # A path that is not there is said to be missing, not to be no run dir.
    code, text = _diff(capsys, str(tmp_path / "nothing"))
    assert code == 2 and text == f"ddpexp.diff: {tmp_path / 'nothing'} does not exist\n"
    assert rerun.main([str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err == f"ddpexp.rerun: {tmp_path / 'nothing'} does not exist\n"


def _rerun(*args: str) -> int:
    """``python -m ddpexp.rerun ARGS`` in this process; the user's modules it imported are
    forgotten afterwards (the next run imports them again, as its own process would)."""
    before = set(sys.modules)
    try:
        return rerun.main(list(args))
    finally:
        for name in set(sys.modules) - before:
            if name == "mynet" or name.startswith("mynet."):
                del sys.modules[name]


def test_rerun_reproduces_refuses_after_a_change_and_reproduces_in_a_worktree(repo: Path, capsys):
    _edit_model(repo, "dim=6")  # an uncommitted change in the run's patch
    run = _run(repo, "a")

    assert _rerun(str(run)) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "reproduced" in out
    [again] = (repo / "outputs" / "rerun").glob("*/*")
    assert read_metrics(again)["final"] == read_metrics(run)["final"]
    assert read_metrics(again)["best"] == read_metrics(run)["best"]

    path = repo / "mynet.py"  # another model now
    path.write_text(path.read_text().replace("self.embed(x))", "self.embed(x).tanh())"))
    assert _rerun(str(run)) == 1
    err = capsys.readouterr().err
    assert f"code: {repo / 'mynet.py'}: changed since the run" in err and "--force" in err
    assert len(list((repo / "outputs" / "rerun").glob("*/*"))) == 1  # nothing started

    # --force runs anyway: the other model's metrics, said so.
    assert _rerun(str(run), "--force") == 1
    err = capsys.readouterr().err
    assert "--force: running although" in err and f"did not reproduce {run}:\n  " in err

    # In a worktree of the recorded commit plus patch: the run's own model again.
    assert _rerun(str(run), "--in-worktree") == 0, capsys.readouterr()
    assert "reproduced" in capsys.readouterr().out
    assert ".tanh()" in path.read_text()  # the user's tree is left as it was
    assert len(list((repo / "outputs" / "rerun").glob("*/*"))) == 3
    assert _git(repo, "worktree", "list").count("\n") == 1  # the scratch worktree is gone


def test_a_resume_keeps_the_record_and_adds_its_own(repo: Path):
    run = _run(repo, "a")
    first = (run / provenance.PROVENANCE_FILE).read_text()
    _edit_model(repo, "dim=4 + 4")  # the code changed before the resume: its record says so
    run_cli_in_process([*_args(repo, "a"), f"resume={run}", "trainer.max_steps=6"], repo,
                       env={"PYTHONPATH": str(repo)})
    assert (run / provenance.PROVENANCE_FILE).read_text() == first
    again = provenance.read(run, resume=1)
    assert again["resume"] == 1 and again["code"]["repos"][0]["patch"] == "code-resume-1.patch"
    assert "dim=4 + 4" in (run / "code-resume-1.patch").read_text()
    assert (run / provenance.PATCH_FILE).read_text() == ""  # the first attempt's tree was clean
    assert read_metrics(run)["steps"] == 6


def test_rerun_in_a_worktree_runs_the_worktrees_own_ddpexp(tmp_path: Path):
    # ddpexp's own repo, installed editable (its src/ first on the path): a run, then an
    # uncommitted edit of its config. The rerun in a worktree must run the recorded code,
    # not the edited install, and so reproduce the run.
    import shutil

    from helpers import run_cli

    import ddpexp

    src = Path(ddpexp.__file__).parent.parent
    root = tmp_path / "ddpexp-repo"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("ddpexp", "hydra_plugins"):
        shutil.copytree(src / name, root / "src" / name, ignore=ignore)
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "ddpexp")
    editable = {"PYTHONPATH": str(root / "src")}
    args = ["data=synthetic", "data.shape=[1,4,4]", "data.num_samples=32", "data.val_samples=8",
            "model=mlp", "model.hidden=[8]", "trainer.max_epochs=1", "trainer.test=false",
            "~logger", "hydra.run.dir=outputs/a"]
    run_cli(args, root, env=editable)
    run = root / "outputs" / "a"
    recorded = provenance.read(run)["code"]["ddpexp"]
    assert recorded["path"] == str(root / "src" / "ddpexp") and recorded["dirty"] is False
    sgd = root / "src" / "ddpexp" / "conf" / "optimizer" / "sgd.yaml"
    sgd.write_text(sgd.read_text().replace("lr: 0.05", "lr: 0.5"))  # after the run

    res = run_cli(["outputs/a", "--in-worktree"], root, env=editable, module="ddpexp.rerun")
    assert "reproduced outputs/a" in res.stdout, res.output
    [again] = (root / "outputs" / "rerun").glob("*/*")
    used = provenance.read(again)["code"]["ddpexp"]["path"]
    assert "ddpexp-rerun-" in used and used != recorded["path"]  # the worktree's
    assert (again / ".hydra" / "config.yaml").read_text().count("lr: 0.05") == 1
    assert "lr: 0.5" in sgd.read_text()  # the edit is left as it was
