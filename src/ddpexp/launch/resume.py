"""The run's parent on a resume: what the new config changes against the checkpoint's, and
the refusal of what it cannot take, before any worker starts or anything is written.

The classification is :mod:`ddpexp.config.resume`'s table; this module finds the baseline
(this version's config of the overrides the run was last started with, so that a default
that a later version changed is not taken for the user's change) and raises the refusal.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ddpexp.config import resume as rules
from ddpexp.config.monitor import with_monitor
from ddpexp.config.schema import to_plain
from ddpexp.errors import ConfigError

log = logging.getLogger("ddpexp")


def checked_changes(saved: dict | None, new: dict, resume: Any, run_dir: Path,
                    hydra_cfg: Any) -> list[dict]:
    """The changes of config ``new`` against a checkpoint's config ``saved`` that the
    resume applies, as ``{"key", "from", "to"}``; a :class:`ConfigError` naming every key it
    cannot take. A checkpoint without a config (none of ddpexp's) changes nothing here."""
    if not isinstance(saved, dict):
        return []
    found = rules.changes(saved, new, _baseline(run_dir, hydra_cfg))
    problem = rules.refusal(found, str(resume))
    if problem:
        raise ConfigError(problem)
    return [{"key": c.key, "from": c.before, "to": c.after} for c in found]


def _baseline(run_dir: Path, hydra_cfg: Any) -> dict | None:
    """This version's resolved config of the overrides the run was last started with (its
    newest ``.hydra/**/overrides.yaml`` but this attempt's), or None where there are none or
    they no longer compose."""
    overrides = _earlier_overrides(run_dir, hydra_cfg)
    if overrides is None:
        return None
    try:
        from hydra import compose
        from hydra.core.global_hydra import GlobalHydra

        if not GlobalHydra.instance().is_initialized():
            return None  # a job process that got its config, not Hydra's loader
        cfg = compose(config_name=hydra_cfg.job.config_name, overrides=overrides)
        plain = to_plain(cfg)
        plain.pop("hydra", None)
        return with_monitor(plain)
    except Exception as exc:  # an override this version no longer takes: no baseline
        log.debug("no baseline config for the resume's changes: %s", exc)
        return None


def _earlier_overrides(run_dir: Path, hydra_cfg: Any) -> list[str] | None:
    """The task overrides of the newest earlier attempt in ``run_dir`` (``.hydra`` or
    ``.hydra/resume-N``), without ``resume=`` and ``hydra.*`` ones."""
    earlier = rules.attempt_dirs(run_dir)
    if hydra_cfg.output_subdir:
        # The newest is this attempt's, which Hydra has just written (resolving
        # hydra.output_subdir again would name the next one).
        earlier = earlier[:-1]
    return rules.recorded_overrides(earlier[-1]) if earlier else None
