"""The models of the ``model`` group (models.py): output shapes for any input size."""

from __future__ import annotations

import pytest
import torch

from ddpexp import models


@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 1, 1), (2, 5, 7), (1, 28, 28)])
def test_convnet_any_input_size(shape):
    m = models.ConvNet(shape, num_classes=4, channels=(4, 8), hidden=6).eval()
    assert m(torch.randn(2, *shape)).shape == (2, 4)


def test_convnet_needs_three_dims():
    with pytest.raises(ValueError, match=r"ConvNet needs input_shape \[C, H, W\], got \[64\]"):
        models.ConvNet([64], num_classes=2)


@pytest.mark.parametrize("bad", [[], [3, 0, 4], [-1]])
def test_shapes_must_be_positive(bad):
    with pytest.raises(ValueError, match="input_shape must be positive sizes"):
        models.MLP(bad, num_classes=2)


@pytest.mark.parametrize("shape, hidden", [((4,), ()), ((1, 8, 8), (16, 8)), ((3, 2, 2), (5,))])
def test_mlp_shapes(shape, hidden):
    m = models.MLP(shape, num_classes=3, hidden=hidden)
    assert m(torch.randn(5, *shape)).shape == (5, 3)
    linears = [l for l in m.modules() if isinstance(l, torch.nn.Linear)]
    assert [l.out_features for l in linears] == [*hidden, 3]


def test_resnet18_small_images_keep_resolution():
    m = models.resnet18([1, 16, 16], num_classes=5).eval()
    assert m.conv1.in_channels == 1 and m.conv1.stride == (1, 1)
    assert isinstance(m.maxpool, torch.nn.Identity)
    assert m(torch.randn(2, 1, 16, 16)).shape == (2, 5)
    assert models.channels_last_safe(m)


def test_resnet18_large_images_other_channels():
    m = models.resnet18([2, 64, 64], num_classes=3)
    assert m.conv1.in_channels == 2 and m.conv1.stride == (2, 2)
    assert isinstance(m.maxpool, torch.nn.MaxPool2d)


def test_channels_last_safe_flags():
    assert models.channels_last_safe(models.ConvNet([1, 4, 4], 2))
    assert not models.channels_last_safe(models.MLP([4], 2))


def test_gpt_logits_and_weight_tying():
    m = models.GPT(vocab_size=13, block_size=6, n_layer=2, n_head=2, n_embd=8)
    out = m(torch.randint(0, 13, (3, 6)))
    assert out.shape == (3, 6, 13)
    assert m.head.weight is m.tok.weight
    assert m(torch.randint(0, 13, (1, 2))).shape == (1, 2, 13)


def test_gpt_is_causal():
    torch.manual_seed(0)
    m = models.GPT(vocab_size=7, block_size=5, n_layer=1, n_head=1, n_embd=4).eval()
    a = torch.tensor([[1, 2, 3, 4, 5]])
    b = torch.tensor([[1, 2, 3, 0, 0]])
    assert torch.allclose(m(a)[:, :3], m(b)[:, :3], atol=1e-6)


def test_gpt_refuses_long_sequences():
    m = models.GPT(vocab_size=5, block_size=4, n_layer=1, n_head=1, n_embd=4)
    with pytest.raises(ValueError, match="sequence of 5 tokens is longer than block_size=4"):
        m(torch.zeros(1, 5, dtype=torch.long))


def test_gpt_heads_must_divide_width():
    with pytest.raises(ValueError, match="n_embd=10 must be a multiple of n_head=4"):
        models.GPT(vocab_size=5, n_head=4, n_embd=10)
