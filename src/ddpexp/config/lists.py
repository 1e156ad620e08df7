"""Keys that take a list (``task.metrics``, ``model.hidden``, ``data.shape``) also take one
value, as a list of that value: ``task.metrics=f1`` is ``task.metrics=[f1]``, never the
letters of ``f1``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def as_list(value: Any) -> list:
    """``value`` as a list: a sequence (a list, a tuple, OmegaConf's ListConfig) as it is, a
    single value (a string, a number) as a list of it, None as an empty list."""
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        return [value]
    return list(value)
