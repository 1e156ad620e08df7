"""A sweep job's config as Hydra composes it, at a fraction of the cost after the first.

Hydra composes each job of a sweep from scratch: the defaults tree walked, every file read,
parsed and merged, 0.15-0.25 s of the launcher's CPU per job on the two cores the jobs
beside it train on. The jobs of a sweep mostly differ in a few values (``optimizer.lr=0.03``),
not in which files make them up. :class:`Composer` composes the first job of each *shape*
with Hydra; a later job of the same shape is a copy of it with the differing values set as
Hydra sets them (:meth:`ConfigLoaderImpl._apply_overrides_to_config`) and the entries that
name the overrides (``hydra.overrides.task``, ``hydra.job.override_dirname``) rewritten.

A shape is the job's override list with the value of each *value override* left out: a plain
``key=value`` (no ``+``, ``~`` or ``@package``, not ``hydra.*``, not a sweep) whose value is
a scalar and which Hydra applied to the config as a value. The first job of a shape is checked
for that (the key's node is a leaf holding its value); a key that fails it (``model=mlp``
chooses a config group's option: the node is the option's config) is part of every shape as
written from then on. Any other override is part of the shape as written too, so another
config group choice, an added key or another Hydra override composes with Hydra; so does a
job whose overrides do not parse, so that the error is Hydra's own. The config files are
read once per shape: an edit to them while the sweep runs reaches jobs of a new shape only.
"""

from __future__ import annotations

import copy
from typing import Any, cast

from omegaconf import Container, DictConfig, OmegaConf, open_dict

Scalar = (str, int, float, bool, type(None))


class Composer:
    """Composes the jobs of one sweep: ``loader`` is the Hydra context's config loader,
    ``master`` the sweep's own config (Hydra's overrides and resolver cache come from it)."""

    def __init__(self, loader: Any, master: DictConfig) -> None:
        self.loader, self.master = loader, master
        # Unresolved, as Hydra reads them: 'hydra.sweep.subdir=${hydra.job.num}' is a line.
        self.hydra_overrides = [
            str(o) for o in cast(list, OmegaConf.to_container(master.hydra.overrides.hydra))]
        # shape -> (the first job's config, untouched, and its parsed overrides), or None for
        # a shape whose values Hydra did not apply as values (composed with Hydra every time).
        self.templates: dict[tuple, tuple[DictConfig, list] | None] = {}
        self.composed = 0  # by Hydra (the rest were copies)
        self.written: set[str] = set()  # keys of value form that Hydra took as no value

    def compose(self, overrides: list[str]) -> DictConfig:
        """The config of the job with these overrides, as ``load_sweep_config`` makes it."""
        parsed = self._parse(overrides)
        shape = None if parsed is None else self._shape(parsed)
        held = self.templates.get(shape) if shape is not None else None
        if held is None:
            cfg = self._hydra(overrides)
            if shape is not None and shape not in self.templates:
                assert parsed is not None
                not_values = _not_applied_as_values(cfg, parsed, self.written)
                # A key found to be no value (a config group's choice) is part of the shape
                # as written from now on: the next job of this shape is another shape.
                self.written |= not_values
                self.templates[shape] = None if not_values else (copy.deepcopy(cfg), parsed)
            return cfg
        template, first = held
        assert parsed is not None
        return self._from(template, first, parsed)

    def _shape(self, parsed: list) -> tuple:
        return tuple(("value", o.key_or_group) if self._is_value(o) else ("as written", o.input_line)
                     for o in parsed)

    def _is_value(self, override: Any) -> bool:
        return _is_value(override) and override.key_or_group not in self.written

    def _hydra(self, overrides: list[str]) -> DictConfig:
        self.composed += 1
        return self.loader.load_sweep_config(self.master, list(overrides))

    def _parse(self, overrides: list[str]) -> list | None:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        try:
            return OverridesParser.create().parse_overrides(self.hydra_overrides + list(overrides))
        except Exception:  # Hydra's compose raises it with its own message
            return None

    def _from(self, template: DictConfig, first: list, parsed: list) -> DictConfig:
        from hydra._internal.config_loader_impl import ConfigLoaderImpl, get_overrides_dirname

        changed = {o.key_or_group for o, f in zip(parsed, first, strict=True)
                   if self._is_value(o) and o.input_line != f.input_line}
        cfg = copy.deepcopy(template)
        # Every override of a changed key again, in order: the last one for a key wins.
        ConfigLoaderImpl._apply_overrides_to_config(
            [o for o in parsed if self._is_value(o) and o.key_or_group in changed], cfg)
        task = [o for o in parsed if not o.is_hydra_override()]
        lines = cast(list, OmegaConf.to_container(cfg.hydra.overrides.task))  # unresolved
        names = cfg.hydra.job.config.override_dirname
        with open_dict(cfg.hydra):
            cfg.hydra.overrides.task = lines[:len(lines) - len(task)] + [o.input_line for o in task]
            cfg.hydra.job.override_dirname = get_overrides_dirname(
                overrides=task, kv_sep=names.kv_sep, item_sep=names.item_sep,
                exclude_keys=names.exclude_keys)
        OmegaConf.copy_cache(from_config=self.master, to_config=cfg)
        return cfg


def _is_value(override: Any) -> bool:
    """Whether ``override`` is, by its form, a plain scalar ``key=value`` on the job's config."""
    from hydra.core.override_parser.types import OverrideType

    return (override.type == OverrideType.CHANGE and override.package is None
            and not override.is_hydra_override() and not override.is_sweep_override()
            and isinstance(override.value(), Scalar))


def _not_applied_as_values(cfg: DictConfig, parsed: list, written: set[str]) -> set[str]:
    """The keys of ``parsed``'s value overrides that Hydra did not apply to ``cfg`` as values:
    whose node is no leaf holding the last such override's value (a config group's choice
    makes a node of the group's config there)."""
    last = {o.key_or_group: o.value() for o in parsed
            if _is_value(o) and o.key_or_group not in written}
    found = set()
    for key, value in last.items():
        parent_key, _, name = key.rpartition(".")
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
        node = (parent._get_node(name, validate_access=False)
                if isinstance(parent, DictConfig) and name in parent else None)
        if node is None or isinstance(node, Container) or node._value() != value:
            found.add(key)
    return found
