"""``data=hf``: Hugging Face datasets read from real files (a Parquet file written by pyarrow,
a ``save_to_disk`` directory of three splits), trained, evaluated and resumed bit-exactly;
and the one message each for a missing file, a missing column and an empty split."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import build_trainer, read_metrics, rows, run_cli, sweep_cases
from helpers import write_parquet_rows as write_parquet
from helpers.files import CLASSES, FEATURES

from ddpexp.errors import ConfigError


def write_saved(path: Path) -> Path:
    from ddpexp.data.hf import datasets_module

    datasets = datasets_module()

    parts = {name: datasets.Dataset.from_dict(rows(n, seed))
             for name, n, seed in (("train", 200, 1), ("validation", 40, 2), ("test", 40, 3))}
    datasets.DatasetDict(parts).save_to_disk(str(path))
    return path


COMMON = ["data=hf", "data.input_column=features", "data.target_column=label", "model=mlp",
          "model.hidden=[16]", "data.batch_size=16", "trainer.log_every_n_steps=1",
          "trainer.max_epochs=4"]


@pytest.mark.slow
def test_parquet_and_a_saved_dir_train_evaluate_and_resume_bit_exactly(workdir):
    """Each source: 20 steps uninterrupted against 8 steps (mid-epoch) resumed to 20, the
    same metrics and weights; the test split of the saved dir evaluated; ddpexp.eval reads
    the checkpoint back to the same validation loss."""
    parquet = write_parquet(workdir / "rows.parquet")
    saved = write_saved(workdir / "saved")
    sources = {"pq": [f"data.path={parquet}"], "disk": [f"data.path={saved}"]}
    runs = sweep_cases(workdir, {f"{name}_{steps}": [*source, f"trainer.max_steps={steps}"]
                                 for name, source in sources.items() for steps in (20, 8)},
                       COMMON, timeout=240)
    (workdir / "conf").rename(workdir / "conf-first")
    (workdir / "sweep").rename(workdir / "sweep-first")
    first = {name: workdir / "sweep-first" / run.name for name, run in runs.items()}
    resumed = sweep_cases(workdir, {name: [*source, "trainer.max_steps=20",
                                           f"resume={first[f'{name}_8']}"]
                                    for name, source in sources.items()}, COMMON, timeout=240)
    from ddpexp.checkpoint.io import load

    for name in sources:
        whole, again = read_metrics(first[f"{name}_20"]), read_metrics(resumed[name])
        assert whole["status"] == again["status"] == "completed"
        assert read_metrics(first[f"{name}_8"])["epochs"] == 0  # stopped mid-epoch
        assert again["final"] == whole["final"] and again["steps"] == 20
        assert again.get("test") == whole.get("test")
        a = load(first[f"{name}_20"] / "checkpoints" / "last.pt")["model"]
        b = load(resumed[name] / "checkpoints" / "last.pt")["model"]
        assert all(torch.equal(a[k], b[k]) for k in a)
    # The saved dir's own test split (40 rows) was evaluated; the Parquet file has none.
    assert "test/loss" in read_metrics(first["disk_20"])["test"]
    assert not read_metrics(first["pq_20"]).get("test")
    res = run_cli([str(first["disk_20"]), "split=val"], workdir, module="ddpexp.eval")
    row = next(line.split() for line in res.stdout.splitlines()
               if line.startswith(first["disk_20"].name + " "))
    assert float(row[3]) == pytest.approx(read_metrics(first["disk_20"])["final"]["val/loss"],
                                          abs=1e-4)


def test_hf_rows_are_tensors_of_the_columns_and_val_is_held_out(tmp_path):
    """In process: a Parquet file without a validation split has 10% of its rows held out
    (fixed seed, no row in both); shape and classes are read off the data."""
    from ddpexp.data.hf import HF

    source = HF(path=str(write_parquet(tmp_path / "rows.parquet")), input_column="features",
                target_column="label", batch_size=8)
    train, val = source.load()
    assert (len(train), len(val)) == (216, 24)
    assert source.shape == (FEATURES,) and source.num_classes == CLASSES
    x, y = train[0]
    assert x.dtype == torch.float32 and x.shape == (FEATURES,) and y.dtype == torch.int64
    batch = train.__getitems__([0, 5, 7])
    assert torch.equal(batch[1][0], train[5][0])
    seen = {tuple(train[i][0].tolist()) for i in range(len(train))}
    assert not any(tuple(val[i][0].tolist()) in seen for i in range(len(val)))
    trainer = build_trainer(tmp_path / "run", ["data=hf", f"data.path={tmp_path / 'rows.parquet'}",
                                               "data.input_column=features",
                                               "data.target_column=label", "model=mlp",
                                               "trainer.max_steps=3", "trainer.test=false"])
    assert trainer.fit()["status"] == "completed"


@pytest.mark.parametrize("overrides,message", [
    ({"path": "missing.parquet"}, "data.path={dir}/missing.parquet does not exist"),
    ({"path": "rows.parquet", "input_column": "pixels"},
     "data.input_column='pixels' is not a column of the train split of {dir}/rows.parquet; "
     "its columns: features, label"),
    ({"data_files": {"train": "rows.parquet", "validation": "empty.parquet"}},
     "the validation split of {dir}/rows.parquet, {dir}/empty.parquet is empty "
     "(no rows in {dir}/empty.parquet)"),
    ({"path": "rows.txt"}, "cannot tell the format of {dir}/rows.txt from its ending"),
])
def test_bad_hf_input_is_one_message(tmp_path, overrides, message):
    from ddpexp.data.hf import HF

    write_parquet(tmp_path / "rows.parquet")
    write_parquet(tmp_path / "empty.parquet", n=0)
    (tmp_path / "rows.txt").write_text("1,2\n")
    args = {"input_column": "features", "target_column": "label", **overrides}
    if "path" in args:
        args["path"] = str(tmp_path / args["path"])
    else:
        args["data_files"] = {k: str(tmp_path / v) for k, v in args["data_files"].items()}
    with pytest.raises(ConfigError) as err:
        HF(**args).load()
    assert message.format(dir=tmp_path) in str(err.value)


def test_json_lines_by_split_and_a_csv_file_are_read_too(tmp_path):
    """``data_files`` by split (JSON lines: the validation split is the file's, not held out
    of train) and one CSV file of a numeric input column (held out, classes from the ints)."""
    import json

    from ddpexp.data.hf import HF

    for name, n, seed in (("train", 30, 4), ("val", 10, 5)):
        data = rows(n, seed)
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for x, y in zip(data["features"], data["label"], strict=True):
                f.write(json.dumps({"features": x, "label": y}) + "\n")
    source = HF(data_files={"train": str(tmp_path / "train.jsonl"),
                            "validation": str(tmp_path / "val.jsonl")},
                input_column="features", target_column="label")
    train, val = source.load()
    assert (len(train), len(val)) == (30, 10)
    assert torch.allclose(val[0][0], torch.tensor(rows(10, 5)["features"][0]))
    (tmp_path / "rows.csv").write_text("x,y\n" + "".join(f"{i / 10},{i % 2}\n" for i in range(40)))
    train, val = HF(path=str(tmp_path / "rows.csv")).load()
    assert len(train) + len(val) == 40 and len(val) == 4
    x, y = train[0]
    assert x.dtype == torch.float32 and x.ndim == 0 and y.dtype == torch.int64
