"""Each bad value's message (config/validate.py), on the real composed config."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from ddpexp.config.validate import check_ema_decay, validate
from ddpexp.errors import ConfigError


@pytest.fixture(scope="module")
def base():
    from helpers import compose_config

    return compose_config()


def check(base, **changes):
    cfg = OmegaConf.create(base)
    for key, value in changes.items():
        OmegaConf.update(cfg, key.replace("__", "."), value, merge=False, force_add=True)
    validate(cfg)


def test_default_config_is_valid(base):
    check(base)


@pytest.mark.parametrize("changes, message", [
    ({"trainer__precision": "64"}, "trainer.precision='64' is not one of 32, bf16, 16"),
    ({"trainer__gpus": -1}, "trainer.gpus=-1 must be >= 0"),
    ({"trainer__nodes": 0}, "trainer.nodes=0 must be >= 1"),
    ({"trainer__accumulate": 0}, "trainer.accumulate=0 must be >= 1"),
    ({"trainer__max_epochs": 0}, "trainer.max_epochs=0 must be >= 1"),
    ({"trainer__procs": 0}, r"trainer.procs=0 must be >= 1 \(or null\)"),
    ({"trainer__max_steps": 0}, r"trainer.max_steps=0 must be >= 1 \(or null\)"),
    ({"trainer__limit_val_batches": 0}, r"trainer.limit_val_batches=0 must be >= 1 \(or null\)"),
    ({"trainer__save_top_k": 0}, r"trainer.save_top_k=0 must be >= 1 \(or null\)"),
    ({"trainer__ema_decay": 1.0}, r"trainer.ema_decay=1.0 must be in \[0, 1\) \(e.g. 0.999\), or null"),
    ({"trainer__max_restarts": -1}, "trainer.max_restarts=-1 must be >= 0"),
    ({"trainer__dist_timeout_s": 0}, "trainer.dist_timeout_s=0 must be > 0"),
    ({"trainer__grad_clip": 0}, r"trainer.grad_clip=0 must be > 0 \(the max gradient norm"),
    ({"trainer__divergence_factor": 1}, r"trainer.divergence_factor=1 must be > 1"),
    ({"seed": -1}, r"seed=-1 must be >= 0 \(the base seed\)"),
    ({"optimizer__lr": "fast"}, r"optimizer.lr='fast' must be a number \(the learning rate\)"),
    ({"optimizer__lr": True}, r"optimizer.lr=True must be a number"),
    ({"data__num_workers": -2}, r"data.num_workers=-2 must be >= 0"),
    ({"trainer__nodes": 2}, "trainer.nodes=2 needs trainer.rdzv_endpoint=HOST:PORT"),
    ({"trainer__monitor": "loss"}, r"trainer.monitor='loss': the monitored metric is a validation metric"),
    ({"trainer__precision": "16"}, r"trainer.precision=16 \(fp16 with a gradient scaler\) needs a GPU"),
    ({"trainer__sync_batchnorm": True, "trainer__procs": 2}, "trainer.sync_batchnorm=true needs GPUs"),
    ({"data__batch_size": 1.5}, "data.batch_size=1.5 must be >= 1, a whole number"),
    ({"data__batch_size": 0}, "data.batch_size=0 must be >= 1, a whole number"),
    ({"data__prefetch_factor": 0}, "data.prefetch_factor=0 must be >= 1, a whole number, or null"),
    ({"data__prefetch_factor": 2}, r"data.prefetch_factor=2 needs data.num_workers > 0"),
    ({"model": {"hidden": 3}}, "the model config has no _target_; pick one with model=NAME"),
])
def test_bad_value_message(base, changes, message):
    with pytest.raises(ConfigError, match=message):
        check(base, **changes)


def test_missing_keys_named(base):
    cfg = OmegaConf.create(base)
    cfg.data.root = "???"
    with pytest.raises(ConfigError, match=r"these keys need a value: data.root \(e.g. data.root="):
        validate(cfg)


def test_check_ema_decay():
    check_ema_decay(None)
    check_ema_decay(0.0)
    check_ema_decay(0.999)
    with pytest.raises(ConfigError, match="trainer.ema_decay=-0.1 must be in"):
        check_ema_decay(-0.1)
