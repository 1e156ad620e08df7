"""The strategy registry (strategies/registry.py): names, dotted paths and ``_target_`` nodes,
the refusals' messages, what each built-in answers, and the callers that ask it (the
launching process's plan, the sweep's worker count, the loaders' shards)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ddpexp import strategies
from ddpexp.errors import ConfigError
from ddpexp.launch.fanout import plan_run, world_plan
from ddpexp.launch.world import detect
from ddpexp.runtime.dist import DistContext
from ddpexp.strategies import registry
from ddpexp.strategies.base import Local, Strategy
from ddpexp.strategies.ddp import DDP
from ddpexp.strategies.dp import DataParallel
from ddpexp.sweep.job import job_workers
from ddpexp.training import loaders


class MyDDP(DDP):
    """A user's DDP, named by this module's path."""

    def __init__(self, t, ctx, bucket: int = 0):
        super().__init__(t, ctx)
        self.bucket = bucket


class OneProcess(Local):
    """A user's strategy that never spans processes."""


class Pairs(Local):
    """A model-parallel stand-in: ranks 2k and 2k+1 hold halves of one replica."""

    @property
    def dp_rank(self) -> int:
        return self.ctx.rank // 2

    @property
    def dp_size(self) -> int:
        return self.ctx.world_size // 2


MINE = f"{__name__}.MyDDP"


def trainer(strategy="auto", gpus=0, procs=None, nodes=1):
    return SimpleNamespace(strategy=strategy, gpus=gpus, procs=procs, nodes=nodes)


def test_names_auto_first_then_the_builtins():
    assert registry.names() == ["auto", "ddp", "fsdp", "dp", "single"]


@pytest.mark.parametrize("name, spans, one, sharded, channels_last", [
    ("single", False, False, False, True),
    ("dp", False, True, False, True),
    ("ddp", True, False, False, True),
    ("fsdp", True, False, True, False),
])
def test_what_each_builtin_answers(name, spans, one, sharded, channels_last):
    cls = registry.strategy_class(name)
    assert issubclass(cls, Strategy) and cls.name == name and cls.label() == name
    assert (cls.spans_processes, cls.one_process, cls.sharded, cls.channels_last) == (
        spans, one, sharded, channels_last)


def test_auto_resolves_in_one_place():
    assert registry.resolve_auto(1) == "single" and registry.resolve_auto(2) == "ddp"
    assert registry.resolve_auto(1, launched_elsewhere=True) == "ddp"
    assert registry.strategy_class("auto") is Local and registry.strategy_class("auto", 4) is DDP


def test_a_class_by_dotted_path_or_target_node(trainer_config):
    assert registry.strategy_class(MINE) is MyDDP
    assert registry.strategy_class({"_target_": MINE, "bucket": 3}) is MyDDP
    assert registry.strategy_class("ddpexp.strategies.dp.DataParallel") is DataParallel
    assert MyDDP.label() == MINE and MyDDP.spans_processes
    built = strategies.for_config(trainer_config(strategy={"_target_": MINE, "bucket": 3}),
                                  DistContext())
    assert type(built) is MyDDP and built.bucket == 3
    assert type(strategies.for_config(trainer_config(strategy=MINE), DistContext())) is MyDDP


def test_register_gives_a_class_a_name(monkeypatch, trainer_config):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    strategies.register("mine", MyDDP)
    strategies.register("mine_lazy", MINE)
    assert registry.names()[-2:] == ["mine", "mine_lazy"]
    assert registry.strategy_class("mine") is MyDDP is registry.strategy_class("mine_lazy")
    with pytest.raises(ValueError, match="no dot"):
        strategies.register("my.ddp", MyDDP)


