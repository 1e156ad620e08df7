"""The loggers seam on its own: the ``logger`` group composes, ``build_loggers`` refuses bad
entries, and each logger, driven as the trainer drives it, leaves what its own reader reads back
(TensorBoard's EventAccumulator, the csv module, MlflowClient), also across a resume (several
processes writing one MLflow database at once: tests/e2e/test_mlflow_runs.py)."""

from __future__ import annotations

import csv
import io
import math
import re
from pathlib import Path

import pytest
import yaml

from ddpexp.config.compose import compose_single_process
from ddpexp.errors import ConfigError
from ddpexp.loggers import (
    CSVLogger,
    Logger,
    MLflowLogger,
    RunInfo,
    TensorBoardLogger,
    build_loggers,
    prepare_loggers,
)
from ddpexp.loggers.mlflow import end_state, flatten_params, require_mlflow

CONF = Path(__file__).resolve().parents[2] / "src" / "ddpexp" / "conf"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "config.md"
ALL = "logger=[tensorboard,csv,mlflow]"


class RecordingLogger(Logger):
    """A user's own logger: overrides only what it records."""

    def __init__(self, prefix: str = ""):
        self.prefix = prefix
        self.points: list = []

    def log_metrics(self, metrics, step, epoch):
        self.points += [(self.prefix + k, step) for k in metrics]


@pytest.fixture(scope="module")
def config() -> dict:
    return compose_single_process([ALL])


def _run(root: Path, config: dict, name: str = "2026-12-01/10-20-00", resumed: bool = False,
         step: int = 0) -> RunInfo:
    run_dir = root / name
    run_dir.mkdir(parents=True, exist_ok=True)
    return RunInfo(run_dir=run_dir, name=name, config=config,
                   hparams={"optimizer.lr": 0.1, "model": "mlp"}, resumed=resumed, step=step)


