"""Models the ``model`` config group points at. Each takes the data's ``input_shape``
(C, H, W) and ``num_classes``, so the same model config fits any dataset."""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn


def _shape(input_shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(int(s) for s in input_shape)
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"input_shape must be positive sizes, got {list(input_shape)}")
    return shape


class ConvNet(nn.Module):
    """Conv-BN-ReLU blocks, each halving the spatial size while it is above 1, then global
    average pooling and an MLP head: works for any channel count and any image size
    (1x1 included), unlike the fixed-size nets of the classic DDP tutorials."""

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        channels: Sequence[int] = (32, 64),
        hidden: int = 128,
        dropout: float = 0.0,
    ):
        super().__init__()
        shape = _shape(input_shape)
        if len(shape) != 3:
            raise ValueError(f"ConvNet needs input_shape [C, H, W], got {list(shape)}")
        layers: list[nn.Module] = []
        c_in, size = shape[0], min(shape[1:])
        for c_out in channels:
            layers += [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out)]
            layers.append(nn.ReLU(inplace=True))
            if size > 1:
                layers.append(nn.MaxPool2d(2, ceil_mode=True))
                size = math.ceil(size / 2)
            c_in = c_out
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(c_in, hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.features(x)))


class MLP(nn.Module):
    """Flatten, then Linear-ReLU layers of the given widths, then the classifier."""

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        hidden: Sequence[int] = (256, 256),
        dropout: float = 0.0,
    ):
        super().__init__()
        width = math.prod(_shape(input_shape))
        layers: list[nn.Module] = [nn.Flatten()]
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU(inplace=True), nn.Dropout(dropout)]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def resnet18(input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """torchvision's ResNet-18 (random init, nothing downloaded) sized by the data: the stem
    takes the data's channels, and images under 64 px get a 3x3 stride-1 stem without
    max-pooling so that they are not reduced to 1x1 before the last stage."""
    from torchvision.models import resnet18 as tv_resnet18

    channels, *spatial = _shape(input_shape)
    model = tv_resnet18(weights=None, num_classes=num_classes)
    if spatial and min(spatial) < 64:
        model.conv1 = nn.Conv2d(channels, 64, 3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif channels != 3:
        model.conv1 = nn.Conv2d(channels, 64, 7, stride=2, padding=3, bias=False)
    return model
