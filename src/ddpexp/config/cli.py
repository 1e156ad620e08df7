"""The command line before Hydra reads it: typos of group names and of keys (top-level,
``trainer.*``, entries under ``callbacks.*`` and ``logger.*``, the keys of the nodes built by
``_target_``), a group option it does not have, a run dir that another live run holds or that
already holds a run, and ``resume=`` paths. The commands printed back (the one that continues a
run or a sweep) are :mod:`ddpexp.config.commands`'."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep
from hydra.errors import HydraException

from ddpexp.config import runlock
from ddpexp.config.commands import SWEPT, VALUE_FLAGS, command_line_override, command_line_values
from ddpexp.config.rundir import (
    holds_run,
    interrupted_before_training,
    remove_run_outputs,
    rendezvous_of,
    writable_dir_problem,
)
from ddpexp.config.schema import DdpexpConfig, TrainerConfig


def unknown_trainer_keys(args: list[str]) -> str | None:
    """A message for ``trainer.KEY=...`` overrides whose KEY is no trainer key, naming the
    closest one. Hydra rejects them too, but suggests ``+trainer.KEY`` (adding a key the
    trainer never reads), which is the wrong fix for a typo."""
    known = [f.name for f in fields(TrainerConfig)]
    problems = []
    for arg in args:
        key = arg.split("=", 1)[0].lstrip("+")  # +trainer.x would be kept, and never read
        if "=" not in arg or not key.startswith("trainer.") or key.count(".") != 1:
            continue
        name = key.split(".", 1)[1]
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean trainer.{close[0]}?" if close else "it is not a trainer key"
            problems.append(f"trainer.{name}: {hint}")
    if not problems:
        return None
    return ("unknown trainer key " + "; ".join(problems)
            + f"\n(trainer keys: {', '.join(known)})")


def mistyped_values(args: Sequence[str]) -> str | None:
    """One line for an override of a typed key (``trainer.*``, ``seed``, ``overwrite``) whose
    value the key does not take (``trainer.max_epochs=abc``), naming the key, the value and
    what it takes, instead of the dump Hydra prints for it. Swept values are left to Hydra."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from ddpexp.config.schema import DdpexpConfig

    typed = None
    for key, value in command_line_values(args).items():
        kind = _typed_kind(key)
        if kind is None or value is SWEPT or (isinstance(value, str) and "${" in value):
            continue
        typed = typed if typed is not None else OmegaConf.structured(DdpexpConfig)
        try:
            OmegaConf.update(typed, key, value, merge=False)
        except (OmegaConfBaseException, ValueError):
            given = next((a.split("=", 1)[1] for a in args
                          if "=" in a and a.split("=", 1)[0].lstrip("+") == key), str(value))
            return f"{key}={given}: {key} takes {kind}, not {given!r}"
    return None


def _typed_kind(key: str) -> str | None:
    """What the schema's key ``key`` takes, in words ("an integer or null"); None for a key
    the schema does not type (a group's node, an unknown key: other checks name those)."""
    import typing
    from enum import Enum

    from ddpexp.config.schema import DdpexpConfig

    cls: Any = DdpexpConfig
    hint: Any = None
    for part in key.split("."):
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
        if part not in hints:
            return None
        hint = cls = hints[part]
    if dataclasses.is_dataclass(hint) or hint is Any:
        return None
    args = typing.get_args(hint)
    nullable = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if isinstance(base, type) and issubclass(base, Enum):
        kind = "one of " + ", ".join(m.value for m in base)
    elif base in words:
        kind = words[base]
    else:
        return None
    return f"{kind} or null" if nullable else kind