def _session(logger: Logger, run: RunInfo, steps: range, offset: float, status: str,
             saved=None, checkpoint_at=None) -> dict:
    """Drive ``logger`` as the trainer does; returns its state_dict taken at ``checkpoint_at``."""
    if saved is not None:
        logger.load_state_dict(saved)
    logger.open(run)
    if not run.resumed:
        logger.log_hparams(run.hparams)
    state = None
    for s in steps:
        logger.log_metrics({"train/loss": offset + 1.0 / s, "lr": 0.1}, step=s, epoch=s // 4)
        if s % 4 == 0:
            logger.log_metrics({"val/acc": offset + s / 100, "epoch": s // 4}, step=s, epoch=s // 4)
        if s == checkpoint_at:
            state = logger.state_dict()
    logger.finalize(status)
    return state


# ------------------------------------------------------------------ config and building
def test_logger_group_composes_as_a_dict_by_name(config):
    assert list(config["logger"]) == ["tensorboard", "csv", "mlflow"]
    assert config["logger"]["mlflow"] == {
        "_target_": "ddpexp.loggers.MLflowLogger", "tracking_uri": None,
        "experiment_name": "ddpexp", "run_name": None, "flush_every_points": 1000,
        "flush_every_s": 10, "flush_timeout_s": 30}
    built = build_loggers({**config["logger"], "csv": {**config["logger"]["csv"],
                                                       "flush_timeout_s": 2.5}})
    assert [type(v) for v in built.values()] == [TensorBoardLogger, CSVLogger, MLflowLogger]
    # The writer's key is set on the built logger, not passed to its constructor.
    assert [v.flush_timeout_s for v in built.values()] == [30.0, 2.5, 30.0]
    assert list(compose_single_process([])["logger"]) == ["tensorboard"]
    assert compose_single_process(["~logger"])["logger"] == {}
    own = compose_single_process(["logger=csv", f"+logger.mine._target_={__name__}.RecordingLogger",
                                  "+logger.mine.prefix=x/"])["logger"]
    built = build_loggers(own)
    assert list(built) == ["csv", "mine"] and built["mine"].prefix == "x/"


@pytest.mark.parametrize("name,node,match", [
    ("nope", {"flush_secs": 1}, r"logger\.nope has no _target_"),
    ("gone", {"_target_": "ddpexp.no_such_module.Logger"},
     r"logger\.gone\._target_=ddpexp\.no_such_module\.Logger does not import"),
    ("dict", {"_target_": "collections.OrderedDict"},
     r"logger\.dict\._target_=collections\.OrderedDict is not a subclass of ddpexp\.Logger"),
    ("tb", {"_target_": "ddpexp.loggers.TensorBoardLogger", "flush_sec": 3},
     r"logger\.tb \(ddpexp\.loggers\.TensorBoardLogger\) could not be built: .*flush_sec"),
    ("mlflow", {"_target_": "ddpexp.loggers.MLflowLogger", "flush_every_points": 0},
     r"logger\.mlflow: flush_every_points=0 must be"),
    ("csv", {"_target_": "ddpexp.loggers.CSVLogger", "flush_timeout_s": -1},
     r"logger\.csv\.flush_timeout_s=-1 must be a number of seconds >= 0"),
])
def test_a_bad_entry_is_one_config_error_naming_it(name, node, match):
    entries = {"tensorboard": {"_target_": "ddpexp.loggers.TensorBoardLogger"}, name: node}
    with pytest.raises(ConfigError, match=match):
        build_loggers(entries)
    if name in ("nope", "gone", "dict"):
        with pytest.raises(ConfigError, match=match):
            prepare_loggers(entries, Path("unused"))


def test_missing_mlflow_says_how_to_install_it():
    # The import path logger=mlflow takes when mlflow is absent, pointed at a name that is
    # not installed.
    with pytest.raises(ConfigError, match=re.escape('pip install -e ".[mlflow]"')) as err:
        require_mlflow("ddpexp_absent_tracking_package")
    assert "ddpexp_absent_tracking_package" in str(err.value)


def test_run_info_finds_the_outputs_root(tmp_path):
    sweep_job = RunInfo(tmp_path / "outputs/multirun/D/T/3", "multirun/D/T/3", {}, {}, False, 0)
    assert sweep_job.outputs_root == tmp_path / "outputs"
    elsewhere = RunInfo(tmp_path / "mine", "other", {}, {}, False, 0)
    assert elsewhere.outputs_root == tmp_path


def test_docs_name_every_logger_key():
    doc = DOCS.read_text()
    for path in sorted((CONF / "logger").glob("*.yaml")):
        (name, node), = yaml.safe_load(path.read_text()).items()
        assert f"`{name}`" in doc
        assert node["_target_"].rsplit(".", 1)[-1] in doc
        for key in node:
            if key != "_target_":
                assert f"`logger.{name}.{key}`" in doc, f"logger.{name}.{key}"


# ------------------------------------------------------------------ each logger, read back
def _tb(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _hparams_data(acc):
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    out = {}
    for tag, content in acc.PluginTagToContent("hparams").items():
        out[tag] = HParamsPluginData.FromString(content)
    return out


def test_tensorboard_logger_writes_scalars_config_and_hparams(tmp_path, config):
    run = _run(tmp_path, config)
    _session(TensorBoardLogger(), run, range(1, 9), 0.0, "completed")
    acc = _tb(run.run_dir)
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == \
        [(s, pytest.approx(1.0 / s)) for s in range(1, 9)]
    assert [e.step for e in acc.Scalars("val/acc")] == [4, 8]
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert yaml.safe_load(text.strip("`").removeprefix("yaml\n")) == config
    data = _hparams_data(acc)
    start = data["_hparams_/session_start_info"].session_start_info.hparams
    assert start["optimizer.lr"].number_value == 0.1 and start["model"].string_value == "mlp"
    from tensorboard.plugins.hparams.api_pb2 import Status

    assert data["_hparams_/session_end_info"].session_end_info.status == Status.STATUS_SUCCESS


def _csv_rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_csv_logger_writes_one_row_per_point_flushed_at_each_call(tmp_path, config):
    run = _run(tmp_path, config)
    logger = CSVLogger()
    logger.open(run)
    logger.log_metrics({"train/loss": 0.5, "lr": 0.1}, step=1, epoch=0)
    # Readable before the logger is closed: a crash keeps what was logged.
    assert (run.run_dir / "metrics.csv").read_text().splitlines() == [
        "step,epoch,name,value", "1,0,train/loss,0.5", "1,0,lr,0.1"]
    logger.log_metrics({"test/acc": 0.875}, step=2, epoch=1)
    logger.finalize("completed")
    logger.finalize("completed")
    assert _csv_rows(run.run_dir)[-1] == {"step": "2", "epoch": "1", "name": "test/acc",
                                          "value": "0.875"}


def _mlflow_client(root: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri="sqlite:///" + str((root / "mlflow.db").resolve()))


def test_mlflow_logger_stores_params_metrics_status_and_best(tmp_path, config):
    root = tmp_path / "outputs"
    cfg = {**config, "notes": "x" * 7000, "extra": {f"k{i}": i for i in range(150)}}
    run = _run(root, cfg)
    (run.run_dir / "checkpoints").mkdir()
    (run.run_dir / "checkpoints" / "best.pt").write_bytes(b"")
    logger = MLflowLogger(flush_every_points=5000, flush_every_s=1000)
    logger.open(run)
    logger.log_hparams(run.hparams)
    for s in range(1, 301):  # 1,800 points: two batches at the end
        logger.log_metrics({f"train/m{k}": s + k for k in range(6)}, step=s, epoch=0)
    logger.log_metrics({"train/loss": float("nan")}, step=301, epoch=0)  # a diverged step
    logger.finalize("completed")

    client = _mlflow_client(root)
    stored = client.get_run(logger.run_id)
    params = flatten_params(cfg)
    params["notes"] = "x" * 5997 + "..."
    assert stored.data.params == {**params, "model": "mlp"}
    assert stored.data.params["trainer.max_epochs"] == str(config["trainer"]["max_epochs"])
    history = client.get_metric_history(logger.run_id, "train/m3")
    assert sorted((m.step, m.value) for m in history) == [(s, s + 3.0) for s in range(1, 301)]
    assert math.isnan(client.get_metric_history(logger.run_id, "train/loss")[0].value)
    assert stored.info.run_name == "2026-12-01/10-20-00"
    assert stored.info.status == "FINISHED"
    assert stored.data.tags["ddpexp.status"] == "completed"
    assert stored.data.tags["ddpexp.best_checkpoint"] == str((run.run_dir / "checkpoints/best.pt").resolve())
    experiment = client.get_experiment(stored.info.experiment_id)
    assert experiment.name == "ddpexp"
    assert [end_state(s) for s in ("early_stopped", "stopped", "interrupted", "diverged",
                                   "pruned", "failed")] == \
        ["FINISHED", "FINISHED", "KILLED", "FAILED", "FAILED", "FAILED"]


def test_finalize_is_safe_without_open_and_twice(tmp_path):
    for logger in (TensorBoardLogger(), CSVLogger(), MLflowLogger()):
        logger.finalize("failed")
        logger.finalize("failed")
        assert logger.state_dict() == {}


# ------------------------------------------------------------------ resume
def test_resume_continues_every_logger_without_a_step_twice(tmp_path, config):
    import torch

    root = tmp_path / "outputs"
    first_run = _run(root, config)
    first = build_loggers(config["logger"])
    # The checkpoint is written at step 6; steps 7..10 are logged, then the session ends
    # (interrupted) and the next one resumes from step 6 and logs 7..12 again, with new values.
    states = {}
    for name, logger in first.items():
        states[name] = _session(logger, first_run, range(1, 11), 0.0, "interrupted",
                                checkpoint_at=6)
    client = _mlflow_client(root)
    run_id = states["mlflow"]["run_id"]
    assert client.get_run(run_id).info.status == "KILLED"
    # What goes into the checkpoint is plain data that the safe loader reads.
    buf = io.BytesIO()
    torch.save({"loggers": states}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)["loggers"]

    resumed = _run(root, config, resumed=True, step=6)
    second = build_loggers(config["logger"])
    for name, logger in second.items():
        _session(logger, resumed, range(7, 13), 100.0, "completed", saved=saved[name])
    assert second["mlflow"].run_id == run_id

    acc = _tb(resumed.run_dir)
    tb_loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert [s for s, _ in tb_loss] == list(range(1, 13))
    assert tb_loss[7][1] == pytest.approx(100 + 1 / 8)  # the resumed session's value
    assert [e.step for e in acc.Scalars("val/acc")] == [4, 8, 12]

    rows = _csv_rows(resumed.run_dir)
    csv_loss = [(int(r["step"]), float(r["value"])) for r in rows if r["name"] == "train/loss"]
    assert [s for s, _ in csv_loss] == list(range(1, 13))
    assert csv_loss[7][1] == pytest.approx(100 + 1 / 8)

    stored = client.get_run(run_id)
    assert len(client.search_runs([stored.info.experiment_id])) == 1
    for key, steps in (("train/loss", range(1, 13)), ("val/acc", (4, 8, 12))):
        history = client.get_metric_history(run_id, key)
        assert sorted(m.step for m in history) == list(steps), key
    # MLflow cannot delete points, so it keeps those stored before the resume (the same
    # values an exact resume computes again).
    loss = {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")}
    assert loss[8] == pytest.approx(1 / 8) and loss[11] == pytest.approx(100 + 1 / 11)
    assert stored.info.status == "FINISHED" and stored.data.tags["ddpexp.status"] == "completed"


def test_mlflow_resume_without_saved_state_finds_the_run_by_its_dir(tmp_path, config):
    root = tmp_path / "outputs"
    first = MLflowLogger()
    _session(first, _run(root, config), range(1, 5), 0.0, "failed")
    second = MLflowLogger()
    _session(second, _run(root, config, resumed=True, step=4), range(5, 7), 0.0, "completed")
    assert second.run_id == first.run_id
    steps = sorted(m.step for m in _mlflow_client(root).get_metric_history(first.run_id, "lr"))
    assert steps == list(range(1, 7))


def test_a_refused_sweep_job_is_one_failed_mlflow_run_with_its_error(tmp_path, config):
    from ddpexp.loggers import record_refusal

    root = tmp_path / "outputs"
    job = root / "multirun/2026-12-01/10-20-00/3"
    job.mkdir(parents=True)
    record_refusal({"mlflow": config["logger"]["mlflow"], "csv": config["logger"]["csv"]}, job,
                   config, {"trainer.gpus": 4}, "trainer.gpus=4 but 0 GPU(s) are visible")
    (run,) = _mlflow_client(root).search_runs(
        [_mlflow_client(root).get_experiment_by_name("ddpexp").experiment_id])
    assert run.info.status == "FAILED" and run.info.run_name == "multirun/2026-12-01/10-20-00/3"
    assert run.data.tags["ddpexp.status"] == "failed"
    assert run.data.tags["ddpexp.error"] == "trainer.gpus=4 but 0 GPU(s) are visible"
    assert run.data.tags["ddpexp.run_dir"] == str(job)
    assert run.data.params["trainer.max_epochs"] == str(config["trainer"]["max_epochs"])
    assert not (job / "metrics.csv").exists()  # the csv logger records nothing of it
