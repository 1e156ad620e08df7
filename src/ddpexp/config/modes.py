"""Run modes as the spec holds them: what every mode is (:class:`RunMode`), what a mode may
call on the trainer (:class:`Runnable`), and the registry of modes by name (:data:`MODES`),
through which a spec that arrives as JSON gets its mode back. The modes themselves are
:mod:`ddpexp.modes`."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self

if TYPE_CHECKING:
    from ddpexp.runtime.dist import DistContext


class SpecView(Protocol):
    """What a mode reads of the run's :class:`~ddpexp.config.spec.RunSpec` besides itself."""

    @property
    def run_dir(self) -> Path: ...

    @property
    def resume_from(self) -> Path | None: ...

    @property
    def resume_changes(self) -> list: ...


class Runnable(Protocol):
    """The trainer as a mode drives it (:class:`ddpexp.training.trainer.Trainer`)."""

    ctx: DistContext

    def fit(self, resume_from: Path | None = None,
            resume_changes: Sequence[Mapping[str, Any]] = ()) -> dict:
        """Train; every rank returns the run's result (``status`` says how it ended)."""
        ...

    def evaluate_checkpoint(self, path: Path, split: str = "test") -> dict | None:
        """Evaluate the weights of ``path`` on ``split``; global rank 0 gets the metrics."""
        ...


@dataclasses.dataclass(frozen=True)
class RunMode:
    """A run mode's settings; subclasses add their fields and :meth:`run`."""

    name: ClassVar[str] = ""

    def run(self, trainer: Runnable, spec: SpecView) -> dict | None:
        """Do this mode's work with ``trainer`` as one rank of the run; global rank 0
        returns what ``metrics.json`` gets (the other ranks may return it too, or None).
        A result whose ``status`` is ``interrupted`` makes every rank wait for rank 0's
        record before it exits."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        """The mode's fields as JSON-ready values (paths as strings)."""
        return {f.name: str(v) if isinstance(v, Path) else v
                for f in dataclasses.fields(self) for v in [getattr(self, f.name)]}

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> Self:
        """The mode of :meth:`to_dict`'s fields."""
        return cls(**fields)


# name -> the class that runs it, by dotted path (imported when a spec names it).
MODES: dict[str, str] = {
    "train": "ddpexp.modes.train.Train",
    "evaluate": "ddpexp.modes.evaluate.Evaluate",
    "find_lr": "ddpexp.modes.find_lr.FindLR",
    "find_batch": "ddpexp.modes.find_batch.FindBatch",
}


def mode_class(name: str) -> type[RunMode]:
    """The class of the mode registered as ``name``."""
    try:
        path = MODES[name]
    except KeyError:
        raise ValueError(f"run mode {name!r} is not one of {sorted(MODES)}") from None
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)



def to_dict(mode: RunMode) -> dict[str, Any]:
    """``mode`` as JSON-ready data: its name and its fields (paths as strings)."""
    return {"name": mode.name, **mode.to_dict()}


def from_dict(data: Mapping[str, Any]) -> RunMode:
    """The mode :func:`to_dict` wrote."""
    fields = dict(data)
    return mode_class(fields.pop("name")).from_dict(fields)