@pytest.mark.parametrize("spec, message", [
    ("dpp", "trainer.strategy: Invalid value 'dpp', expected one of [auto, ddp, fsdp, dp, "
            "single], or a strategy class by its dotted path"),
    (f"{__name__}.trainer", f"trainer.strategy={__name__}.trainer is not a strategy: name a "
                            "subclass of ddpexp.strategies.Strategy"),
    ("nopkg_here.Mine", "trainer.strategy=nopkg_here.Mine: cannot import nopkg_here"),
    (f"{__name__}.Nothing", f"trainer.strategy={__name__}.Nothing: {__name__} has no Nothing"),
    ({"bucket": 3}, "trainer.strategy as a node needs _target_"),
    ({"_target_": MINE, "_partial_": True, "_args_": [1]},
     "trainer.strategy: _args_, _partial_ is not taken in a strategy node"),
    (3, "trainer.strategy=3: name one of [auto, ddp, fsdp, dp, single]"),
])
def test_refusals_name_what_is_allowed(spec, message):
    with pytest.raises(ConfigError) as err:
        registry.strategy_class(spec)
    assert message in str(err.value)


def test_plan_asks_the_class_not_the_name():
    assert plan_run(trainer(MINE, procs=2)).strategy == MINE
    assert plan_run(trainer(procs=2)).strategy == "ddp" and plan_run(trainer()).strategy == "single"
    node = {"_target_": MINE, "bucket": 1}
    assert plan_run(trainer(node, procs=2)) == plan_run(trainer(node, procs=2))
    with pytest.raises(ConfigError, match=f"trainer.strategy={__name__}.OneProcess runs one process"):
        plan_run(trainer(f"{__name__}.OneProcess", procs=2))
    assert plan_run(trainer("dp", gpus=0)).procs == 1
    with pytest.raises(ConfigError, match="trainer.strategy=dp is one process on one node"):
        plan_run(trainer("dp", procs=2))


def test_ranks_started_elsewhere_take_a_spanning_class(monkeypatch):
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}.items():
        monkeypatch.setenv(key, value)
    world = detect()
    assert world is not None
    assert world_plan(trainer(MINE), world).strategy == MINE
    assert world_plan(trainer(), world).strategy == "ddp"
    with pytest.raises(ConfigError, match=f"{__name__}.OneProcess cannot span the 2 ranks"):
        world_plan(trainer(f"{__name__}.OneProcess"), world)


def test_a_sweep_job_counts_the_workers_its_class_starts():
    from omegaconf import OmegaConf

    def workers(**t):
        return job_workers(OmegaConf.create({"trainer": t}))

    assert workers(strategy="dp", gpus=4) == 1 and workers(strategy=MINE, gpus=4) == 4
    assert workers(strategy={"_target_": MINE}, gpus=2) == 2 and workers(strategy="dpp", gpus=2) == 1


def test_loaders_shard_by_the_data_parallel_rank_and_size(trainer_config):
    from ddpexp.data import Synthetic

    source = Synthetic(num_samples=12, val_samples=8, test_samples=0, batch_size=2, shape=[2],
                       num_classes=2)
    ds = source.load()
    t = trainer_config(strategy="single")
    halves = [loaders.build(t, ctx, source, ds, 0, Pairs(t, ctx))
              for ctx in (DistContext(rank=r, world_size=4) for r in range(4))]
    assert [h.train_sampler.num_replicas for h in halves] == [2] * 4
    # The two ranks of a replica train and validate on the same samples, in the same order.
    assert list(halves[0].train_sampler) == list(halves[1].train_sampler)
    assert list(halves[2].train_sampler) != list(halves[0].train_sampler)
    vals = [torch.cat([y for _, y in h.val_loader]) for h in halves]
    assert torch.equal(vals[0], vals[1]) and torch.equal(vals[0], ds[1].y[0::2])
    assert halves[0].rank_seed == halves[1].rank_seed != halves[2].rank_seed


def test_a_strategy_must_say_how_it_wraps(trainer_config):
    class NoWrap(Strategy):
        pass

    with pytest.raises(TypeError, match="wrap"):
        NoWrap(trainer_config(), DistContext())  # pyright: ignore[reportAbstractUsage]
    assert Local(trainer_config(), DistContext()).wrap(m := nn.Linear(2, 2)) is m
