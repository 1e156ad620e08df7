"""The training loop of one worker: train and validate each epoch, firing the events that
callbacks act on.

The loop knows no task and no feature. A :class:`ddpexp.task.Task` computes each batch's
metrics; the trainer weights them by the batch's sample count, back-propagates ``loss`` and
logs ``train/<name>`` and ``val/<name>`` to the run's loggers. Checkpoints, early stopping,
the average of the weights, profiling and pruning are callbacks (:mod:`ddpexp.callbacks`),
TensorBoard and the other outputs are loggers (:mod:`ddpexp.loggers`).

Every rank runs a :class:`Trainer` and every callback; only global rank 0 (``is_main``)
writes. The hot path keeps metrics on the device and talks to the other ranks only at log
steps and epoch ends (the agreement points, where a stop signal, a callback's
:meth:`Trainer.request_stop` and a divergence become every rank's decision), so it costs
what a hand-written DDP loop costs.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from ddpexp import provenance, strategies
from ddpexp.callbacks.base import Callback, Dispatch
from ddpexp.callbacks.state import Best, RunState
from ddpexp.checkpoint.background import Saver
from ddpexp.config.resume import shown
from ddpexp.config.schema import TrainerConfig, trainer_of
from ddpexp.config.spec import RunSpec
from ddpexp.data.base import DataSource
from ddpexp.errors import ConfigError, DdpexpError
from ddpexp.loggers import RunInfo, run_name
from ddpexp.loggers.collection import Loggers
from ddpexp.record import FINISHED, read_metrics_or_empty, write_metrics
from ddpexp.runtime.dist import DistContext, derive_seed, seed_everything
from ddpexp.runtime.heartbeat import (
    BACKWARD,
    DATA,
    FORWARD,
    OPTIMIZER,
    VALIDATION,
    heartbeat_from_env,
)
from ddpexp.runtime.signals import Interrupted
from ddpexp.task import Task, as_task
from ddpexp.training import checkpoint_state as schema
from ddpexp.training import evaluation, loaders, probe
from ddpexp.training.agreement import STOP_STATUSES, Agreement
from ddpexp.training.divergence import Divergence
from ddpexp.training.meters import RunningMeans, means
from ddpexp.training.split_metrics import SplitMetrics
from ddpexp.training.surface import CallbackSurface

log = logging.getLogger("ddpexp")



class Trainer(CallbackSurface):
    """Trains ``model`` on ``task`` with the data of ``data``; :meth:`from_config` builds all
    of it from a resolved config, then :meth:`fit` runs."""

    def __init__(
        self,
        cfg: TrainerConfig,
        ctx: DistContext,
        run_dir: Path,
        *,
        task: Task,
        model: nn.Module,
        data: DataSource,
        datasets: Sequence[Dataset],
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None = None,
        seed: int = 0,
        config: dict | None = None,
        hparams: dict | None = None,
        sweep_dir: Path | None = None,
        callbacks: Mapping[str, Callback] | None = None,
        loggers: Mapping[str, Any] | None = None,
        origin: Mapping[str, Any] | None = None,
    ):
        self.t, self.ctx, self.run_dir = cfg, ctx, Path(run_dir)
        # Where this rank is, for the launching process's stall watchdog (a no-op without one).
        self.beat = heartbeat_from_env(ctx.local_rank, ctx.restart, ctx.rank)
        self.task, self.data, self.seed = as_task(task), data, seed
        self.config = config or {}
        self.hparams = hparams or {}
        self.sweep_dir = sweep_dir
        # RunSpec.origin: a run the CLI started records its provenance (one built without
        # it, by a test or a measurement, does not).
        self.origin = origin
        self.device = ctx.device
        self.monitor = cfg.monitor or self.task.monitor
        self.monitor_mode = str(cfg.monitor_mode or self.task.monitor_mode)
        self.loggers = Loggers(loggers or {} if ctx.is_main else {})
        if cfg.deterministic:
            # cuBLAS is deterministic only with a fixed workspace, chosen before its first use.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        self.strategy = strategies.for_config(cfg, ctx)
        # trainer.async_save: checkpoints written by a background thread, one at a time.
        # Under fsdp every rank writes its shards in the background (DCP's async save).
        capable = self.strategy.background_save or self.strategy.staged_save
        self.saver = Saver(cfg.async_save, capable, quiet=not ctx.is_main)
        if not capable and cfg.async_save is not False and ctx.is_main:
            log.info("trainer.async_save: strategy=%s writes its checkpoints in the loop",
                     self.strategy.label())
        built = loaders.build(cfg, ctx, data, datasets, seed, self.strategy)
        self.train_sampler, self.train_loader = built.train_sampler, built.train_loader
        self.batches_per_epoch, self.rank_train_samples = built.batches_per_epoch, built.rank_train_samples
        self.epoch_samples = built.epoch_samples
        self.val_ds, self.val_loader, self.test_ds = built.val_ds, built.val_loader, built.test_ds
        self.rank_seed = built.rank_seed
        self._init_state()
        self._place_model(model)
        self.split_metrics = SplitMetrics(self.task, self.device, ctx.dp_group)
        # The probes run before the strategy wraps the model: a model that falls back from
        # channels_last must have its final layout before DDP lays out its gradient buckets.
        probed = probe.check_task(self, self.memory_format, self.layout_on_trial)
        self.val_names, self.memory_format = probed.val_names, probed.memory_format
        self.divergence.ceiling.set_start(probed.start_loss)
        self.strategy.checkpoint_activations(self.module)
        self.module = self.strategy.prepare(self.module)
        self.model = self.strategy.wrap(self.module)
        self.forward = torch.compile(self.model) if cfg.compile else self.model
        # Per data-parallel rank: the ranks of one tensor-parallel group draw alike (dropout
        # on the activations they all hold must agree).
        seed_everything(derive_seed(seed, ctx.dp_rank, 1))
        self._build_optimization(optimizer, scheduler)
        self.callbacks = Dispatch(callbacks or {})
        self.callbacks.fire("setup", self)
        self.started = time.time()  # set-up done: time/first_step_s counts from here

    @classmethod
    def from_spec(cls, spec: RunSpec, ctx: DistContext) -> Trainer:
        """Build task, data, model, optimizer, scheduler, callbacks and (on rank 0) loggers
        from the run's spec, as a worker receives it; return the trainer."""
        from ddpexp.training.build import build_parts

        return cls(ctx=ctx, run_dir=spec.run_dir, hparams=spec.hparams, sweep_dir=spec.sweep_dir,
                   origin=spec.origin, **build_parts(spec.config, spec.trainer, ctx))

    @classmethod
    def from_config(cls, config: dict, ctx: DistContext, run_dir: Path,
                    hparams: dict | None = None) -> Trainer:
        """:meth:`from_spec` of a resolved plain config alone (its ``trainer`` node typed
        here), for a trainer built in this process (tests, measurements)."""
        from ddpexp.training.build import build_parts

        return cls(ctx=ctx, run_dir=run_dir, hparams=hparams,
                   **build_parts(config, trainer_of(config), ctx))

    # ------------------------------------------------------------------ building
    def eval_loader(self, dataset: Dataset):
        """This rank's unpadded shard of ``dataset`` (each sample counted once in all)."""
        return loaders.eval_loader(self.t, self.ctx, self.data, dataset, self.rank_seed,
                                   self.strategy)

    def _place_model(self, model: nn.Module) -> None:
        """The model on this rank's device, in its memory format, with its autocast dtype."""
        t = self.t
        if not any(p.requires_grad for p in model.parameters()):
            raise ConfigError(
                f"model._target_ built a {type(model).__name__} without trainable parameters: "
                "there is nothing to train. Give the model parameters (nn.Parameter, layers "
                "such as nn.Linear) that require grad"
            )
        self.memory_format, self.layout_on_trial = probe.memory_format(model, t, self.device)
        model.to(self.device, memory_format=self.memory_format)  # pyright: ignore[reportCallIssue]  # Module.to takes it; its stubs list no such overload
        self.module = model
        self.amp_dtype = {"bf16": torch.bfloat16, "16": torch.float16}.get(str(t.precision))

    def _build_optimization(self, optimizer: Callable, scheduler: Callable | None) -> None:
        t = self.t
        self.optimizer = optimizer(self.module.parameters())
        self.steps_per_epoch = max(1, math.ceil(self.batches_per_epoch / t.accumulate))
        total = self.steps_per_epoch * t.max_epochs
        if t.max_steps is not None:
            total = min(total, t.max_steps)
        self.total_steps = total
        self.scheduler = None
        if scheduler is not None:
            self.scheduler = scheduler(self.optimizer, total_steps=total,
                                       steps_per_epoch=self.steps_per_epoch)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=str(t.precision) == "16")
        self.params = [p for p in self.module.parameters() if p.requires_grad]

    def _init_state(self) -> None:
        self.state = RunState(Best(self.monitor, self.monitor_mode))
        self.test_metrics: dict = {}  # test/<name> of best.pt and its epoch, once tested
        self.started = time.time()
        self.resumed = False
        self.resume_changes: list[dict] = []  # metrics.json's, every resume's (rank 0)
        self.train_means = RunningMeans(self.device)  # training metrics not yet logged
        self.logged: dict[str, float] = {}  # the latest logged training metrics (rank 0)
        self._last_log_time = time.perf_counter()
        self._grad_norm: torch.Tensor | None = None
        self._stepping = 0  # 1 while on_before_optimizer_step runs (see log_metrics)
        self._first_step_pending = True
        self.divergence = Divergence(self.t.divergence_factor)
        self.agreement = Agreement(self.ctx.rank, self.ctx.world_size, self.device, self.divergence,
                                   counts=self.ctx.counts_samples)

    # ------------------------------------------------------------------ the run
    def fit(self, resume_from: Path | None = None,
            resume_changes: Sequence[Mapping[str, Any]] = ()) -> dict:
        """Train to ``max_epochs``/``max_steps`` (or until stopped) and return the metrics
        that ``metrics.json`` holds. ``resume_changes``: the config changes against the
        checkpoint's that the run's parent let through (``RunSpec.resume_changes``), applied
        from the resumed step."""
        if resume_from is not None:
            self._load(resume_from, resume_changes)
            if self.ctx.is_main:
                # This attempt's record from here on: one that fails now is not taken for
                # the earlier attempt's (completed) run.
                write_metrics(self.run_dir, self._result())
        self._write_provenance()
        self._open_loggers()
        try:
            with strategies.debug_modes(self.t), contextlib.closing(self.beat):
                self.callbacks.fire("on_fit_start", self)
                with self.agreement.signal:
                    self._loop()
                self.saver.release()  # the run ends, and tests best.pt, once it is on disk
                if self.status == "running":
                    self.state.status = "completed"
                if self.t.test and self.status in FINISHED:
                    self._test()  # still watched: the test of best.pt runs collectives too
        except BaseException as exc:
            self.callbacks.fire("on_exception", self, exc)
            cause = self._settle_saves(exc)
            self.loggers.finalize("interrupted" if isinstance(exc, KeyboardInterrupt) else "failed")
            if cause is not None:
                raise cause from None
            raise
        result = self._result()
        self.callbacks.fire("on_fit_end", self, result)
        # The loggers finish first (each within its flush_timeout_s), so that metrics.json can
        # list the points a tracker lost.
        self.loggers.finalize(self.status)
        lost = self.loggers.lost()
        if lost:
            result["lost_points"] = lost
        if self.ctx.is_main:
            write_metrics(self.run_dir, result)
        return result

    def _write_provenance(self) -> None:
        """Rank 0 records what made the run (:mod:`ddpexp.provenance`) before its first step;
        a record that cannot be written costs a warning, not the run."""
        if not self.ctx.is_main or not self.origin:
            return
        try:
            provenance.write(self.run_dir, config=self.config, source=self.data, ctx=self.ctx,
                             origin=self.origin,
                             backend=dist.get_backend() if dist.is_initialized() else None)
        except Exception as exc:  # a full disk, a user's data_files() that raises: not the run's end
            log.warning("provenance.json not written: %s: %s", type(exc).__name__, exc)

    def _loop(self) -> None:
        while self.epoch < self.t.max_epochs and not self._steps_done():
            epoch_start = time.perf_counter()
            complete = self._train_epoch()
            if self.diverged:
                return self._diverge()
            if self.stopping:
                return self._interrupt()
            val = self._validate()
            if self.diverged:  # a non-finite loss since the last log step
                return self._diverge()
            self._end_epoch(val, time.perf_counter() - epoch_start, complete)
            if self.diverged:  # the weights themselves went non-finite
                return self._diverge()
            if self.stopping:  # a signal arrived during the last steps or the validation
                return self._interrupt()
            if self.status != "running":
                return

    def _train_epoch(self) -> bool:
        """One pass over this rank's shard from ``self.batch`` on; True if it reached the end.

        A stop is acted on only where all ranks agree on it (log steps, validation), so no
        rank leaves a collective the others are in."""
        self.model.train()
        bs, accumulate = self.data.batch_size, self.t.accumulate
        self.train_sampler.set_epoch(self.epoch, skip=self.batch * bs)
        generator = getattr(self.train_loader, "generator", None)
        if generator is not None:  # DataLoader workers' seeds: a function of (data-parallel rank, epoch)
            generator.manual_seed(derive_seed(self.seed, self.ctx.dp_rank, self.epoch, 2))
        self.callbacks.fire("on_train_epoch_start", self)
        group_end = 0
        # trainer.limit_train_batches / overfit_batches end the epoch early.
        batches = itertools.islice(self.train_loader, self.batches_per_epoch - self.batch)
        for i, batch in enumerate(self._fetching(batches), start=self.batch):
            if i >= group_end:  # the first micro-batch of an optimizer step
                group_end = min(i + accumulate, self.batches_per_epoch)
                group_samples = loaders.mean_share(self.epoch_samples, bs, self.strategy.dp_size,
                                                   i, group_end)
            last_micro = i + 1 == group_end
            self._run_batch(batch, last_micro, group_samples, self.rank_train_samples - i * bs)
            if not last_micro:
                continue
            self.state.batch = i + 1
            log_now = (self.step + 1) % self.t.log_every_n_steps == 0
            self._optimizer_step(log_now)
            self.state.step += 1
            self.saver.poll()  # a background save that failed fails the run here
            if self._first_step_pending:
                self._log_first_step()
            if log_now:
                self._log_step()  # also an agreement point
            self.callbacks.fire("on_train_batch_end", self)
            if self.ctx.world_size == 1:
                self.agreement.alone()
            if self.leaving_epoch():
                return self.batch >= self.batches_per_epoch
        self.state.batch = self.batches_per_epoch
        return True

    def _fetching(self, loader: Any):
        """``loader``'s batches, marking the data phase while each is fetched."""
        it = iter(loader)
        while True:
            self.beat.mark(DATA, self.step)
            try:
                batch = next(it)
            except StopIteration:
                return
            except DdpexpError as exc:  # raised in a loader worker: its own message, once
                raise loaders.own_message(exc) from None
            yield batch

    def autocast(self):
        """The precision's autocast context (a no-op at 32)."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def to_device(self, batch: Any) -> Any:
        """``batch`` on this rank's device, in the model's memory format (see
        :func:`ddpexp.training.loaders.to_device`)."""
        return loaders.to_device(batch, self.device, self.memory_format)

    def _run_batch(self, batch: Any, last_micro: bool, group_samples: float, real: int) -> None:
        """Forward and backward of one micro-batch. The task's mean loss is weighted by the
        micro-batch's share of the optimizer step's samples, so that accumulating N batches
        of B gives the gradient of one batch of N*B (and an uneven last batch counts right).
        ``real``: this rank's samples left in the epoch; beyond them the batch is the
        sampler's padding, cut off here (a batch of padding alone counts nothing)."""
        batch = self.to_device(batch)
        n = self.task.batch_size(batch)
        if real < n:  # the sampler's padding: cut off, or (nothing real left) weighted 0
            batch, n = loaders.without_padding(batch, real, n, self.task.batch_size)
        try:
            with self.strategy.no_sync(self.model, last_micro):
                self.beat.mark(FORWARD, self.step)
                with self.autocast():
                    out = self.task.training_step(cast(nn.Module, self.forward), batch)
                self.beat.mark(BACKWARD, self.step)
                loss = out["loss"] if n == group_samples else out["loss"] * (n / group_samples)
                self.scaler.scale(loss).backward()
        except RuntimeError as exc:
            if "find_unused_parameters" not in str(exc):
                raise
            raise ConfigError(
                "some of the model's parameters take no part in the loss, which DDP refuses "
                "by default. Set trainer.find_unused_parameters=true (or use every "
                "parameter in forward)"
            ) from exc
        if n:
            self.train_means.add(out, n, type(self.task).__name__, "training_step")

    def _optimizer_step(self, log_now: bool) -> None:
        self.beat.mark(OPTIMIZER, self.step)
        clip = self.t.grad_clip
        if clip is not None or log_now:
            self.scaler.unscale_(self.optimizer)
            if clip is not None:
                self._grad_norm = self.strategy.clip(self.params, clip)
            else:
                self._grad_norm = self.strategy.grad_norm(self.params)
        self._stepping = 1
        try:
            self.callbacks.fire("on_before_optimizer_step", self)
        finally:
            self._stepping = 0
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()

    def _log_first_step(self) -> None:
        """Record start-up cost once per session: ``time/first_step_s`` is the seconds from
        the end of the trainer's set-up (data, model, optimizer built) to the end of its
        first optimizer step; the event's wall time, when that step ended, is what
        scripts/bench.py reads."""
        self._first_step_pending = False
        self.log_metrics({"time/first_step_s": time.time() - self.started})

    # ------------------------------------------------------------------ logging
    def _log_step(self) -> None:
        names = self.train_means.names or []
        *totals, seen = self._reduce(self.train_means.pending(), self.train_means.seen)
        now = time.perf_counter()
        rate = seen / max(now - self._last_log_time, 1e-9)
        self._last_log_time = now
        self.train_means.reset()
        if not self.ctx.is_main:
            return
        values = means(names, totals, seen, "train", self.task.derived)
        values["train/samples_per_s"] = rate
        if self._grad_norm is not None:
            values["train/grad_norm"] = float(self._grad_norm)
        self.logged = values
        self.log_metrics(values)

    def _open_loggers(self) -> None:
        if self.loggers:
            self.loggers.open(RunInfo(run_dir=self.run_dir, name=run_name(self.run_dir),
                                      config=self.config, hparams=self.hparams,
                                      resumed=self.resumed, step=self.step,
                                      sweep_dir=self.sweep_dir))

    # ------------------------------------------------------------------ divergence
    def _diverge(self) -> None:
        """Stop a run whose training loss diverged; nothing is saved (last.pt and best.pt
        keep the weights from before)."""
        self.state.status = "diverged"
        if self.ctx.is_main:
            log.warning("epoch %d  step %d: %s; stopping", self.epoch, self.step, self.divergence.warning())

    def divergence_message(self) -> str:
        """What happened and what to try, for the log and the run's failure."""
        return self.divergence.message(self.optimizer.param_groups[0]["lr"], self.state.last_saved_step,
                                     str(self.t.precision))

    # ------------------------------------------------------------------ evaluation
    def _validate(self) -> dict[str, float]:
        """The epoch's validation, between its two events (where the average of the weights
        is swapped in and out)."""
        self.callbacks.fire("on_validation_start", self)
        val = self.evaluate(self.val_loader, "val")
        self.callbacks.fire("on_validation_end", self, val)
        return val

    @torch.no_grad()
    def evaluate(self, loader: Any, prefix: str = "val") -> dict[str, float]:
        """The task's validation metrics over the whole dataset behind ``loader`` (this rank's
        shard of it, from :meth:`eval_loader`), each sample counted once across ranks, as
        ``prefix/<name>``, then the task's metrics over the whole split
        (:mod:`ddpexp.training.split_metrics`). The unwrapped model is used, so no collective runs per
        batch."""
        self.beat.mark(VALIDATION, self.step)
        self._sync_buffers()
        self.module.eval()
        sums = RunningMeans(self.device, self.val_names)
        whole = self.split_metrics
        if whole:
            whole.reset()  # an evaluation cut short (a signal) leaves nothing behind
        for batch, counted in self.strategy.eval_batches(loader):
            batch = self.to_device(batch)
            with self.autocast():
                out = self.task.validation_step(self.module, batch)
            if not counted:  # a forward that only keeps the ranks in step (fsdp)
                continue
            sums.add(out, self.task.batch_size(batch))
            if whole:
                whole.update(out, batch)
        *totals, count = self._reduce(sums.pending(), sums.seen)
        self.evaluated_samples = int(count)  # all ranks' (fewer than the split's with a limit)
        values = means(self.val_names, totals, count, prefix, self.task.derived)
        if whole:
            values.update(whole.compute(prefix))
        return values

    def _test(self) -> None:
        """``test/<name>`` of ``best.pt`` (:func:`ddpexp.training.evaluation.evaluate_best`)."""
        self.wait_for_saves()
        result = evaluation.evaluate_best(self)
        if result is not None:
            self.test_metrics = {**result["metrics"], "epoch": result["epoch"]}

    def evaluate_checkpoint(self, path: Path, split: str = "test") -> dict | None:
        """See :func:`ddpexp.training.evaluation.evaluate_checkpoint`; every rank must call it."""
        self.wait_for_saves()
        return evaluation.evaluate_checkpoint(self, path, split)

    def _sync_buffers(self) -> None:
        """Give every rank rank 0's buffers (BatchNorm statistics) before evaluating, so all
        ranks evaluate the weights that rank 0 saves."""
        if self.ctx.world_size > 1:
            for buf in self.module.buffers():
                dist.broadcast(buf, src=0)

    # ------------------------------------------------------------------ epoch end
    def _end_epoch(self, val: dict[str, float], epoch_time: float, complete: bool = True) -> None:
        """Record a validation and fire the epoch's end (the checkpoint callback saves last).
        ``complete`` is False when the epoch ended part-way (max_steps, a stop): the
        checkpoint then resumes mid-epoch."""
        run = self.state
        run.epoch_finished = complete
        run.metrics = val
        run.history.append({"epoch": self.epoch, "step": self.step, **val})
        run.best.update(val[self.monitor], self.epoch)
        if self.ctx.is_main:
            self.log_metrics({**val, "epoch/time_s": epoch_time, "epoch": self.epoch})
            if run.best.value is not None:
                self.log_metrics({f"best/{self.monitor}": run.best.value})
            shown = "  ".join(f"{k} {v:.4f}" for k, v in val.items())
            log.info("epoch %d  step %d  %s%s  (%.1fs)", self.epoch, self.step, shown,
                     "  *best*" if self.improved else "", epoch_time)
        self.callbacks.fire("on_train_epoch_end", self, val)
        self.agreement.alone() if self.ctx.world_size == 1 else self.agree()
        agreed = self.agreement
        if agreed.status is not None and self.status == "running" and not agreed.interrupted:
            run.status = agreed.status
            if self.ctx.is_main:
                log.info("%s", agreed.reason if self.status != "stopped"
                         else f"stop requested ({agreed.reason}): ending the run")
        if complete:
            run.epoch += 1
            run.batch = 0
        run.epoch_finished = False
        if self.ctx.is_main:
            write_metrics(self.run_dir, self._result())

    def _settle_saves(self, exc: BaseException) -> BaseException | None:
        """On the way out of a failed run: let the background save finish (its file is then
        whole, not cut off by the process's exit). Returns its failure where that is the
        one to report instead of ``exc``: both are OS errors, as when the checkpoint's write
        filled the disk and the next small write (metrics.json) met it full. Else its failure
        is logged and ``exc`` is the run's."""
        try:
            self.wait_for_saves()
        except Exception as failed:
            if isinstance(exc, OSError) and isinstance(failed, OSError):
                return failed
            log.error("the checkpoint written in the background failed too: %s", failed)
        return None

    def _interrupt(self) -> None:
        """Stop on a signal: the callbacks learn of it on every rank (the checkpoint callback
        saves where the run is, unless it just did), and the run is interrupted."""
        name = self.agreement.signal.name
        self.callbacks.fire("on_exception", self, Interrupted(name))
        self.wait_for_saves()  # "checkpoint saved" below is then true
        self.state.status = "interrupted"
        if self.ctx.is_main:
            log.warning("%s: stopped at epoch %d, step %d; checkpoint saved",
                        name or "another rank got a stop signal", self.epoch, self.step)

    # ------------------------------------------------------------------ state
    def _load(self, path: Path, changes: Sequence[Mapping[str, Any]] = ()) -> None:
        applied = schema.load(self, path, changes)
        self.resumed = True
        if not self.ctx.is_main:
            return
        log.info("resumed from %s at epoch %d, batch %d, step %d", path, self.epoch, self.batch, self.step)
        for change in applied:
            log.info("resume: %s %s -> %s (applies from step %d)", change["key"],
                     shown(change["from"]), shown(change["to"]), change["step"])
        # Every resume's changes, this one's after the earlier ones' (a restart that applies
        # the same change again is listed once).
        earlier = read_metrics_or_empty(self.run_dir).get("resume_changes") or []
        self.resume_changes = [*earlier, *(c for c in applied if c not in earlier)]

    def _result(self) -> dict:
        return {
            "status": self.status,
            "epochs": self.epoch,
            "steps": self.step,
            "monitor": self.monitor,
            "monitor_mode": self.monitor_mode,
            "final": self.state.metrics,
            "best": {self.monitor: self.state.best.value, "epoch": self.state.best.epoch},
            "history": self.state.history,
            "world_size": self.ctx.world_size,
            # The loop's part; the run's parent adds the whole run's wall_time_s at its end.
            "train_time_s": round(time.time() - self.started, 3),
            **({"stopped_by": self.agreement.signal.name}
               if self.status == "interrupted" and self.agreement.signal else {}),
            **({"stop_reason": self.agreement.reason} if self.status in STOP_STATUSES else {}),
            **({"test": self.test_metrics} if self.test_metrics else {}),
            **({"resume_changes": self.resume_changes} if self.resume_changes else {}),
            **({"diverged_at_step": self.divergence.at["step"], "error": self.divergence_message()}
               if self.status == "diverged" and self.divergence.at is not None else {}),
        }
