"""Which modules are blocks, and their activations recomputed (strategies/blocks.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpexp.errors import ConfigError
from ddpexp.strategies.blocks import checkpoint_activations, find_blocks


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(torch.relu(self.lin(x)))


class Stack(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(Block() for _ in range(n))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class Own(Stack):
    def ddpexp_blocks(self):
        return [self.inp, self.head]


class BadOwn(Stack):
    def ddpexp_blocks(self):
        return ["inp"]


def test_module_list_members_are_blocks():
    m = Stack()
    assert find_blocks(m) == list(m.blocks)


def test_no_blocks_in_plain_model():
    assert find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []


def test_wrap_by_class_name():
    m = Stack(2)
    assert find_blocks(m, ["Linear"]) == [m.inp, m.blocks[0].lin, m.blocks[1].lin, m.head]


def test_wrap_takes_one_class_name_as_a_list_of_it():
    """trainer.fsdp.wrap=Linear: the class Linear, not the letters L, i, n, e, a, r."""
    from ddpexp.config.compose import composed

    m = Stack(2)
    assert find_blocks(m, "Linear") == find_blocks(m, ["Linear"])
    cfg = composed(["trainer.strategy=fsdp", "trainer.fsdp.wrap=Linear"])
    assert find_blocks(m, cfg.trainer.fsdp.wrap) == [m.inp, m.blocks[0].lin, m.blocks[1].lin, m.head]


def test_wrap_keeps_outermost():
    m = Stack(2)
    assert find_blocks(m, ["Block", "Linear"]) == [m.inp, m.blocks[0], m.blocks[1], m.head]


def test_wrap_naming_nothing():
    with pytest.raises(ConfigError, match=r"trainer.fsdp.wrap=\['Conv2d'\] names no module of the "
                                          r"model; its module classes are Block, Dropout, Linear, "
                                          r"ModuleList, Stack"):
        find_blocks(Stack(1), ["Conv2d"])


def test_own_blocks_method():
    m = Own()
    assert find_blocks(m) == [m.inp, m.head]


def test_own_blocks_must_be_modules():
    with pytest.raises(ConfigError, match=r"BadOwn.ddpexp_blocks\(\) must return nn.Module objects"):
        find_blocks(BadOwn())


def test_resnet_stages():
    from torchvision.models import resnet18

    m = resnet18(num_classes=3)
    assert find_blocks(m) == [m.layer1, m.layer2, m.layer3, m.layer4]


def test_gpt_blocks():
    from ddpexp.models import GPT

    m = GPT(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8)
    blocks = find_blocks(m)
    assert len(blocks) == 2 and all(isinstance(b, nn.Module) for b in blocks)


def test_checkpointing_keeps_names_and_gradients():
    torch.manual_seed(0)
    plain = Stack()
    ckpt = Stack()
    ckpt.load_state_dict(plain.state_dict())
    n = checkpoint_activations(ckpt, find_blocks(ckpt))
    assert n == 3
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    x = torch.randn(5, 4)
    for m in (plain, ckpt):
        m.train()
    torch.manual_seed(1)
    plain(x).sum().backward()
    torch.manual_seed(1)
    ckpt(x).sum().backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters(), strict=False):
        assert torch.allclose(a.grad, b.grad), name


def test_checkpointing_model_without_blocks_is_one_unit():
    m = nn.Sequential(nn.Linear(2, 2))
    assert checkpoint_activations(m, []) == 1
    m(torch.randn(1, 2)).sum().backward()
    assert m[0].weight.grad is not None
