"""From a resolved config to the parts a :class:`~ddpexp.training.trainer.Trainer` is made of: the
task, data, model, optimizer and scheduler (each by its ``_target_``), the callbacks and,
on global rank 0, the loggers."""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from ddpexp.callbacks.base import Callback
from ddpexp.config import components
from ddpexp.config.schema import TrainerConfig
from ddpexp.data.base import DataSource
from ddpexp.errors import ConfigError, DdpexpError
from ddpexp.loggers import build_loggers
from ddpexp.runtime.dist import DistContext, seed_everything
from ddpexp.training.probe import check_sample_shape

# Model keys that a data source may only know once it has read its files (the classes of an
# image folder, the vocabulary of a text, the shape of a Hugging Face dataset's rows): left null
# by the config, filled in after load().
_FROM_DATA = {"num_classes": "num_classes", "vocab_size": "num_classes", "input_shape": "shape"}


def build_parts(config: dict, trainer: TrainerConfig, ctx: DistContext) -> dict[str, Any]:
    """The keyword arguments of ``Trainer(ctx=..., run_dir=..., **parts)`` for a run of the
    resolved plain ``config``, typed as ``trainer``. ``parts["config"]`` is ``config`` with
    what only the data knows filled in (:func:`with_data_keys`); ``config`` itself is left
    as it is."""
    from hydra.utils import instantiate

    data: DataSource = instantiate(config["data"], _convert_="all")
    datasets = data.load()
    if not isinstance(datasets, (tuple, list)) or len(datasets) not in (2, 3):
        raise ConfigError(
            f"data._target_={config['data']['_target_']}: load() must return (train, val) "
            "or (train, val, test) datasets"
        )
    check_sample_shape(config["data"], datasets[0])
    config = with_data_keys(config, data)
    try:
        task = instantiate(config["task"], _convert_="all")
    except Exception as exc:  # Hydra wraps what the task's constructor raised
        if isinstance(exc.__cause__, DdpexpError):
            raise exc.__cause__ from None
        raise
    seed_everything(config["seed"])  # the same initial weights on every rank
    model = instantiate(config["model"], _convert_="all")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model._target_ built a {type(model).__name__}, not a torch.nn.Module")
    sched_cfg = config.get("scheduler")
    return dict(
        cfg=trainer, task=task, model=model, data=data,
        datasets=datasets, optimizer=instantiate(config["optimizer"]),
        scheduler=instantiate(sched_cfg) if sched_cfg and sched_cfg.get("_target_") else None,
        seed=config["seed"], config=config,
        callbacks=components.build("callbacks", config.get("callbacks"), Callback),
        loggers=build_loggers(config.get("logger") or {}) if ctx.is_main else {},
    )


def with_data_keys(config: dict, data: DataSource) -> dict:
    """A copy of ``config`` with the keys left null that ``data`` knows once loaded (its
    ``num_classes``, the model's ``num_classes``/``vocab_size``, the task's ``num_classes``)
    filled in from it; what checkpoints store, so that a resume or an evaluation rebuilds the
    same model."""
    config = copy.deepcopy(config)
    if config["data"].get("num_classes") is None and getattr(data, "num_classes", None):
        config["data"]["num_classes"] = data.num_classes
    if config["data"].get("shape") is None and (shape := getattr(data, "shape", None)):
        config["data"]["shape"] = list(shape)
    for key, attr in _FROM_DATA.items():
        if key in config["model"] and config["model"][key] is None:
            value = getattr(data, attr, None)
            config["model"][key] = list(value) if isinstance(value, tuple) else value
    if "num_classes" in config["task"] and config["task"]["num_classes"] is None:
        config["task"]["num_classes"] = config["data"].get("num_classes")
    return config