def unknown_group_options(args: list[str]) -> str | None:
    """A message for an option of one of ddpexp's config groups that the group does not have
    (``model=mlpp``, ``logger=[tensorboard,mlfow]``, ``-m model=mlp,convnt``), with the closest
    and the options there are. Hydra lists the options for a single wrong one, among ten lines
    of its search path, and for a list says only "Could not load 'logger/mlfow'". Not checked
    where the command line adds a config dir of its own (which may hold more options)."""
    if any(a.startswith(("hydra.searchpath", "--config-dir", "-cd", "--config-path", "-cp"))
           for a in args):
        return None
    parser = OverridesParser.create()
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            override = parser.parse_override(arg)
        except HydraException:
            continue
        group, value = override.key_or_group, override.value()
        options = _group_options(group)
        if isinstance(value, ChoiceSweep):
            value = value.list
        if not options or value is None or override.is_delete():
            continue
        for name in value if isinstance(value, list) else [value]:
            if str(name) not in options:
                close = difflib.get_close_matches(str(name), options, n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                return (f"{arg}: {group} has no option {name!r}{hint} "
                        f"({group} options: {', '.join(options)})")
    return None


def _group_options(group: str) -> list[str]:
    """The options of ddpexp's own config group ``group`` (its YAML files), or of one of
    Hydra's (``hydra/launcher``: Hydra's own, its plugins' and ddpexp's), or [] for a name
    that is no such group."""
    if re.fullmatch(r"hydra/[a-z_]+", group):
        return _hydra_group_options(group)
    if not re.fullmatch(r"[a-z_]+", group):
        return []
    folder = Path(__file__).resolve().parents[1] / "conf" / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


@functools.cache
def _hydra_group_options(group: str) -> list[str]:
    """The options Hydra's search path of ddpexp's config has for ``group``. Its plugins are
    discovered here (Hydra keeps them for the run that follows)."""
    from hydra._internal.config_repository import ConfigRepository
    from hydra._internal.utils import create_config_search_path
    from hydra.core.plugins import Plugins

    from ddpexp.config.schema import register_configs

    Plugins.instance()
    register_configs()
    try:
        options = ConfigRepository(create_config_search_path("pkg://ddpexp.conf"))
        return sorted(options.get_group_options(group))
    except Exception:  # Hydra's internals moved: leave the option to Hydra's own message
        return []


# The groups composed as dicts of entries by name.
ENTRY_GROUPS = ("callbacks", "logger")
# The groups whose node is built by its _target_ (their keys are its arguments).
BUILT_GROUPS = ("task", "model", "data", "optimizer", "scheduler")
# Flags that choose another primary config than ddpexp's: the entries are then unknown here.
_OTHER_PRIMARY = ("--config-path", "-cp", "--config-name", "-cn")


def _config_dir_and_overrides(args: Sequence[str]) -> tuple[str | None, list[tuple[Any, str]]] | None:
    """The ``--config-dir`` of the command line and its overrides, parsed, each with its
    text (flags and the ``hydra.*`` keys left out); None where another primary config is
    chosen (its keys are unknown here) or an override does not parse (Hydra's own message
    says what is wrong with it)."""
    parser = OverridesParser.create()
    overrides, config_dir = [], None
    flags = iter(args)
    for arg in flags:
        if arg in _OTHER_PRIMARY or arg.split("=", 1)[0] in _OTHER_PRIMARY:
            return None
        if arg.startswith("hydra.searchpath"):
            return None  # config dirs of its own, whose groups and keys are unknown here
        if arg in ("--config-dir", "-cd"):
            config_dir = next(flags, None)
            continue
        if arg.startswith("--config-dir="):
            config_dir = arg.split("=", 1)[1]
            continue
        if arg in VALUE_FLAGS:
            next(flags, None)  # its value (--cfg job) is no override
            continue
        if arg.startswith("-"):
            continue
        try:
            override = parser.parse_override(arg)
        except HydraException:
            return None
        if not override.key_or_group.startswith("hydra"):
            overrides.append((override, arg))
    return config_dir, overrides


def _top_level_names(config_dir: str | None) -> tuple[list[str], list[str]]:
    """The names an override may start with: the config groups (ddpexp's and those of
    ``config_dir``) and the other keys of the root config."""
    folders = [Path(__file__).resolve().parents[1] / "conf"]
    if config_dir:
        folders.append(Path(config_dir).expanduser())
    groups: list[str] = []
    for folder in folders:
        if folder.is_dir():
            groups += [d.name for d in folder.iterdir() if d.is_dir() and d.name not in groups
                       and not d.name.startswith(("_", ".")) and _holds_configs(d)]
    return sorted(groups), [f.name for f in fields(DdpexpConfig) if f.name not in groups]


def _holds_configs(folder: Path) -> bool:
    """Whether ``folder`` is a config group: YAML files in it, or in its own groups."""
    return any(folder.glob("*.yaml")) or any(folder.glob("*/*.yaml"))


def unknown_top_level(args: Sequence[str]) -> str | None:
    """A message for an override whose first name is neither a key of the root config nor a
    config group (``modle=mlp``, ``mdoel.hidden=[64]``, ``seeed=3``), naming the closest with
    the override corrected. Hydra rejects them too, but suggests ``+modle=mlp`` (a key nobody
    reads), the wrong fix for a typo. Additions (``+name=...``) are the user's own."""
    parsed = _config_dir_and_overrides(args)
    if parsed is None:
        return None
    config_dir, overrides = parsed
    groups, keys = _top_level_names(config_dir)
    added: set[str] = set()  # names an earlier +name=... added (a resume's recorded ones)
    for override, arg in overrides:
        key = override.key_or_group
        first, dot, rest = key.partition(".")
        if override.is_add() or override.is_force_add():
            added.add(first)
            continue
        if first.split("/", 1)[0] in groups or first in keys or first in added:
            continue
        close = difflib.get_close_matches(first, [*groups, *keys], n=1)
        tilde = "~" if override.is_delete() else ""
        value = f"={arg.split('=', 1)[1]}" if "=" in arg else ""
        hint = (f"did you mean {tilde}{close[0]}{dot}{rest}{value}?" if close else
                f"it is neither a config group nor a key of the config (to add a key of your "
                f"own: +{key}{value})")
        return (f"unknown {'key' if dot else 'group or key'} {key}: {hint}\n"
                f"(groups: {', '.join(groups)}; keys: {', '.join(keys)})")
    return None


def unknown_group_keys(args: Sequence[str]) -> str | None:
    """A message for an override of a key under ``callbacks.NAME`` or ``logger.NAME`` (a
    value or a ``~`` deletion) whose NAME, or key under it, the composed config does not
    have, or of a key of the ``task``, ``model``, ``data``, ``optimizer`` or ``scheduler``
    node that it does not have (``model.hiden=[64]``): each named with the closest name
    there is (for a built node, also among the arguments its ``_target_`` takes). Hydra
    rejects them too, but suggests ``+model.hiden=...`` (an argument the model does not
    take, a TypeError in a worker later), the wrong fix for a typo. The config is composed
    (without those overrides) only when there are some."""
    parsed = _config_dir_and_overrides(args)
    if parsed is None:
        return None
    config_dir, overrides = parsed
    targets, rest = [], []
    chosen = {o.key_or_group: o.value() for o, _ in overrides if "." not in o.key_or_group}
    for override, arg in overrides:
        key = override.key_or_group
        addition = override.is_add() or override.is_force_add()
        target = key.endswith("._target_") and key.count(".") == 1  # it is what the rest is of
        if key.split(".", 1)[0] in (*ENTRY_GROUPS, *BUILT_GROUPS) and "." in key and not (
                addition or target or _in_an_option(key, chosen, config_dir)):
            targets.append((key, arg.split("=", 1)[1] if "=" in arg else None))
        elif not override.is_sweep_override():
            rest.append(arg)
    if not targets:
        return None
    from ddpexp.config.compose import composed

    try:
        cfg = composed(rest, config_dir)
    except Exception:
        return None
    problems = [p for p in (_missing_key(cfg, key, value) for key, value in targets) if p]
    return "\n".join(problems) or None


def _in_an_option(key: str, chosen: dict[str, Any], config_dir: str | None) -> bool:
    """Whether ``key`` (``model.hidden``) of a group built by ``_target_`` is a key of the
    group's option that the command line ``chosen`` (``{"model": "mlp"}``), or else the
    default one, sets in its YAML file (ddpexp's or ``config_dir``'s): then the key is there,
    and the command line's common overrides (``optimizer.lr=...``) need no composition to be
    checked. An ``experiment=`` or ``debug=`` may choose other options: then it is composed."""
    group, _, rest = key.partition(".")
    if group not in BUILT_GROUPS or chosen.get("experiment") or chosen.get("debug"):
        return False
    option = chosen.get(group, _default_options().get(group))
    if not isinstance(option, str):
        return False
    folders = [Path(__file__).resolve().parents[1] / "conf" / group]
    if config_dir:
        folders.append(Path(config_dir).expanduser() / group)
    return any(rest.split(".", 1)[0] in _option_keys(str(f / f"{option}.yaml")) for f in folders)


@functools.cache
def _default_options() -> dict[str, Any]:
    """The option of each group that ddpexp's root config chooses (``{"model": "convnet"}``)."""
    import yaml

    root = yaml.safe_load((Path(__file__).resolve().parents[1] / "conf" / "config.yaml").read_text())
    return {k: v for entry in root.get("defaults", []) if isinstance(entry, dict)
            for k, v in entry.items()}


@functools.cache
def _option_keys(path: str) -> frozenset[str]:
    """The top-level keys of the YAML file ``path`` (a config group's option); none where
    there is no such file."""
    import yaml

    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return frozenset()
    return frozenset(str(k) for k in loaded) if isinstance(loaded, dict) else frozenset()


def _missing_key(cfg: Any, key: str, value: str | None = None) -> str | None:
    """Why the dotted ``key`` (set to the text ``value``, None for a deletion) is not in
    ``cfg``: the first part that is missing, the names there are where it is and the closest
    of them; None if it is there."""
    from omegaconf import DictConfig, OmegaConf

    node, path = cfg, []
    for part in key.split("."):
        if not isinstance(node, DictConfig):
            if path and path[0] in BUILT_GROUPS and len(path) == 1 and node is None:
                return _missing_argument(path[0], None, part, value)
            return None  # a value's own keys: Hydra's message
        if part in node.keys() and OmegaConf.is_missing(node, part):
            return None  # there, waiting for a value (data.root: ???)
        if part not in node:
            if not path:
                return None  # the whole group was removed (~callbacks): Hydra's message
            if path[0] in BUILT_GROUPS and len(path) == 1:
                return _missing_argument(path[0], node, part, value)
            where, entry = ".".join(path), len(path) == 1
            names = [str(k) for k in node.keys()]
            close = difflib.get_close_matches(part, names, n=1)
            new = f"+{where}.{part}._target_=..." if entry else f"+{where}.{part}=..."
            hint = (f"did you mean {where}.{close[0]}?" if close else
                    f"{where} has no {part} (a new {'entry' if entry else 'argument'}: {new})")
            kind = "entry" if entry else "key"
            return (f"unknown {kind} {where}.{part}: {hint}\n"
                    f"({where}: {', '.join(names) or 'none'})")
        node, path = node[part], [*path, part]
    return None


def _missing_argument(group: str, node: Any, part: str, value: str | None) -> str:
    """The message for ``group.part``, a key the composed ``group`` node does not have: the
    closest key it has, or an argument of its ``_target_`` it does not set (to add with
    ``+group.part=...``), or that the target takes no such argument."""
    from ddpexp.config.components import arguments, import_target
    from ddpexp.errors import ConfigError

    names = [str(k) for k in node.keys() if not str(k).startswith("_")] if node else []
    key, set_to = f"{group}.{part}", f"={value}" if value is not None else "=..."
    target = node.get("_target_") if node else None
    if not target:
        options = ", ".join(o for o in _group_options(group) if o != "none")
        return (f"unknown key {key}: the {group} config sets no _target_ and no keys "
                f"({group}=none?); choose one first ({group} options: {options})")
    close = difflib.get_close_matches(part, names, n=1)
    if close:
        return f"unknown key {key}: did you mean {group}.{close[0]}?\n({group}: {', '.join(names)})"
    try:
        takes, required, open_ended = arguments(import_target(f"{group}._target_", target))
    except ConfigError as exc:
        return str(exc)
    if node.get("_partial_"):  # its caller passes these (the model's parameters, ...)
        takes = [t for t in takes if t not in required]
    if part in takes or open_ended:
        return (f"{key} is not set by the {group} config, but {target} takes it: add it with "
                f"+{key}{set_to}")
    close = difflib.get_close_matches(part, takes, n=1)
    if close:
        return (f"unknown key {key}: did you mean {group}.{close[0]}? ({target} takes it; the "
                f"config does not set it: +{group}.{close[0]}{set_to})")
    return (f"unknown key {key}: {target} takes no argument {part}\n"
            f"({target} takes: {', '.join(takes) or 'none'})")


def preflight(args: list[str]) -> str | None:
    """Checks of the command line that must happen before Hydra claims a run dir: typos of
    group names and keys (top-level, trainer, callbacks, logger, and the keys of the nodes
    built by ``_target_``), an option a group does not have, a run dir that a live run holds
    or that already holds a run, and a ``resume=`` path that does not exist (which would
    otherwise leave an empty new run dir behind its error). Launcher settings are checked by
    the launcher (:mod:`ddpexp.sweep.settings`), before a sweep writes anything."""
    typo = (unknown_trainer_keys(args) or unknown_top_level(args) or unknown_group_options(args)
            or unknown_group_keys(args) or mistyped_values(args))
    if typo:
        return typo
    values = command_line_values(args)
    if values.get("resume") not in (None, "") and values.get("overwrite") is True:
        return (f"overwrite=true starts a new run in place of the one in the run dir, and "
                f"resume={values['resume']} continues a run: give one of them")
    taken = busy_run_dir(args) or run_dir_conflict(args)
    if taken:
        return taken
    resume = values.get("resume")
    if isinstance(resume, str) and resume not in ("", "auto") and not Path(resume).expanduser().exists():
        return f"resume={resume} is neither auto, a run dir nor a checkpoint file that exists"
    return None


def _shares_run_dir(values: dict[str, Any]) -> bool:
    """Processes that share one run dir by design: a submitit job requeued into its own dir,
    the nodes of a multi-node run on a shared filesystem. (Of a SLURM step's tasks only rank
    0 runs this check; the others take the run dir it chose.)"""
    env = os.environ
    if any(k.startswith("SUBMITIT_") for k in env):
        return True
    nodes = values.get("trainer.nodes", 1)
    return isinstance(nodes, int) and nodes > 1


def busy_run_dir(args: list[str]) -> str | None:
    """The refusal when a live run holds the run dir the command line names (``resume=``'s,
    ``hydra.run.dir``, or any job dir under a sweep's ``hydra.sweep.dir``): said here, before
    Hydra writes anything, the same way the run's own claim of the lock would say it
    (:mod:`ddpexp.config.runlock`)."""
    values = command_line_values(args)
    multirun = any(a in ("-m", "--multirun") for a in args)
    shared_by = rendezvous_of(values.get("trainer.nodes", 1), values.get("trainer.rdzv_endpoint"))
    for run_dir in _named_run_dirs(values, multirun):
        refused = runlock.busy(run_dir, shared_by)
        if refused:
            return refused
    return None


def _named_run_dirs(values: dict[str, Any], multirun: bool) -> list[Path]:
    """The existing run dirs the command line's values point at."""
    def path(key: str) -> Path | None:
        value = values.get(key)
        if value is None or value is SWEPT or "${" in str(value) or str(value) in ("", "auto"):
            return None
        return Path(str(value)).expanduser()

    if multirun:
        sweep = path("hydra.sweep.dir")
        return sorted(d for d in sweep.iterdir() if d.is_dir()) if sweep and sweep.is_dir() else []
    resume, run = path("resume"), path("hydra.run.dir")
    if resume is not None and resume.is_file() and resume.parent.name == "checkpoints":
        return [resume.parent.parent]
    return [d for d in (resume, run) if d is not None and d.is_dir()]


def run_dir_conflict(args: list[str]) -> str | None:
    """A message when ``hydra.run.dir`` (or a sweep's ``hydra.sweep.dir``) cannot be used as
    the command line asks: no run dir can be created there, or it already holds a run and
    neither ``resume=`` nor ``overwrite=true`` says what to do with it. With ``overwrite=true``
    the old run's outputs are removed (:func:`~ddpexp.config.rundir.remove_run_outputs`) and
    there is no conflict. Checked before Hydra writes anything into the dir, on the path Hydra
    will use (however it was quoted)."""
    values = command_line_values(args)
    multirun = any(a in ("-m", "--multirun") for a in args)
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    target = values.get(key)
    target = None if target is None or target is SWEPT or "${" in str(target) else str(target)
    # The default run and sweep dirs are under ./outputs.
    problem = writable_dir_problem(Path(target or "outputs"))
    if problem:
        return problem
    if target is None:
        return None
    path = Path(target).expanduser()
    runs = [path] if not multirun else [d for d in path.iterdir() if d.is_dir()] if path.is_dir() else []
    runs = [d for d in runs if holds_run(d) and not interrupted_before_training(d)]
    if not runs or values.get("resume") not in (None, "") or _shares_run_dir(values):
        return None
    if str(values.get("overwrite", False)).lower() in ("true", "1", "yes", "on"):
        for run in runs:
            remove_run_outputs(run)
        return None
    what = f"{command_line_override(key, target)} already holds " + (
        "a run" if not multirun else f"{len(runs)} run(s) of an earlier sweep")
    resume_hint = "resume=auto" if multirun else command_line_override("resume", target)
    return (f"{what}; a new run there would overwrite its checkpoints and metrics.json. "
            f"Continue it with {resume_hint}, start it over with overwrite=true "
            f"(removes its outputs first), or pick another {key}")


def env_flag(name: str) -> bool:
    """True when an environment variable is set to something other than 0/false/empty."""
    return os.environ.get(name, "").lower() not in ("", "0", "false", "no")
