"""The blocks of a model: the units ``strategy=fsdp`` shards one by one (then the root) and
the units ``trainer.activation_checkpointing`` recomputes in the backward pass.

Which modules are blocks, first match wins:

1. ``trainer.fsdp.wrap``: class names; every module of one of those classes is a block.
2. The model's own ``ddpexp_blocks()`` method, returning the block modules (the built-in
   ``gpt`` returns its transformer blocks).
3. The built-in rule: torchvision's ResNet (``model=resnet18``) has its four stages
   (``layer1``..``layer4``) as blocks; any other model has the members of its
   ``nn.ModuleList`` attributes (the usual layout of a transformer), or no blocks, in which
   case the whole model is one unit (``mlp``, ``convnet``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from torch import nn

from ddpexp.config.lists import as_list
from ddpexp.errors import ConfigError


def find_blocks(model: nn.Module, wrap: Sequence[str] | str | None = None) -> list[nn.Module]:
    """The blocks of ``model`` by the rules above, outermost first, none nested in another.
    ``wrap``: class names, or one class name."""
    wrap = [str(w) for w in as_list(wrap)]
    if wrap:
        names = set(wrap)
        blocks = [m for m in model.modules() if type(m).__name__ in names and m is not model]
        if not blocks:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(
                f"trainer.fsdp.wrap={list(wrap)} names no module of the model; its module "
                f"classes are {', '.join(present)}")
    elif callable(own := getattr(model, "ddpexp_blocks", None)):
        blocks = list(cast(Any, own)())  # a user's method: checked below
        if not all(isinstance(b, nn.Module) for b in blocks):
            raise ConfigError(f"{type(model).__name__}.ddpexp_blocks() must return nn.Module objects")
    else:
        blocks = _built_in_rule(model)
    return _outermost(blocks)


def _built_in_rule(model: nn.Module) -> list[nn.Module]:
    stages = [getattr(model, f"layer{i}", None) for i in range(1, 5)]
    resnet = [s for s in stages if isinstance(s, nn.Module)]
    if len(resnet) == len(stages) and hasattr(model, "fc"):
        return resnet  # torchvision's ResNet
    return [block for child in model.modules() if isinstance(child, nn.ModuleList)
            for block in child]


def _outermost(blocks: list[nn.Module]) -> list[nn.Module]:
    """``blocks`` without those inside another of them (each module once)."""
    inner = {id(m) for b in blocks for m in b.modules() if m is not b}
    seen: set[int] = set()
    out = []
    for b in blocks:
        if id(b) not in inner and id(b) not in seen:
            seen.add(id(b))
            out.append(b)
    return out


def checkpoint_activations(model: nn.Module, blocks: Sequence[nn.Module]) -> int:
    """Recompute each of ``blocks``' activations in the backward pass instead of keeping
    them (torch's non-reentrant activation checkpointing, random state preserved so that
    dropout draws the same mask again). The module tree and its state-dict names are
    unchanged. Returns the number of blocks; a model without blocks is one block."""
    from torch.distributed._composable import checkpoint

    units = list(blocks) or [model]
    for block in units:
        checkpoint(block)
    return len(units)
