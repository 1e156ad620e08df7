"""Models the ``model`` config group points at. Each takes the data's ``input_shape``
(C, H, W) and ``num_classes``, so the same model config fits any dataset.

A model whose class sets ``channels_last_safe = True`` is known to take channels_last tensors
(it reshapes only by pooling and flattening 1x1 maps), so ``trainer.channels_last=null``
applies that layout to it without a trial; any other model with convolutions gets it only
after a batch has gone through it in that layout (see the trainer's probe).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ddpexp.config.lists import as_list


def _shape(input_shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(int(s) for s in as_list(input_shape))
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"input_shape must be positive sizes, got {list(input_shape)}")
    return shape


class ConvNet(nn.Module):
    """Conv-BN-ReLU blocks, each halving the spatial size while it is above 1, then global
    average pooling and an MLP head: works for any channel count and any image size
    (1x1 included), unlike the fixed-size nets of the classic DDP tutorials."""

    channels_last_safe = True

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
        for h in as_list(hidden):  # model.hidden=64 is one layer of 64
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
        model.maxpool = nn.Identity()  # pyright: ignore[reportAttributeAccessIssue]  # forward() calls any module here
    elif channels != 3:
        model.conv1 = nn.Conv2d(channels, 64, 7, stride=2, padding=3, bias=False)
    # torchvision flattens the pooled 1x1 map.
    model.channels_last_safe = True  # pyright: ignore[reportArgumentType]  # a flag, not a tensor or module
    return model


def channels_last_safe(model: nn.Module) -> bool:
    """Whether ``model`` declares that channels_last tensors pass through it unchanged."""
    return getattr(model, "channels_last_safe", False) is True


class _Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x GELU MLP. The query, key
    and value projections are separate layers, so that tensor parallelism splits each by
    whole heads (:meth:`GPT.ddpexp_tp_plan`)."""

    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.head_dim, self.dropout = n_embd // n_head, dropout
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.q, self.k, self.v = (nn.Linear(n_embd, n_embd) for _ in range(3))
        self.proj = nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout)
        )
        self.resid_drop = nn.Dropout(dropout)
        self._register_load_state_dict_pre_hook(_split_fused_qkv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        # -1 heads: all of them, or this rank's share under tensor parallelism.
        q, k, v = (lin(h).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        att = nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.resid_drop(self.proj(att.transpose(1, 2).reshape(b, t, -1)))
        return x + self.mlp(self.ln2(x))


def _split_fused_qkv(state_dict: dict, prefix: str, *args: Any) -> None:
    """A block's weights saved with one fused ``qkv`` layer (before the projections were
    separate layers) as the ``q``, ``k`` and ``v`` layers' weights: the same numbers."""
    for kind in ("weight", "bias"):
        fused = state_dict.pop(f"{prefix}qkv.{kind}", None)
        if fused is not None:
            for name, part in zip("qkv", fused.chunk(3, dim=0), strict=True):
                state_dict[f"{prefix}{name}.{kind}"] = part


class GPT(nn.Module):
    """A small decoder-only transformer: token and learned position embeddings, ``n_layer``
    causal self-attention blocks, a final LayerNorm and an output layer that shares the token
    embedding's weights. ``forward(tokens)`` returns logits (batch, time, vocab_size)."""

    def __init__(
        self,
        vocab_size: int,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
    ):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be a multiple of n_head={n_head}")
        self.block_size, self.n_head = block_size, n_head
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # weight tying
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                # Residual projections scaled down with depth, as GPT-2 does.
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, 0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def ddpexp_blocks(self) -> list[nn.Module]:
        """The transformer blocks: the units FSDP shards and activation checkpointing
        recomputes (the embeddings, the final norm and the tied output layer stay in the
        root's unit, so the tied weight is one parameter)."""
        return list(self.blocks)

    def ddpexp_tp_plan(self, tp: int) -> dict[str, Any]:
        """How ``trainer.tp=tp`` splits the model (``torch.distributed.tensor.parallel``
        styles by module name): each block's query, key, value and first MLP layer by output
        features (column-wise: each rank computes ``n_head / tp`` whole heads), its output
        projection and second MLP layer by input features (row-wise: their outputs summed
        over the ranks); the token embedding by vocabulary rows, and the output layer that
        shares its weight by the same rows, its logits gathered whole. Norms and the position
        embedding are kept whole on every rank."""
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        n_head = self.n_head
        if n_head % tp:
            raise ValueError(f"the GPT's n_head={n_head} is not a multiple of {tp}: each "
                             "tensor-parallel rank computes whole attention heads")
        plan: dict[str, Any] = {
            "tok": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Replicate()),
        }
        for name in ("q", "k", "v", "mlp.0"):
            plan[f"blocks.*.{name}"] = ColwiseParallel()
        for name in ("proj", "mlp.2"):
            plan[f"blocks.*.{name}"] = RowwiseParallel()
        return plan

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence of {t} tokens is longer than block_size={self.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
