"""Config nodes that name what to build by ``_target_``: the ``task``, ``model``, ``data``,
``optimizer`` and ``scheduler`` nodes, and the entries of the ``callbacks`` and ``logger``
groups.

Each entry is ``NAME: {_target_: module.Class, key: value, ...}``. :func:`check` finds the
class of every entry without building anything, so the launching process refuses a bad entry
with one message before any worker starts; :func:`build` builds them in the worker.
:func:`check_nodes` does the same for the nodes a worker builds itself: a ``_target_`` that
does not import, or a key its class or function takes no argument for, is one message naming
the key, where it would otherwise be a ``TypeError`` inside Hydra's ``instantiate`` in a worker.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from ddpexp.errors import ConfigError, DdpexpError

# The nodes each worker builds by their _target_ (training.build.build_parts).
BUILT_NODES = ("task", "model", "data", "optimizer", "scheduler")


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


def import_target(key: str, target: Any) -> Any:
    """What the dotted path ``target`` (the value of ``key``, e.g. ``model._target_``) names;
    a ConfigError saying why it cannot be imported otherwise."""
    path = str(target)
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and (module_name + ".").startswith(exc.name + "."):
                continue  # this prefix is no module: a shorter one may be, the rest attributes
            why = f"importing {module_name} failed: {exc}"  # a module it imports is missing
            break
        except Exception as exc:  # the module itself raised (a syntax error, say)
            why = f"importing {module_name} failed: {type(exc).__name__}: {exc}"
            break
        for j, attr in enumerate(parts[i:]):
            if not hasattr(obj, attr):
                owner = ".".join(parts[:i + j])
                close = difflib.get_close_matches(attr, [n for n in dir(obj)
                                                         if not n.startswith("_")], n=1)
                hint = f"; did you mean {owner}.{close[0]}?" if close else ""
                why = f"{owner} has no {attr}{hint}"
                break
            obj = getattr(obj, attr)
        else:
            return obj
        break
    else:
        why = f"no module named {parts[0]!r}"
    raise ConfigError(f"{key}: cannot import {path} ({' '.join(why.split())[:300]}); check the "
                      "dotted path and that its package is installed")


def arguments(obj: Any) -> tuple[list[str], list[str], bool]:
    """The keyword arguments calling ``obj`` (a class or a function) takes: all of them, the
    required ones, and whether it takes any others too. A class's ``**kwargs`` that its
    ``__init__`` hands to ``super().__init__`` adds its base's arguments; one that ends at
    ``object`` or ``torch.nn.Module`` (which take none: it went elsewhere), or that is not
    handed to ``super()``, takes anything, as does what ``inspect`` cannot read."""
    if not isinstance(obj, type):
        return _own_arguments(obj, skip_self=False)
    if any("__new__" in k.__dict__ for k in obj.__mro__[:-1]):
        return [], [], True  # built by __new__: its arguments are not __init__'s
    names: list[str] = []
    required: list[str] = []
    inits = [k.__dict__["__init__"] for k in obj.__mro__ if "__init__" in k.__dict__]
    for depth, init in enumerate(inits):
        if _takes_nothing(obj.__mro__, init):
            return names, required, depth > 0
        own, needed, open_ended = _own_arguments(init, skip_self=True)
        names += [n for n in own if n not in names]
        required += needed if depth == 0 else []
        if not open_ended:
            return names, required, False
        if not _forwards(init):
            return names, required, True
    return names, required, True


def _own_arguments(func: Any, skip_self: bool) -> tuple[list[str], list[str], bool]:
    """``func``'s keyword arguments, the required ones and whether it has ``**kwargs``."""
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return [], [], True
    params = params[1:] if skip_self else params
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return ([p.name for p in named], [p.name for p in named if p.default is p.empty],
            any(p.kind == p.VAR_KEYWORD for p in params))


def _takes_nothing(mro: tuple[type, ...], init: Any) -> bool:
    """Whether ``init`` is ``object``'s or ``torch.nn.Module``'s, which take no keywords."""
    for klass in mro:
        if klass.__dict__.get("__init__") is init:
            return klass is object or (klass.__module__, klass.__qualname__) == (
                "torch.nn.modules.module", "Module")
    return False


def _forwards(init: Any) -> bool:
    """Whether ``init`` calls ``super()`` (and so, by the usual pattern, hands it its
    ``**kwargs``)."""
    code = getattr(init, "__code__", None)
    return code is not None and "super" in code.co_names


def check_nodes(config: Mapping[str, Any]) -> None:
    """Refuse, with one message naming the key, a node of :data:`BUILT_NODES` whose
    ``_target_`` does not import, that sets a key its target takes no argument for (with the
    closest it takes) or that no target reads (``+scheduler.gamma`` with ``scheduler=none``),
    or that leaves out an argument its target needs (not for a ``_partial_`` one, whose
    caller passes the rest)."""
    for group in BUILT_NODES:
        node = config.get(group)
        if not isinstance(node, Mapping):
            continue
        if not node.get("_target_"):  # scheduler=none: nothing built (validate() refuses
            # the others' missing _target_)
            unread = [str(k) for k in node.keys() if not str(k).startswith("_")]
            if unread:
                raise ConfigError(f"{group}.{unread[0]}: the {group} config builds nothing (no "
                                  f"_target_, as {group}=none), so {unread[0]} would never be "
                                  f"read; choose a {group} first ({group}=NAME)")
            continue
        target = import_target(f"{group}._target_", node["_target_"])
        names, required, open_ended = arguments(target)
        what, partial = node["_target_"], bool(node.get("_partial_"))
        if partial:  # the caller passes these (the model's parameters, the optimizer)
            names = [n for n in names if n not in required]
        keys = [str(k) for k in node.keys()]  # with those of a ??? value (a DictConfig's)
        for key in (k for k in keys if not k.startswith("_")):
            if partial and key in required:
                raise ConfigError(f"{group}.{key}: ddpexp passes {key} to {what} itself; "
                                  f"remove it (~{group}.{key})")
            if key not in names and not open_ended:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"did you mean {group}.{close[0]}?" if close else f"remove it (~{group}.{key})"
                raise ConfigError(f"{group}.{key}: {what} takes no argument {key}; {hint} "
                                  f"({what} takes: {', '.join(names) or 'none'})")
        if partial or "_args_" in node:
            continue
        missing = [name for name in required if name not in keys]
        if missing:
            raise ConfigError(f"{group}: {what} needs {', '.join(missing)}; add "
                              + " ".join(f"+{group}.{m}=..." for m in missing))
