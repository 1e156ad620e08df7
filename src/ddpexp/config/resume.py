"""What a resume may change: the new resolved config against the one its checkpoint holds.

:data:`RULES` is the one table that decides, key by key, whether a change is applied from
the resumed step (optimizer and schedule values, limits, loggers, callbacks, run control)
or refused, naming the key and both values (what the checkpoint's weights, optimizer state
or data position belong to). The run's parent refuses before anything is written
(:func:`refusal`); the trainer applies what is left and lists it in the log and in
``metrics.json``'s ``resume_changes``.

A resume continues the run it names: :func:`with_recorded_overrides` puts the overrides the
run was last started with before the resume's own on the command line, so that a key the
resume does not name keeps the run's value, and only the keys it names change (applied or
refused here).

Only what the user changed counts. A key the checkpoint's config lacks was added by a later
version; one that only the checkpoint has was dropped by one; a key that a later version's
defaults changed is no change when ``baseline`` (this version's config of the overrides the
run was last started with) already has the new value.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

APPLY, REFUSE, IGNORE = "apply", "refuse", "ignore"

# The first pattern (fnmatch, on the dotted key) that matches decides. A key no pattern
# matches is refused: a change nothing here vouches for could silently not take effect.
RULES: tuple[tuple[str, str, str], ...] = (
    ("resume", IGNORE, "how the run is continued"),
    ("overwrite", IGNORE, "how the run dir is claimed"),
    ("seed", REFUSE, "it reorders the data, so the epoch in progress would see some samples "
                     "twice and miss others"),
    ("optimizer._target_", REFUSE, "the checkpoint's optimizer state is another optimizer's"),
    ("optimizer._partial_", REFUSE, "the optimizer is built from it"),
    ("optimizer.*", APPLY, "written into the restored optimizer's param groups"),
    ("scheduler._target_", REFUSE, "the checkpoint's schedule progress is another schedule's"),
    ("scheduler._partial_", REFUSE, "the schedule is built from it"),
    ("scheduler.*", APPLY, "the schedule continues at its step with the new values"),
    ("model.*", REFUSE, "the checkpoint's weights are the model's it was saved with"),
    ("task.*", REFUSE, "the run's losses, metrics and best checkpoint are the task's"),
    ("data.batch_size", APPLY, "the position in the epoch converts to the new batch size"),
    ("data.num_workers", APPLY, "how the data is loaded"),
    ("data.pin_memory", APPLY, "how the data is loaded"),
    ("data.persistent_workers", APPLY, "how the data is loaded"),
    ("data.prefetch_factor", APPLY, "how the data is loaded"),
    ("data.fast_path", APPLY, "how the data is loaded"),
    ("data.download", APPLY, "how the data is fetched"),
    ("data.verify", APPLY, "how the data is checked"),
    ("data.*", REFUSE, "it changes the dataset, its split, its samples or their shapes"),
    ("trainer.monitor", REFUSE, "best.pt, the top-k files and early stopping were chosen by "
                                "the monitored metric"),
    ("trainer.monitor_mode", REFUSE, "best.pt, the top-k files and early stopping were "
                                     "chosen in this direction"),
    ("trainer.overfit_batches", REFUSE, "it changes the samples trained on"),
    ("trainer.*", APPLY, "limits, layout and run control"),
    ("callbacks.*", APPLY, "callbacks act from the resumed step"),
    ("logger.*", APPLY, "loggers record from the resumed step"),
)

# Keys a run's config leaves null for the data to fill in once loaded (the classes of an
# image folder, a text's vocabulary): the checkpoint holds the filled-in value.
FILLED_BY_DATA = frozenset({"data.num_classes", "model.num_classes", "model.vocab_size",
                            "task.num_classes", "data.shape", "model.input_shape"})
# Groups that are dicts of entries by name: adding or removing an entry is one change.
NAMED_ENTRIES = ("callbacks", "logger")
ABSENT = "(none)"


@dataclass(frozen=True)
class Change:
    """One key that differs: ``before`` in the checkpoint's config, ``after`` in this run's
    (:data:`ABSENT` for a callback or logger entry only one side has)."""

    key: str
    before: Any
    after: Any

    @property
    def verdict(self) -> str:
        return rule(self.key)[0]


def rule(key: str) -> tuple[str, str]:
    """(verdict, why) of :data:`RULES` for the dotted ``key``."""
    for pattern, verdict, why in RULES:
        if key == pattern or fnmatch.fnmatchcase(key, pattern):
            return verdict, why
    return REFUSE, "resume does not know that changing it mid-run is safe"


def changes(saved: Mapping[str, Any], new: Mapping[str, Any],
            baseline: Mapping[str, Any] | None = None) -> list[Change]:
    """The keys that a resume with config ``new`` changes against the checkpoint's config
    ``saved``, in key order, :data:`IGNORE` keys left out. ``baseline``: see the module's
    docstring (None: every difference counts)."""
    old, now = flatten(saved), flatten(new)
    base = flatten(baseline) if baseline is not None else None
    found = [*_entry_changes(saved, new, baseline), *_one_sided(old, now, base)]
    for key in sorted(old.keys() & now.keys()):
        before, after = old[key], now[key]
        if _same(before, after) or (after is None and key in FILLED_BY_DATA):
            continue
        if base is not None and key in base and _same(base[key], after):
            continue  # this version's default, not the user's change
        if rule(key)[0] != IGNORE:
            found.append(Change(key, before, after))
    return sorted(found, key=lambda c: c.key)


def _one_sided(old: Mapping[str, Any], now: Mapping[str, Any],
               base: Mapping[str, Any] | None) -> list[Change]:
    """Keys only one side has, outside the named entries: a change only where ``base``
    shows the user's hand (a key this version's config of the earlier overrides lacks,
    added with ``+``; one it has, removed with ``~``). Without ``base`` a key only one side
    has is taken for one that another version added or dropped."""
    found = []
    for key in sorted(old.keys() ^ now.keys()):
        if key.split(".")[0] in NAMED_ENTRIES or rule(key)[0] == IGNORE:
            continue
        other = old if key in now else now
        emptied = any(p in other and other[p] in ({}, None) for p in _parents(key))
        if key in now and (emptied or base is not None and key not in base):
            found.append(Change(key, ABSENT, now[key]))
        elif key in old and (emptied or base is not None and key in base):
            found.append(Change(key, old[key], ABSENT))
    return found


def _parents(key: str) -> list[str]:
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def refusal(found: list[Change], resume: str) -> str | None:
    """The message that refuses the changes of ``found`` that a resume cannot take (every
    one named, with both values and why), or None when all can be applied."""
    refused = [c for c in found if c.verdict == REFUSE]
    if not refused:
        return None
    lines = [f"  {c.key}: {shown(c.before)} in the checkpoint, {shown(c.after)} now "
             f"({rule(c.key)[1]})" for c in refused]
    fix = " ".join(f"{c.key}={shown(c.before)}" for c in refused if c.before != ABSENT)
    return (f"resume={resume} cannot change what the checkpoint was trained with:\n"
            + "\n".join(lines)
            + f"\nResume with the checkpoint's values ({fix}), or start a new run for the "
              "new ones.")


def value_at(config: Mapping[str, Any], key: str) -> Any:
    """The value of dotted ``key`` in ``config``, :data:`ABSENT` where it has none."""
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return ABSENT
        node = node[part]
    return node


def shown(value: Any) -> str:
    """``value`` as an override writes it: ``0.5``, ``[16]``, ``ddp``, ``null``."""
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), default=str).replace('"', "")


def _same(a: Any, b: Any) -> bool:
    """Equal values, ``1`` and ``1.0`` alike but ``true`` never ``1``."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys to leaf values (lists and empty dicts are values)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _entry_changes(saved: Mapping[str, Any], new: Mapping[str, Any],
                   baseline: Mapping[str, Any] | None) -> list[Change]:
    """The callback and logger entries (:data:`NAMED_ENTRIES`) that only one side has:
    ``callbacks.probe`` added, ``logger.mlflow`` removed; not an entry that ``baseline``
    has as this run has it (one that this version adds or dropped by default)."""
    found = []
    for group in NAMED_ENTRIES:
        old, now = saved.get(group) or {}, new.get(group) or {}
        if not isinstance(old, Mapping) or not isinstance(now, Mapping):
            continue
        base = (baseline or {}).get(group) or {}
        for name in sorted(old.keys() ^ now.keys()):
            if baseline is not None and (name in now) == (name in base):
                continue
            found.append(Change(f"{group}.{name}", old.get(name, ABSENT), now.get(name, ABSENT)))
    return found


