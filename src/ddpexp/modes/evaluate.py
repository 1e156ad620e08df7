"""``python -m ddpexp.eval``: one checkpoint evaluated on one split, nothing trained."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Self

from ddpexp.config.modes import RunMode, Runnable, SpecView


@dataclasses.dataclass(frozen=True)
class Evaluate(RunMode):
    """Evaluate the weights of ``checkpoint`` on ``split`` (``val`` or ``test``)."""

    checkpoint: Path
    split: str = "test"
    name: ClassVar[str] = "evaluate"

    def run(self, trainer: Runnable, spec: SpecView) -> dict | None:
        return trainer.evaluate_checkpoint(self.checkpoint, self.split)

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> Self:
        return cls(checkpoint=Path(fields["checkpoint"]), split=fields.get("split", "test"))
