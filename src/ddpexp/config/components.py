"""Config entries that name a class to build: the ``callbacks`` and ``logger`` groups.

Each entry is ``NAME: {_target_: module.Class, key: value, ...}``. :func:`check` finds the
class of every entry without building anything, so the launching process refuses a bad entry
with one message before any worker starts; :func:`build` builds them in the worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ddpexp.errors import ConfigError, DdpexpError


def locate(group: str, name: str, node: Any, base: type) -> type:
    """The class that entry ``group.name`` names, which must be a subclass of ``base``."""
    from hydra.utils import get_class

    example = f"+{group}.{name}._target_=mypackage.My{base.__name__}"
    if not isinstance(node, Mapping) or not node.get("_target_"):
        raise ConfigError(f"{group}.{name} has no _target_: name the class to build, e.g. "
                          f"{example}, or remove the entry with ~{group}.{name}")
    target = node["_target_"]
    try:
        cls = get_class(target)
    except Exception as exc:  # Hydra wraps import errors of every kind in its own
        first = " ".join(str(exc).split())[:200]
        raise ConfigError(f"{group}.{name}._target_={target} does not import ({first}); check the "
                          "dotted path and that its package is installed") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(f"{group}.{name}._target_={target} is not a subclass of "
                          f"{base.__module__.split('.')[0]}.{base.__name__}")
    return cls


def check(group: str, nodes: Mapping[str, Any] | None, base: type) -> None:
    """Refuse the first bad entry of ``nodes`` (``None`` entries are removed ones)."""
    if nodes is None:
        return
    if not isinstance(nodes, Mapping):
        raise ConfigError(f"{group} must be a dict of entries by name, got {type(nodes).__name__}")
    for name, node in nodes.items():
        if node is not None:
            locate(group, str(name), node, base)


def build(group: str, nodes: Mapping[str, Any] | None, base: type) -> dict[str, Any]:
    """Build every entry of ``nodes`` with Hydra's ``instantiate``: ``{name: object}``."""
    from hydra.utils import instantiate

    built: dict[str, Any] = {}
    for name, node in (nodes or {}).items():
        if node is None:
            continue
        locate(group, str(name), node, base)
        try:
            built[str(name)] = instantiate(dict(node), _convert_="all")
        except Exception as exc:
            cause = exc.__cause__ or exc
            if isinstance(cause, DdpexpError):
                raise ConfigError(f"{group}.{name}: {cause}") from cause
            first = " ".join(str(cause).split())[:300]
            raise ConfigError(f"{group}.{name} ({node['_target_']}) could not be built: "
                              f"{type(cause).__name__}: {first}") from cause
    return built
