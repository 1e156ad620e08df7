"""Compose the real config with Hydra's compose API and build a one-process trainer from it,
so seams and arithmetic are tested without a subprocess."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ddpexp.config.compose import compose_single_process
from ddpexp.config.schema import register_configs

register_configs()


def compose_config(*overrides: str, config_dir: Path | None = None) -> dict:
    """The resolved config (plain Python, as workers receive it) for ``overrides``, with the
    task's monitor filled in as a run's parent does. ``config_dir`` is a user's own config dir
    (``--config-dir``)."""
    return compose_single_process(list(overrides), config_dir)


def build_trainer(run_dir: Path, overrides: Sequence[str] = (), config_dir: Path | None = None):
    """A one-process :class:`ddpexp.training.trainer.Trainer` built from the composed config."""
    from ddpexp.runtime.dist import DistContext
    from ddpexp.training.trainer import Trainer

    plain = compose_config("trainer.progress_bar=false", *overrides, config_dir=config_dir)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return Trainer.from_config(plain, DistContext(), Path(run_dir))
