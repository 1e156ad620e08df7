"""Which checkpoints ``trainer.save_top_k=K`` keeps: the K best validations by the monitored
metric, each a file named with its epoch and value, e.g. ``epoch003-val_acc-0.9944.pt``.

This module only decides. The checkpoint callback (:class:`ddpexp.callbacks.ModelCheckpoint`)
acts on its answer: it has the new file written through ``trainer.save_checkpoint`` (atomically,
:mod:`ddpexp.checkpoint.files`) and then, on global rank 0, deletes the files that fell out. The
order is what keeps a crash harmless: :meth:`TopK.offer` updates the ranking, the new file is
written and only then are the files that fell out of the ranking deleted. The
ranking is part of every checkpoint (:meth:`TopK.state_dict`), so a resumed run goes on
ranking against the files it kept; :meth:`TopK.reconcile` squares it with what is on disk.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

log = logging.getLogger("ddpexp")

# What the files of a ranking look like (and nothing else in checkpoints/ does).
PATTERN = re.compile(r"^epoch\d+-.+-[-+0-9.e]+(nan|inf)?\.pt$")


class TopK:
    """The ranking of the ``k`` best validations (best first) by ``metric`` in ``mode``
    (``max``: larger is better, ``min``: smaller is better)."""

    def __init__(self, k: int, metric: str, mode: str):
        if mode not in ("max", "min"):
            raise ValueError(f"mode {mode!r} is not one of max, min")
        self.k, self.metric, self.mode = int(k), metric, mode
        self.kept: list[dict] = []  # {"name", "value", "epoch"}, best first

    def filename(self, epoch: int, value: float) -> str:
        """``epoch003-val_acc-0.9944.pt``: no ``=`` or ``/``, so the path can be given to
        ``resume=`` on a Hydra command line as it is."""
        return f"epoch{epoch:03d}-{self.metric.replace('/', '_')}-{value:.6g}.pt"

    def _better(self, a: float, b: float) -> bool:
        return a > b if self.mode == "max" else a < b

    def offer(self, value: float, epoch: int) -> tuple[str | None, list[str]]:
        """Rank a validation. Returns the file name to write this epoch's checkpoint to (None
        when it does not make the top k) and the names that fell out of the ranking, to be
        deleted once the new file is on disk. The ranking is updated at once, so that the
        checkpoint about to be written already holds it."""
        if value is None or math.isnan(value):
            return None, []
        name = self.filename(epoch, value)
        # The same name again (an epoch validated again after a resume, to the same value)
        # takes the old entry's place; the write overwrites its file.
        others = [e for e in self.kept if e["name"] != name]
        # Ties: the earlier checkpoint stays ahead.
        position = next((i for i, e in enumerate(others) if self._better(value, e["value"])),
                        len(others))
        if position >= self.k:
            return None, self._trim()
        others.insert(position, {"name": name, "value": float(value), "epoch": int(epoch)})
        self.kept = others
        return name, self._trim()

    def _trim(self) -> list[str]:
        dropped = [e["name"] for e in self.kept[self.k:]]
        self.kept = self.kept[:self.k]
        return dropped

    def state_dict(self) -> dict:
        """The ranking as plain Python (what ``torch.load(weights_only=True)`` reads back)."""
        return {"metric": self.metric, "mode": self.mode, "kept": [dict(e) for e in self.kept]}

    def load_state_dict(self, state: dict | None) -> None:
        """Continue a ranking saved by :meth:`state_dict`. A ranking by another metric or
        direction (the run was resumed with a different ``trainer.monitor``) is not
        comparable: ranking starts afresh and the old files are left alone."""
        if not state:
            return
        if (state.get("metric"), state.get("mode")) != (self.metric, self.mode):
            log.warning("trainer.save_top_k: the checkpoint ranked by %s (%s), this run by %s (%s); "
                        "ranking starts afresh and its files stay", state.get("metric"),
                        state.get("mode"), self.metric, self.mode)
            return
        self.kept = [dict(e) for e in state["kept"]]

    def reconcile(self, directory: Path) -> list[str]:
        """Drop entries whose file is missing (a crash between saving the checkpoint and
        linking its top-k file) and return the names of ranking-like files in ``directory``
        that the ranking does not hold (a crash before the old ones were deleted, or files of
        a later point of a run resumed from an earlier checkpoint). Those are never deleted
        here: only files this ranking dropped are."""
        directory = Path(directory)
        missing = [e["name"] for e in self.kept if not (directory / e["name"]).is_file()]
        if missing:
            log.warning("trainer.save_top_k: %s no longer on disk; dropped from the ranking",
                        ", ".join(missing))
            self.kept = [e for e in self.kept if e["name"] not in missing]
        names = {e["name"] for e in self.kept}
        strays = sorted(p.name for p in directory.glob("epoch*.pt")
                        if PATTERN.match(p.name) and p.name not in names) if directory.is_dir() else []
        return strays
