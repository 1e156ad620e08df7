"""Run dirs written by ddpexp 0.1.0 (tests/fixtures/rundirs, made before the package layout
changed): a ddp run with top-k and EMA, an fsdp run with a sharded ``last.pt``. Every later
version must still evaluate them to the test metrics they recorded and resume them."""

from __future__ import annotations

import io
import json
import shutil
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch
from helpers import read_metrics
from omegaconf import OmegaConf

FIXTURES = Path(__file__).parents[1] / "fixtures" / "rundirs"


def eval_main(*args: str) -> tuple[int, str]:
    from ddpexp import eval as ddpexp_eval

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = ddpexp_eval.main(list(args))
    return code, out.getvalue() + err.getvalue()


def copy_of(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def test_every_target_a_saved_config_names_resolves():
    from hydra.utils import get_class, get_method

    for name in ("ddp_topk_ema", "fsdp_sharded"):
        for path in (FIXTURES / name / ".hydra").glob("*.yaml"):
            found = [v for v in _values(OmegaConf.to_container(OmegaConf.load(path)))
                     if isinstance(v, tuple)]
            for _key, target in found:
                try:
                    get_class(target)
                except (ImportError, ValueError):
                    get_method(target)
    assert found


def _values(node, key=""):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "_target_" and isinstance(v, str):
                yield (key, v)
            else:
                yield from _values(v, f"{key}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _values(v, f"{key}[{i}]")


@pytest.mark.parametrize("name", ["ddp_topk_ema", "fsdp_sharded"])
def test_saved_run_evaluates_to_its_recorded_test_metrics(name: str, tmp_path: Path):
    run_dir = copy_of(name, tmp_path)
    recorded = read_metrics(run_dir)["test"]
    code, out = eval_main(str(run_dir))
    assert code == 0, out
    record = json.loads(sorted(run_dir.glob("eval-*.json"))[-1].read_text())
    assert record["metrics"]["test/loss"] == pytest.approx(recorded["test/loss"], rel=1e-5)
    assert record["metrics"]["test/acc"] == pytest.approx(recorded["test/acc"], abs=1e-9)


def test_saved_top_k_files_and_sharded_last_load_with_weights_only():
    for path in (FIXTURES / "ddp_topk_ema" / "checkpoints").glob("*.pt"):
        state = torch.load(path, weights_only=True)
        assert "model" in state and state["config"]["trainer"]["ema_decay"] == 0.9
    meta = FIXTURES / "fsdp_sharded" / "checkpoints" / "last.pt" / "meta.pt"
    assert torch.load(meta, weights_only=True)["world_size"] == 2


@pytest.mark.parametrize("name,extra", [
    ("ddp_topk_ema", ["trainer.max_epochs=4"]),
    ("fsdp_sharded", ["trainer.max_epochs=3", "trainer.strategy=fsdp"]),
    # Across strategies: a sharded last.pt (a directory) becomes a file, and the reverse.
    ("fsdp_sharded", ["trainer.max_epochs=3", "trainer.strategy=ddp"]),
    ("fsdp_sharded", ["trainer.max_epochs=3", "trainer.strategy=single"]),
    ("ddp_topk_ema", ["trainer.max_epochs=4", "trainer.strategy=fsdp"]),
], ids=["ddp-single", "fsdp-fsdp", "fsdp-ddp", "fsdp-single", "ddp-fsdp"])
def test_saved_run_resumes_to_the_end(name: str, extra: list, tmp_path: Path, monkeypatch, capsys):
    from helpers import run_cli_here

    run_dir = copy_of(name, tmp_path)
    before = read_metrics(run_dir)
    # The command it was started with, at one worker and for one more epoch.
    saved = OmegaConf.load(run_dir / ".hydra" / "overrides.yaml")
    kept = [o for o in saved if o.split("=")[0] not in
            {"hydra.run.dir", "trainer.procs", "trainer.max_epochs", "trainer.strategy"}]
    code, out = run_cli_here([*kept, f"resume={run_dir}", "trainer.procs=1", *extra], tmp_path,
                             monkeypatch, capsys)
    assert code == 0, out
    after = read_metrics(run_dir)
    assert after["status"] == "completed"
    # What this resume changed, and nothing that only this version's defaults changed (0.1.0
    # logged the lr every step, this version every 20) or added (flush_timeout_s).
    changed = {c["key"] for c in after["resume_changes"]}
    assert "trainer.max_epochs" in changed
    assert changed <= {"trainer.max_epochs", "trainer.procs", "trainer.strategy"}, changed
    assert after["epochs"] == before["epochs"] + 1
    assert after["history"][: len(before["history"])] == before["history"]
    # Saved as this strategy saves it: a sharded dir under fsdp, else one file.
    last = run_dir / "checkpoints" / "last.pt"
    assert last.is_dir() == ("trainer.strategy=fsdp" in extra)
    assert not (run_dir / "checkpoints" / "last.pt.previous").exists()


def test_a_sharded_last_gives_one_process_its_weights_and_optimizer_state(tmp_path: Path):
    from helpers import build_trainer

    from ddpexp.checkpoint import sharded as ckpt_sharded
    from ddpexp.training import checkpoint_state as schema

    run_dir = copy_of("fsdp_sharded", tmp_path)
    saved = OmegaConf.load(run_dir / ".hydra" / "overrides.yaml")
    kept = [o for o in saved if o.split("=")[0] not in {"trainer.procs", "trainer.strategy"}]
    trainer = build_trainer(tmp_path / "single", kept)
    last = run_dir / "checkpoints" / "last.pt"
    schema.load(trainer, last)
    whole = ckpt_sharded.load_sharded(last, keys=ckpt_sharded.SHARDED_KEYS)
    state = trainer.optimizer.state_dict()
    for i, (name, param) in enumerate(trainer.module.named_parameters()):
        assert torch.equal(param.detach(), whole["model"][name]), name
        for key, value in whole["optimizer"]["state"][name].items():
            assert torch.equal(torch.as_tensor(state["state"][i][key]), torch.as_tensor(value)), (name, key)
    assert trainer.step == torch.load(last / "meta.pt", weights_only=True)["step"] > 0
