"""The command line read back and written out again: the values an override list gives
(:func:`command_line_values`), one override quoted for Hydra and the shell
(:func:`command_line_override`), the command that continues a run or a sweep
(:func:`resume_command`, :func:`continue_sweep`) and the sweep's own command line as its jobs
receive it (:data:`SWEEP_COMMAND_ENV`)."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

# Hydra's flags that take the next word as their value (``--config-dir my_conf``).
VALUE_FLAGS = ("--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn",
                "--cfg", "-c", "--package", "-p", "--experimental-rerun")

# A sweep's value (``a,b``, ``range(3)``) in :func:`command_line_values`.
SWEPT = object()


def command_line_values(args: Sequence[str]) -> dict[str, Any]:
    """The overrides on the command line ``args`` as Hydra itself reads them, by key (its
    ``+``/``++`` prefix dropped): quotes and escapes undone, so that
    ``'hydra.run.dir="outputs/my run"'`` and ``hydra.run.dir=outputs/my\\ run`` both give
    ``"outputs/my run"``, and ``null``, numbers and booleans typed. A sweep's value is
    :data:`SWEPT`. Flags, their values, deletions (``~key``) and what Hydra cannot parse (it
    reports that itself) are left out."""
    parser = OverridesParser.create()
    values: dict[str, Any] = {}
    for arg in args:
        if arg.startswith("-"):
            continue
        try:
            override = parser.parse_override(arg)
        except HydraException:
            continue
        if override.is_delete():
            continue
        values[override.key_or_group] = SWEPT if override.is_sweep_override() else override.value()
    return values


def command_line_override(key: str, value: Any) -> str:
    """``key=value`` as one shell word that Hydra reads back as ``value``: quoted for Hydra
    where its grammar would read the bare value otherwise (spaces at the ends, non-ASCII
    letters, ``null``...), then for the shell. ``resume=outputs/run`` stays as it is;
    ``outputs/my run é`` becomes ``'resume="outputs/my run é"'``."""
    text = str(value)
    bare = f"{key}={text}"
    try:
        if OverridesParser.create().parse_override(bare).value() == text:
            return shlex.quote(bare)
    except HydraException:
        pass
    # In Hydra's quoted strings only backslashes before a quote (or the closing one) escape.
    escaped = re.sub(r'(\\*)("|$)', lambda m: m.group(1) * 2 + ("\\" + m.group(2) if m.group(2) else ""),
                     text)
    return shlex.quote(f'{key}="{escaped}"')


# Where a sweep's job processes find the sweep's command line (a JSON list of its words):
# their own is the job runner's.
SWEEP_COMMAND_ENV = "DDPEXP_SWEEP_COMMAND"


def resume_command(args: Sequence[str], run_dir: Path | str | None = None,
                   sweep_dir: Path | str | None = None, prefix: str = "python -m ddpexp",
                   fresh: bool = False) -> str:
    """The command that continues the run (or, with ``sweep_dir``, the sweep) that the
    command line ``args`` started, as one line a shell runs as it is: every flag
    (``--config-dir``, ``-cp``, ``-cn``, ``-m``) and override (``+``/``~`` ones included)
    of ``args`` kept, its ``resume=`` and run dir (``hydra.run.dir``, or ``hydra.sweep.dir``
    for a sweep) replaced by ``resume=<run_dir>`` (``resume=auto
    hydra.sweep.dir=<sweep_dir>``; with ``fresh``, for a run that saved no checkpoint yet,
    ``resume=auto hydra.run.dir=<run_dir>``), each word quoted for the shell."""
    replaced = ("resume", "hydra.sweep.dir" if sweep_dir is not None else "hydra.run.dir")
    flags, overrides, value_of_flag = [], [], False
    for arg in args:
        if value_of_flag or arg.startswith("-"):
            flags.append(arg)
        elif arg.split("=", 1)[0].lstrip("+~") not in replaced:
            overrides.append(arg)
        value_of_flag = arg in VALUE_FLAGS
    if sweep_dir is not None:
        resume = ["resume=auto", command_line_override("hydra.sweep.dir", sweep_dir)]
    elif fresh:
        resume = ["resume=auto", command_line_override("hydra.run.dir", run_dir)]
    else:
        resume = [command_line_override("resume", run_dir)]
    # Flags first: Hydra's argument parser takes no flag after the first override.
    return " ".join([prefix, *map(shlex.quote, flags), *resume, *map(shlex.quote, overrides)])


def sweep_command() -> list[str] | None:
    """The command line of the sweep this process runs (a job of): the one a sweep process
    hands its job processes (:data:`SWEEP_COMMAND_ENV`), or this process's own where it is
    the sweep's; None where neither is known (a job of another launcher, e.g. submitit)."""
    handed = os.environ.get(SWEEP_COMMAND_ENV)
    if handed:
        return json.loads(handed)
    own = sys.argv[1:]
    return own if any(a in ("-m", "--multirun") for a in own) else None


def continue_sweep(sweep_dir: Path | str) -> str:
    """How to continue the sweep in ``sweep_dir``: its whole command where it is known
    (:func:`sweep_command`), else what to add to it."""
    args = sweep_command()
    if args is None:
        return ("run the sweep's command again with: resume=auto "
                + command_line_override("hydra.sweep.dir", sweep_dir))
    return "run:\n  " + resume_command(args, sweep_dir=sweep_dir)
