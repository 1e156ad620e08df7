"""What is checked of a tensor-parallel layout before any process group: the plan a model
declares, the strategies that take ``trainer.tp``, the degrees that divide the world, and
the GPT's attention split by heads (its fused-projection checkpoints still load)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from ddpexp.errors import ConfigError
from ddpexp.launch.fanout import plan_run
from ddpexp.models import GPT
from ddpexp.strategies import registry
from ddpexp.strategies.ddp import DDP
from ddpexp.strategies.fsdp import FSDP
from ddpexp.strategies.tp import TensorParallel, plan_of


class Planned(nn.Module):
    def __init__(self, plan):
        super().__init__()
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)
        self._plan = plan

    def ddpexp_tp_plan(self, tp):
        return self._plan(tp)


def test_the_gpt_plan_splits_each_block_by_heads_and_names_real_modules():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    gpt = GPT(vocab_size=11, block_size=8, n_layer=2, n_head=4, n_embd=16)
    plan = plan_of(gpt, 2)
    assert {k for k, v in plan.items() if isinstance(v, ColwiseParallel)} == \
        {"head", "blocks.*.q", "blocks.*.k", "blocks.*.v", "blocks.*.mlp.0"}
    assert {k for k, v in plan.items() if isinstance(v, RowwiseParallel)} == \
        {"tok", "blocks.*.proj", "blocks.*.mlp.2"}
    with pytest.raises(ConfigError, match=r"trainer.tp=3: the GPT's n_head=4 is not a multiple of 3"):
        plan_of(gpt, 3)


@pytest.mark.parametrize("plan,message", [
    (None, "Sequential has no tensor-parallel plan. Give it a method ddpexp_tp_plan"),
    (lambda tp: {}, "returned {}, not a non-empty dict"),
    (lambda tp: {"up": "colwise"}, r"\['up'\] is str, not a ParallelStyle"),
    (lambda tp: {"blocks.*.up": "x"}, "not a ParallelStyle"),
])
def test_a_plan_that_cannot_split_the_model_is_one_message(plan, message):
    model = Planned(plan) if plan is not None else nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ConfigError, match=message):
        plan_of(model, 2)


def test_a_plan_naming_no_module_is_refused():
    from torch.distributed.tensor.parallel import ColwiseParallel

    with pytest.raises(ConfigError, match=r"names 'blocks\.\*\.up', which matches no module"):
        plan_of(Planned(lambda tp: {"blocks.*.up": ColwiseParallel()}), 2)
    assert set(plan_of(Planned(lambda tp: {"u*": ColwiseParallel()}), 2)) == {"u*"}


def test_which_strategy_runs_a_tensor_parallel_run():
    assert registry.tensor_parallel_class(DDP) is TensorParallel
    assert registry.tensor_parallel_class(FSDP) is FSDP  # the 2-D mesh
    assert registry.tensor_parallel_class(registry.strategy_class("single")) is None
    assert registry.tensor_parallel_class(registry.strategy_class("dp")) is None

    class MyDDP(DDP):  # its own code would not run under TensorParallel
        pass

    class MyFSDP(FSDP):
        pass

    assert registry.tensor_parallel_class(MyDDP) is None
    assert registry.tensor_parallel_class(MyFSDP) is MyFSDP


@pytest.mark.parametrize("trainer,message", [
    ({"procs": 2, "tp": 3}, "trainer.tp=3 does not divide the world size 2 (trainer.procs=2 x "
     "trainer.nodes=1): the data-parallel degree is the world size / trainer.tp. Use a "
     "trainer.tp of 1, 2, or a world size that is a multiple of 3"),
    ({"procs": 1, "tp": 2}, "trainer.tp=2 does not divide the world size 1"),
    ({"procs": 2, "tp": 2, "strategy": "single"}, "trainer.strategy=single runs one process"),
    ({"procs": 4, "nodes": 2, "tp": 3}, "world size 8 (trainer.procs=4 x trainer.nodes=2)"),
])
def test_a_degree_that_does_not_fit_the_world_is_refused_by_the_plan(trainer, message):
    t = OmegaConf.create({"gpus": 0, "nodes": 1, "procs": None, "strategy": "auto", **trainer})
    with pytest.raises(ConfigError) as err:
        plan_run(t)
    assert message in str(err.value)


def test_tp_divides_the_world_into_replicas():
    t = OmegaConf.create({"gpus": 0, "nodes": 2, "procs": 2, "strategy": "fsdp", "tp": 2})
    assert plan_run(t).world_size == 4


def test_gpt_weights_of_a_fused_projection_load_as_q_k_v():
    torch.manual_seed(0)
    gpt = GPT(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8).eval()
    state = gpt.state_dict()
    fused = {k: v for k, v in state.items() if not k.startswith("blocks.0.") or
             k.split(".")[2] not in "qkv"}
    for kind in ("weight", "bias"):
        fused[f"blocks.0.qkv.{kind}"] = torch.cat([state[f"blocks.0.{n}.{kind}"] for n in "qkv"])
    other = GPT(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8).eval()
    other.load_state_dict(fused, strict=True)
    x = torch.randint(0, 11, (2, 8))
    assert torch.equal(other(x), gpt(x))