# Overrides of a run's record that a resume does not take over: how that attempt was started
# and where its outputs went (the resume names its run dir itself).
NOT_CARRIED = ("hydra.", "hydra/", "resume=", "overwrite=")


def attempt_dirs(run_dir: Path) -> list[Path]:
    """The config dirs of a run's attempts, oldest first: ``.hydra``, then ``.hydra/resume-N``
    of each resume, those that hold an ``overrides.yaml``."""
    first = Path(run_dir) / ".hydra"
    dirs = [first, *sorted((p for p in first.glob("resume-*") if p.name[7:].isdigit()),
                           key=lambda p: int(p.name[7:]))]
    return [d for d in dirs if (d / "overrides.yaml").is_file()]


def recorded_overrides(attempt: Path) -> list[str] | None:
    """The task overrides an attempt was started with (its ``overrides.yaml``), without the
    ones of :data:`NOT_CARRIED`; None where the file cannot be read as a list."""
    import yaml

    try:
        saved = yaml.safe_load((attempt / "overrides.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(saved, list):
        return None
    return [str(o) for o in saved if not str(o).lstrip("+~").startswith(NOT_CARRIED)]


def with_recorded_overrides(args: Sequence[str]) -> list[str]:
    """The command line of a resume into a run dir (``resume=DIR``, a checkpoint file in it,
    or ``resume=auto`` with ``hydra.run.dir=DIR`` of a run that exists), with the overrides
    the run was last started with put before the resume's own overrides: a resume that
    names no key keeps every value of the run. A recorded override whose key (or a key
    above it) the command line sets is left out, but for a key the run added (``+key=...``)
    that the command line sets plainly (``key=...``), which it then changes; a deletion
    (``~key``) comes after the recorded overrides, so that it also removes what the run
    added. Any other command line (a new run, a sweep) is returned as it is."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from ddpexp.config.commands import VALUE_FLAGS

    args = list(args)
    if any(a in ("-m", "--multirun") for a in args):
        return args
    parser = OverridesParser.create()
    keys: dict[str, int] = {}  # the command line's override keys, by position
    set_keys: set[str] = set()  # those it gives a value (not ~key)
    added: set[str] = set()  # those it adds (+key, ++key)
    values: dict[str, Any] = {}
    for i, arg in enumerate(args):
        if arg.startswith("-") or (i > 0 and args[i - 1] in VALUE_FLAGS):
            continue
        try:
            override = parser.parse_override(arg)
        except Exception:  # Hydra reports what it cannot parse itself
            continue
        keys.setdefault(override.key_or_group, i)
        if not override.is_delete():
            set_keys.add(override.key_or_group)
            values[override.key_or_group] = override.value()
        if override.is_add() or override.is_force_add():
            added.add(override.key_or_group)
    run_dir = _resumed_run_dir(values)
    if run_dir is None or not keys:
        return args
    attempts = attempt_dirs(run_dir)
    recorded = recorded_overrides(attempts[-1]) if attempts else None
    if not recorded:
        return args
    kept = []
    for arg in recorded:
        try:
            override = parser.parse_override(arg)
        except Exception:
            continue  # one this version cannot parse: the resume's refusal names the key
        key = override.key_or_group
        # The run's own "+key=1" stays where the command line says "key=2": the key exists
        # only once it is added, and the later override then changes it.
        changed_after_add = override.is_add() and key in set_keys and key not in added
        if changed_after_add or not any(key == k or key.startswith(k + ".") for k in set_keys):
            kept.append(arg)
    first = min(keys.values())
    return [*args[:first], *kept, *args[first:]]


def _resumed_run_dir(values: Mapping[str, Any]) -> Path | None:
    """The run dir a command line resumes, where it names one that holds a run."""
    resume = values.get("resume")
    if resume == "auto":
        target = values.get("hydra.run.dir")
        target = Path(str(target)).expanduser() if target else None
    elif isinstance(resume, str) and resume:
        target = Path(resume).expanduser()
        if target.is_file() and target.parent.name == "checkpoints":
            target = target.parent.parent
    else:
        return None
    return target if target is not None and (target / ".hydra").is_dir() else None
