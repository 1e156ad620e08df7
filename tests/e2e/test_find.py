"""``python -m ddpexp.find lr``: the range test's curve is the global loss, the same at 1
worker and at 2 with the same global batch; its files (lr.json, lr.png, TensorBoard scalars)
and printed command; bad input is one message; other runs are left as they were."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import read_scalars, run_cli

from ddpexp import find

TINY = ["model=mlp", "model.hidden=[16]", "data=synthetic", "data.shape=[1,4,4]",
        "data.num_classes=3", "data.num_samples=256", "data.val_samples=32", "~logger",
        "find.steps=30", "find.lr_min=1e-3", "find.lr_max=3"]


def test_the_curve_is_the_global_loss_at_any_world_size(workdir: Path):
    one = run_cli(["lr", *TINY, "data.batch_size=32", "hydra.run.dir=outputs/one"], workdir,
                  module="ddpexp.find", timeout=180)
    two = run_cli(["lr", *TINY, "trainer.procs=2", "data.batch_size=16", "hydra.run.dir=outputs/two"],
                  workdir, module="ddpexp.find", timeout=180)
    a = json.loads((workdir / "outputs/one/find/lr.json").read_text())
    b = json.loads((workdir / "outputs/two/find/lr.json").read_text())
    assert len(a["lr"]) == len(a["loss"]) == 30 and a["lr"] == b["lr"]
    assert a["lr"][0] == pytest.approx(1e-3) and a["lr"][-1] == pytest.approx(3)
    assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(a["loss"], b["loss"], strict=True))
    assert a["suggested_lr"] == b["suggested_lr"] and 1e-3 < a["suggested_lr"] < 3
    # The plot, TensorBoard's scalars (read with its own reader) and the printed command.
    assert (workdir / "outputs/one/find/lr.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    scalars = read_scalars(workdir / "outputs/two/tb")
    assert [v for _, v in scalars["find/loss"]] == pytest.approx(b["loss"])
    lr = f"{a['suggested_lr']:.3g}"
    assert f"suggested lr: {lr}" in one.stdout and f"suggested lr: {lr}" in two.stdout
    command = two.stdout.split("sweep around it with:\n", 1)[1].splitlines()[0].strip()
    assert command.startswith("python -m ddpexp -m model=mlp") and "trainer.procs=2" in command
    assert command.endswith(",".join(f"{a['suggested_lr'] * k:.2g}" for k in (1 / 3, 1, 3)))
    assert "2 worker(s)" in two.stdout


@pytest.mark.parametrize("args, message", [
    (["find.lr_min=1", "find.lr_max=0.1"], "find.lr_min=1.0 must be below find.lr_max=0.1"),
    (["find.steps=5"], "find.steps=5 is too few to fit a curve: give at least 20"),
    (["find.step=50"], "find.step: no such key of find lr; did you mean find.steps?"),
    (["-m", "optimizer.lr=0.1,0.2"], "not a sweep (-m)"),
    (["resume=outputs/x"], "it resumes nothing"),
    (["data.noise=nan"], "nan"),
])
def test_bad_input_is_one_message(tmp_path: Path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    code = find.main(["lr", *TINY[:7], *args])
    err = capsys.readouterr().err
    assert code == 1 and message in (err.lower() if message == "nan" else err), err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_search_leaves_other_runs_as_they_were(workdir: Path, monkeypatch, capsys):
    from helpers import run_cli_here

    code, text = run_cli_here([*TINY[:8], "trainer.max_epochs=1", "hydra.run.dir=outputs/run"],
                              workdir, monkeypatch, capsys)
    assert code == 0, text
    before = {p: p.read_bytes() for p in (workdir / "outputs").rglob("*") if p.is_file()}
    assert find.main(["lr", *TINY]) == 0
    after = {p: p.read_bytes() for p in (workdir / "outputs").rglob("*")
             if p.is_file() and "find" not in p.relative_to(workdir / "outputs").parts}
    assert after == before
    [searched] = (workdir / "outputs" / "find").glob("*/*")
    assert (searched / "find" / "lr.json").is_file() and not list(searched.rglob("*.pt"))
