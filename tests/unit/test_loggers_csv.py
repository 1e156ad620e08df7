"""metrics.csv (loggers/csv.py), written and read back."""

from __future__ import annotations

from ddpexp.callbacks import LearningRateMonitor, ModelCheckpoint
from ddpexp.loggers.base import RunInfo, outputs_root, run_name
from ddpexp.loggers.csv import FILENAME, CSVLogger, drop_rows_after, read_rows


def info(run_dir, resumed=False, step=0):
    return RunInfo(run_dir=run_dir, name="r", config={"a": 1}, hparams={}, resumed=resumed, step=step)


def test_rows_written_and_read_back(tmp_path):
    log = CSVLogger()
    log.open(info(tmp_path))
    log.log_metrics({"train/loss": 0.5, "train/acc": 1}, step=2, epoch=0)
    log.log_metrics({"val/loss": 0.25}, step=4, epoch=1)
    assert read_rows(tmp_path / FILENAME) == [(2, 0, "train/loss", 0.5), (2, 0, "train/acc", 1.0),
                                              (4, 1, "val/loss", 0.25)]
    log.finalize("completed")
    log.finalize("completed")
    assert (tmp_path / FILENAME).read_text().splitlines()[0] == "step,epoch,name,value"


def test_fresh_run_replaces_old_file(tmp_path):
    (tmp_path / FILENAME).write_text("step,epoch,name,value\n9,9,old,1.0\n")
    log = CSVLogger()
    log.open(info(tmp_path))
    log.finalize("completed")
    assert read_rows(tmp_path / FILENAME) == []


def test_resume_drops_rows_after_checkpoint_and_partial_rows(tmp_path):
    (tmp_path / FILENAME).write_text("step,epoch,name,value\n2,0,a,1.0\n4,0,a,2.0\n6,1,a,3.0\n8,1,a")
    log = CSVLogger()
    log.open(info(tmp_path, resumed=True, step=4))
    log.log_metrics({"a": 5.0}, step=6, epoch=1)
    log.finalize("completed")
    assert read_rows(tmp_path / FILENAME) == [(2, 0, "a", 1.0), (4, 0, "a", 2.0), (6, 1, "a", 5.0)]


def test_drop_rows_after_is_atomic_rewrite(tmp_path):
    path = tmp_path / FILENAME
    path.write_text("step,epoch,name,value\n1,0,a,1.0\nbad,row,x,y\n3,0,a,2.0\n")
    drop_rows_after(path, 1)
    assert path.read_text() == "step,epoch,name,value\n1,0,a,1.0\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [FILENAME]


def test_outputs_root_and_run_name(tmp_path):
    run = tmp_path / "outputs" / "multirun" / "d" / "t" / "3"
    assert outputs_root(run) == tmp_path / "outputs"
    assert run_name(run) == "multirun/d/t/3"
    assert outputs_root(tmp_path / "sweep" / "0") == tmp_path / "sweep"


def test_fit_logs_train_val_test_and_lr(trainer_factory, tmp_path):
    t = trainer_factory(callbacks={"checkpoint": ModelCheckpoint(), "lr": LearningRateMonitor()},
                        loggers={"csv": CSVLogger()}, max_epochs=2, lr=0.05)
    t.fit()
    rows = read_rows(tmp_path / "run" / FILENAME)
    names = {name for _, _, name, _ in rows}
    assert {"train/loss", "train/acc", "val/loss", "val/acc", "test/loss", "test/acc", "train/lr"} <= names
    lr = [(step, value) for step, _, name, value in rows if name == "train/lr"]
    assert lr == [(s, 0.05) for s in range(1, 9)]
    val_steps = [step for step, _, name, _ in rows if name == "val/acc"]
    assert val_steps == [4, 8]
