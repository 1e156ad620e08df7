"""The training loop of one worker: train and validate each epoch, log, checkpoint, resume.

The loop knows no task: a :class:`ddpexp.task.Task` computes each batch's metrics, and the
trainer weights them by the batch's sample count, back-propagates ``loss``, and logs
``train/<name>`` and ``val/<name>`` for whatever names the task returns.

Every rank runs a :class:`Trainer`; only global rank 0 (``ctx.is_main``) writes TensorBoard,
checkpoints and ``metrics.json``. The hot path keeps metrics on the device and talks to the
other ranks only at log steps and epoch ends, so it costs what a hand-written DDP loop costs.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, Subset, default_collate

from ddpexp import checkpoint as ckpt_io
from ddpexp import models, pruning
from ddpexp.config import Strategy, TrainerConfig, trainer_config
from ddpexp.data import DataSource, ResumableDistributedSampler
from ddpexp.divergence import LossCeiling
from ddpexp.dist import DistContext, derive_seed, rng_state, seed_everything, set_rng_state
from ddpexp.ema import EMA
from ddpexp.errors import ConfigError
from ddpexp.record import write_metrics
from ddpexp.signals import StopRequested
from ddpexp.task import Task, as_task
from ddpexp.topk import TopK
from ddpexp.watchdog import (BACKWARD, CHECKPOINT, DATA, FORWARD, OPTIMIZER, VALIDATION,
                             heartbeat_from_env)

log = logging.getLogger("ddpexp")

# Training samples run through the task's checks before the first step.
PROBE_SAMPLES = 64
CHECKPOINT_FORMAT = 2
# Model keys that a data source may only know once it has read its files (the classes of an
# image folder, the vocabulary of a text): left null by the config, filled in after load().
_FROM_DATA = {"num_classes": "num_classes", "vocab_size": "num_classes"}


class Trainer:
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
        scheduler: Optional[Callable[..., Any]] = None,
        seed: int = 0,
        config: Optional[dict] = None,
        hparams: Optional[dict] = None,
    ):
        self.t, self.ctx, self.run_dir = cfg, ctx, Path(run_dir)
        # Where this rank is, for the launching process's stall watchdog (a no-op without one).
        self.beat = heartbeat_from_env(ctx.local_rank, ctx.restart, ctx.rank)
        self.task, self.data, self.seed = as_task(task), data, seed
        self.ceiling = LossCeiling(cfg.divergence_factor)  # its start is set by the probe
        self.config = config or {}
        self.hparams = hparams or {}
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.device = ctx.device
        self.monitor = cfg.monitor or self.task.monitor
        self.monitor_mode = cfg.monitor_mode.value if cfg.monitor_mode else self.task.monitor_mode
        self.stop = StopRequested()
        self.stopping = False  # the stop that all ranks agreed on
        # An optuna_async trial: rank 0 reports each validation, every rank follows its answer.
        self.prunable = pruning.in_trial()
        self.reporter = pruning.from_env() if ctx.is_main else None
        self.tb = None
        self.bar = None
        self.profiler = None  # rank 0 starts one in fit() when trainer.profile_steps is set
        if cfg.deterministic:
            # cuBLAS is deterministic only with a fixed workspace, chosen before its first use.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        self._build_loaders(datasets)
        self._place_model(model)
        # The probes run before DDP wraps the model: a model that falls back from
        # channels_last must have its final layout before DDP lays out its gradient buckets.
        self.val_names = self._check_task()
        self._wrap_model(model)
        self._build_optimization(optimizer, scheduler)
        # The average follows the unwrapped model's own tensors; DDP keeps them identical on
        # every rank, so every rank's average is identical without communication.
        self.ema = EMA(self.module, cfg.ema_decay) if cfg.ema_decay is not None else None
        self.top_k = TopK(cfg.save_top_k, self.monitor, self.monitor_mode) if cfg.save_top_k else None
        self._init_state()

    @classmethod
    def from_config(cls, config: dict, ctx: DistContext, run_dir: Path,
                    hparams: Optional[dict] = None) -> "Trainer":
        """Build task, data, model, optimizer and scheduler from a resolved config (plain
        Python, as workers receive it) and return the trainer."""
        from hydra.utils import instantiate

        data: DataSource = instantiate(config["data"], _convert_="all")
        datasets = data.load()
        if not isinstance(datasets, (tuple, list)) or len(datasets) not in (2, 3):
            raise ConfigError(
                f"data._target_={config['data']['_target_']}: load() must return (train, val) "
                "or (train, val, test) datasets"
            )
        _check_sample_shape(config["data"], datasets[0])
        if config["data"].get("num_classes") is None and getattr(data, "num_classes", None):
            config["data"]["num_classes"] = data.num_classes
        for key, attr in _FROM_DATA.items():
            if key in config["model"] and config["model"][key] is None:
                config["model"][key] = getattr(data, attr, None)
        task = instantiate(config["task"], _convert_="all")
        seed_everything(config["seed"])  # the same initial weights on every rank
        model = instantiate(config["model"], _convert_="all")
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model._target_ built a {type(model).__name__}, not a torch.nn.Module")
        sched_cfg = config.get("scheduler")
        return cls(
            trainer_config(config["trainer"]), ctx, run_dir,
            task=task, model=model, data=data, datasets=datasets,
            optimizer=instantiate(config["optimizer"]),
            scheduler=instantiate(sched_cfg) if sched_cfg and sched_cfg.get("_target_") else None,
            seed=config["seed"], config=config, hparams=hparams,
        )

    # ------------------------------------------------------------------ building
    def _build_loaders(self, datasets: Sequence[Dataset]) -> None:
        train_ds, self.val_ds = datasets[0], datasets[1]
        self.test_ds = datasets[2] if len(datasets) > 2 else None
        overfit = self.t.overfit_batches
        self.train_sampler = ResumableDistributedSampler(
            train_ds, num_replicas=self.ctx.world_size, rank=self.ctx.rank,
            shuffle=overfit is None, seed=self.seed, drop_last=False,
        )
        self.rank_seed = derive_seed(self.seed, self.ctx.rank)
        self.train_loader = self.data.loader(
            train_ds, self.train_sampler, seed=self.rank_seed,
            on_gpu=self.device.type == "cuda", train=True,
        )
        limit = overfit or self.t.limit_train_batches
        self.batches_per_epoch = len(self.train_loader) if limit is None else \
            min(limit, len(self.train_loader))
        self.rank_train_samples = min(len(self.train_sampler),
                                      self.batches_per_epoch * self.data.batch_size)
        if overfit is not None:
            # Unshuffled, rank r trains on indices r, r + world, ...: the first batches of all
            # ranks together are the dataset's first samples, which are validated on.
            trained = min(len(train_ds), overfit * self.data.batch_size * self.ctx.world_size)
            self.val_ds = Subset(train_ds, range(trained))
        self.val_loader = self.eval_loader(self.val_ds)

    def eval_loader(self, dataset: Dataset):
        """This rank's shard of ``dataset``, without padding, so that every sample counts
        exactly once whatever the world size."""
        shard = range(self.ctx.rank, len(dataset), self.ctx.world_size)
        loader = self.data.loader(dataset, list(shard), seed=self.rank_seed,
                                  on_gpu=self.device.type == "cuda", train=False)
        limit = self.t.limit_val_batches
        return loader if limit is None else FirstBatches(loader, limit)

    def _place_model(self, model: nn.Module) -> None:
        """The model on this rank's device, in its memory format, with its autocast dtype."""
        t = self.t
        if not any(p.requires_grad for p in model.parameters()):
            raise ConfigError(
                f"model._target_ built a {type(model).__name__} without trainable parameters: "
                "there is nothing to train. Give the model parameters (nn.Parameter, layers "
                "such as nn.Linear) that require grad"
            )
        channels_last = t.channels_last
        if channels_last is None:
            channels_last = _channels_last_pays(model, self.device, str(t.precision))
        # The probe batch (_check_batch) puts channels_last on trial where the default chose
        # it for a model not known to take it, and where it was asked for (so that a model
        # it breaks is told which key to change).
        self._layout_on_trial = bool(channels_last) and (
            t.channels_last is True or not models.channels_last_safe(model))
        self.memory_format = torch.channels_last if channels_last else torch.preserve_format
        model.to(self.device, memory_format=self.memory_format)
        self.module = model
        self.amp_dtype = {"bf16": torch.bfloat16, "16": torch.float16}.get(str(t.precision))

    def _wrap_model(self, model: nn.Module) -> None:
        t = self.t
        if t.sync_batchnorm:
            # torch's SyncBatchNorm has no CPU kernel (config.validate refuses CPU DDP with it);
            # one process has nothing to synchronise, so there it is ignored.
            if t.strategy is Strategy.ddp and self.device.type != "cpu":
                model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
            elif self.ctx.is_main:
                log.warning("trainer.sync_batchnorm ignored: one process (strategy=%s, %s) has "
                            "no BatchNorm statistics to synchronise", t.strategy.value, self.device.type)
        self.module = model
        if t.strategy is Strategy.ddp:
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [self.device.index] if self.device.type == "cuda" else None
            # Gradients as views into DDP's all-reduce buckets: no copy of every gradient
            # into its bucket and back each step (3-4% of a step of the overhead benchmark's
            # MLP on the CPU), and one copy of the gradients fewer in memory.
            self.model: nn.Module = DDP(model, device_ids=ids,
                                        find_unused_parameters=t.find_unused_parameters,
                                        gradient_as_bucket_view=True)
        elif t.strategy is Strategy.dp and torch.cuda.device_count() > 1:
            self.model = nn.DataParallel(model)
        else:
            self.model = model
        self.forward = torch.compile(self.model) if t.compile else self.model
        seed_everything(derive_seed(self.seed, self.ctx.rank, 1))  # per-rank stream

    def _build_optimization(self, optimizer: Callable, scheduler: Optional[Callable]) -> None:
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
        self.epoch, self.batch, self.step = 0, 0, 0
        self.best_value: Optional[float] = None
        self.best_epoch: Optional[int] = None
        self.bad_epochs = 0
        self.metrics: dict[str, float] = {}
        self.history: list[dict] = []
        self.status = "running"
        self.test_metrics: dict = {}  # test/<name> of best.pt and its epoch, once tested
        self.started = time.time()
        # Per-name sums (weighted by samples) of the training metrics not yet logged.
        self._train_names: Optional[list[str]] = None
        self._train_sums: Optional[torch.Tensor] = None
        self._seen = 0
        self._last_log_time = time.perf_counter()
        self._grad_norm: Optional[torch.Tensor] = None
        self._first_step_pending = True
        self.diverged: Optional[dict] = None  # {"step", "epoch", "loss"} once agreed
        self._last_saved_step: Optional[int] = None

    def _check_task(self) -> list[str]:
        """Run the task's validation step on two validation samples before training, so that
        a task, model and data that do not fit together, or a ``trainer.monitor`` the task
        does not return, fail in seconds with a message instead of after an epoch."""
        if len(self.val_ds) == 0:
            raise ConfigError("the validation split is empty; give the data a larger val share")
        self._check_batch()
        probe = self._to_device(default_collate([self.val_ds[i] for i in range(min(2, len(self.val_ds)))]))
        with torch.random.fork_rng(devices=[]), torch.no_grad(), self._autocast():
            self.module.eval()
            out = self.task.validation_step(self.module, probe)
        names = _metric_names(out, type(self.task).__name__, "validation_step")
        returned = [f"val/{n}" for n in names] + [f"val/{n}" for n in self.task.derived(
            {n: float(out[n]) for n in names})]
        if self.monitor not in returned:
            raise ConfigError(
                f"trainer.monitor={self.monitor} is not a metric of the task "
                f"({type(self.task).__name__}); it returns {', '.join(returned)}"
            )
        return names

    def _check_batch(self) -> None:
        """The task's own checks on a batch of the first training samples, and a model that
        cannot take the data's batches told as such, before the first step. A model on trial
        in channels_last that fails in it but not in its own layout falls back to that layout
        (trainer.channels_last=null, one warning) or is refused (=true, naming the key)."""
        n = min(PROBE_SAMPLES, len(self.train_sampler.dataset))
        dataset = self.train_sampler.dataset
        batch = default_collate([dataset[i] for i in range(n)])
        failure = None
        try:
            out = self._probe(batch)
        except Exception as exc:  # noqa: BLE001 - retried below, in the model's own layout
            if not self._layout_on_trial:
                raise
            failure = exc
        if failure is not None:  # outside the handler: a second failure is told on its own
            out = self._without_channels_last(batch, failure)
        _metric_names(out, type(self.task).__name__, "training_step")
        self.ceiling.set_start(float(out["loss"]))

    def _without_channels_last(self, batch: Any, failure: Exception) -> Mapping[str, torch.Tensor]:
        """The probe again in the model's own layout, after ``failure`` in channels_last:
        the model's own error if it fails again, else the layout falls back (null) or the
        run is refused (trainer.channels_last=true)."""
        self.memory_format = torch.preserve_format
        self.module.to(memory_format=torch.contiguous_format)
        out = self._probe(batch)
        reason = _first_line(failure.__cause__ or failure)
        name = type(self.module).__name__
        if self.t.channels_last:
            raise ConfigError(
                f"the model ({name}) fails on channels_last tensors ({reason}), which "
                "trainer.channels_last=true asks for; it works without. Set "
                "trainer.channels_last=false (or null), or reshape with x.reshape/x.flatten(1) "
                "instead of x.view in its forward"
            ) from failure
        if self.ctx.is_main:
            log.warning("the model (%s) fails on channels_last tensors (%s): trained in its own "
                        "memory format instead. trainer.channels_last=false skips this trial; "
                        "with x.reshape/x.flatten(1) instead of x.view in its forward, "
                        "trainer.channels_last=true gives the faster layout", name, reason)
        return out

    def _probe(self, batch: Any) -> Any:
        """The task's check and training step of ``batch`` with the initial weights, off the
        record (no grad, eval mode, the random streams restored); returns the step's metrics.
        An error of the model keeps its cause, so that HYDRA_FULL_ERROR=1 shows its line."""
        with torch.random.fork_rng(devices=[]), torch.no_grad(), self._autocast():
            probe = self._to_device(batch)
            self.module.eval()
            try:
                self.task.check(self.module, probe)
                return self.task.training_step(self.module, probe)
            except (RuntimeError, IndexError) as exc:
                raise ConfigError(
                    f"the model ({type(self.module).__name__}) cannot take a batch of the data "
                    f"with task {type(self.task).__name__}: {_first_line(exc)}. Check that "
                    "data.shape and data.num_classes match the data, and the model's keys "
                    "match both"
                ) from exc

    # ------------------------------------------------------------------ the run
    def fit(self, resume_from: Optional[Path] = None) -> dict:
        """Train to ``max_epochs``/``max_steps`` (or early stop, or a stop signal) and return
        the metrics that ``metrics.json`` holds."""
        if resume_from is not None:
            self._load(resume_from)
        if self.ctx.is_main:
            self._open_outputs(resumed=resume_from is not None)
        with debug_modes(self.t), contextlib.closing(self.beat):
            with self.stop:
                try:
                    self._loop()
                finally:
                    if self.bar is not None:
                        self.bar.close()
                    if self.profiler is not None:
                        self.profiler.close()
            if self.status == "running":
                self.status = "completed"
            if self.t.test and self.status in ("completed", "early_stopped"):
                self._test()  # still watched: the test of best.pt runs collectives too
        result = self._result()
        if self.ctx.is_main:
            write_metrics(self.run_dir, result)
            if self.tb is not None:
                self.tb.hparams_end(self.status)
                self.tb.close()
        return result

    def _loop(self) -> None:
        while self.epoch < self.t.max_epochs and not self._steps_done():
            epoch_start = time.perf_counter()
            complete = self._train_epoch()
            if self.diverged:
                self._diverge()
                return
            if self.stopping:
                self._interrupt()
                return
            val = self.evaluate(self.val_loader, "val")
            if self.diverged:  # a loss that diverged since the last log step
                self._diverge()
                return
            if self.stopping:  # a signal arrived during the last steps or the validation
                self._end_epoch(val, time.perf_counter() - epoch_start, complete)
                self._interrupt(saved=True)
                return
            self._end_epoch(val, time.perf_counter() - epoch_start, complete)
            if self.diverged:  # the weights themselves went non-finite
                self._diverge()
                return
            if self.status != "running":
                return

    def _steps_done(self) -> bool:
        return self.t.max_steps is not None and self.step >= self.t.max_steps

    def _train_epoch(self) -> bool:
        """One pass over this rank's shard from ``self.batch`` on; True if it reached the end.

        A stop signal is acted on only where all ranks agree on it (``self.stopping``, set at
        log steps and validation), so no rank leaves a collective the others are in."""
        self.model.train()
        bs, accumulate = self.data.batch_size, self.t.accumulate
        self.train_sampler.set_epoch(self.epoch, skip=self.batch * bs)
        generator = getattr(self.train_loader, "generator", None)
        if generator is not None:  # DataLoader workers' seeds: a function of (rank, epoch)
            generator.manual_seed(derive_seed(self.seed, self.ctx.rank, self.epoch, 2))
        if self.bar is not None:
            self.bar.reset(total=self.batches_per_epoch)
            self.bar.update(self.batch)
            self.bar.set_description(f"epoch {self.epoch}")
        group_end = 0
        # trainer.limit_train_batches / overfit_batches end the epoch early.
        batches = itertools.islice(self.train_loader, self.batches_per_epoch - self.batch)
        for i, batch in enumerate(self._fetching(batches), start=self.batch):
            if i >= group_end:  # the first micro-batch of an optimizer step
                group_end = min(i + accumulate, self.batches_per_epoch)
                group_samples = min(self.rank_train_samples - i * bs, (group_end - i) * bs)
            last_micro = i + 1 == group_end
            try:
                self._run_batch(batch, last_micro, group_samples)
            except RuntimeError as exc:
                if "find_unused_parameters" not in str(exc):
                    raise
                raise ConfigError(
                    "some of the model's parameters take no part in the loss, which DDP refuses "
                    "by default. Set trainer.find_unused_parameters=true (or use every "
                    "parameter in forward)"
                ) from exc
            if self.bar is not None:
                self.bar.update(1)
            if not last_micro:
                continue
            self.batch = i + 1
            log_now = (self.step + 1) % self.t.log_every_n_steps == 0
            self._optimizer_step(log_now)
            self.step += 1
            if self.profiler is not None:
                self.profiler.step()
            if self._first_step_pending:
                self._log_first_step()
            if log_now:
                self._log_step()  # also agrees on self.stopping and divergence across ranks
            elif self.ctx.world_size == 1 and self.stop:
                self.stopping = True  # nobody to agree with: stop at this step
            if self.stopping or self.diverged or self._steps_done():
                return self.batch >= self.batches_per_epoch
            every = self.t.ckpt_every_steps
            if every and self.step % every == 0 and self.batch < self.batches_per_epoch:
                self._reduce()  # agree on divergence first: never checkpoint NaN weights
                if self.diverged:
                    return False
                self._save(best=False)
        self.batch = self.batches_per_epoch
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
            yield batch

    def _autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def _to_device(self, batch: Any) -> Any:
        """``batch`` (tensors in any nesting of tuples, lists and dicts) on this rank's device;
        4-d float tensors in channels_last where asked."""
        if isinstance(batch, torch.Tensor):
            if self.device.type != "cpu":
                batch = batch.to(self.device, non_blocking=True)
            if self.memory_format is torch.channels_last and batch.dim() == 4 \
                    and batch.is_floating_point():
                batch = batch.contiguous(memory_format=torch.channels_last)
            return batch
        if isinstance(batch, Mapping):
            return type(batch)((k, self._to_device(v)) for k, v in batch.items())
        if isinstance(batch, (list, tuple)):
            moved = [self._to_device(v) for v in batch]
            return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
        return batch

    def _run_batch(self, batch: Any, last_micro: bool, group_samples: int) -> None:
        """Forward and backward of one micro-batch. The task's mean loss is weighted by the
        micro-batch's share of the optimizer step's samples, so that accumulating N batches
        of B gives the gradient of one batch of N*B (and an uneven last batch counts right)."""
        batch = self._to_device(batch)
        n = self.task.batch_size(batch)
        sync = last_micro or not isinstance(self.model, nn.parallel.DistributedDataParallel)
        with contextlib.nullcontext() if sync else self.model.no_sync():
            self.beat.mark(FORWARD, self.step)
            with self._autocast():
                out = self.task.training_step(self.forward, batch)
            self.beat.mark(BACKWARD, self.step)
            loss = out["loss"] if n == group_samples else out["loss"] * (n / group_samples)
            self.scaler.scale(loss).backward()
        self._accumulate(out, n)

    def _accumulate(self, out: Mapping[str, torch.Tensor], n: int) -> None:
        """Add ``n`` times each metric to the running sums, on the device (no host sync)."""
        if self._train_names is None:
            self._train_names = _metric_names(out, type(self.task).__name__, "training_step")
        if self._train_sums is None:
            self._train_sums = torch.zeros(len(self._train_names), dtype=torch.float64,
                                           device=self.device)
        values = torch.stack([out[k].detach().double() for k in self._train_names])
        self._train_sums.add_(values, alpha=n)
        self._seen += n

    def _optimizer_step(self, log_now: bool) -> None:
        self.beat.mark(OPTIMIZER, self.step)
        clip = self.t.grad_clip
        if clip is not None or log_now:
            self.scaler.unscale_(self.optimizer)
            if clip is not None:
                self._grad_norm = nn.utils.clip_grad_norm_(self.params, clip)
            else:
                grads = [p.grad for p in self.params if p.grad is not None]
                self._grad_norm = nn.utils.get_total_norm(grads) if grads else None
        self._step_lr = self.optimizer.param_groups[0]["lr"]  # logged: the lr this step used
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        if self.ema is not None:
            self.ema.update()

    def _log_first_step(self) -> None:
        """Record start-up cost once per session: ``time/first_step_s`` is the seconds from
        the end of the trainer's set-up (data, model, optimizer built) to the end of its
        first optimizer step; the event's wall time, when that step ended, is what
        scripts/bench.py reads."""
        self._first_step_pending = False
        if self.tb is not None:
            self.tb.scalars(self.step, {"time/first_step_s": time.time() - self.started})

    def _reduce(self, *values: torch.Tensor | float) -> list[float]:
        """Sum scalars over all ranks in one collective. The stop flag, the count of
        non-finite training metrics not yet logged and the training loss not yet logged ride
        along, so that all ranks agree on a stop or a divergence (a loss that is not finite,
        or past trainer.divergence_factor) where they already synchronise (log steps,
        validation)."""
        pending = self._train_sums if self._train_sums is not None else torch.zeros(1, device=self.device)
        nonfinite = (~torch.isfinite(pending)).sum()
        loss = pending[self._train_names.index("loss")] if self._train_sums is not None else 0.0
        parts = [torch.as_tensor(v, dtype=torch.float64, device=self.device).reshape(-1)
                 for v in (*values, nonfinite, loss, self._seen, float(bool(self.stop)))]
        stats = torch.cat(parts)
        if self.ctx.world_size > 1:
            dist.all_reduce(stats)
        *sums, nonfinite_count, loss_sum, seen, stop = stats.tolist()
        if stop:
            self.stopping = True
        if self.diverged is None:
            if nonfinite_count:
                self._note_divergence()
            elif seen and self.ceiling.exceeded(loss_sum / seen):
                self._note_divergence(loss_sum / seen)
        return sums

    def _means(self, names: list[str], sums: Sequence[float], count: float, prefix: str) -> dict[str, float]:
        """``prefix/name`` -> sum / count for each name, plus the task's derived metrics."""
        means = {n: s / max(count, 1) for n, s in zip(names, sums)}
        means.update(self.task.derived(means))
        return {f"{prefix}/{n}": v for n, v in means.items()}

    def _log_step(self) -> None:
        names = self._train_names or []
        sums = self._train_sums if self._train_sums is not None else torch.zeros(0)
        *totals, seen = self._reduce(sums, self._seen)
        now = time.perf_counter()
        rate = seen / max(now - self._last_log_time, 1e-9)
        self._last_log_time = now
        if self._train_sums is not None:
            self._train_sums.zero_()
        self._seen = 0
        if not self.ctx.is_main:
            return
        values = self._means(names, totals, seen, "train")
        values.update({"train/lr": self._step_lr, "train/samples_per_s": rate})
        if self._grad_norm is not None:
            values["train/grad_norm"] = float(self._grad_norm)
        if self.tb is not None:
            self.tb.scalars(self.step, values)
        if self.bar is not None and "train/loss" in values:
            self.bar.set_postfix(loss=f"{values['train/loss']:.4f}", refresh=False)

    def _note_divergence(self, exploded: Optional[float] = None) -> None:
        """Remember where the training loss diverged: ``exploded``, the agreed finite loss
        that rose past trainer.divergence_factor, or else where it stopped being finite
        (this rank's own value, or the other ranks' when only theirs went)."""
        loss = exploded
        if loss is None and self._train_sums is not None and "loss" in (self._train_names or []):
            own = float(self._train_sums[self._train_names.index("loss")])
            loss = None if math.isfinite(own) else own
        self.diverged = {"step": self.step, "epoch": self.epoch, "loss": loss}

    def _exploded(self) -> bool:
        """Whether the divergence is a finite loss past trainer.divergence_factor."""
        loss = (self.diverged or {}).get("loss")
        return loss is not None and math.isfinite(loss)

    def _diverge(self) -> None:
        """Stop a run whose training loss diverged; nothing is saved (last.pt and best.pt
        keep the weights from before)."""
        self.status = "diverged"
        if self.ctx.is_main:
            log.warning("epoch %d  step %d: the training loss %s; stopping", self.epoch, self.step,
                        "rose past trainer.divergence_factor times its start" if self._exploded()
                        else "is not finite")

    def divergence_message(self) -> str:
        """What happened and what to try, for the log and the run's failure."""
        d = self.diverged or {}
        what = {None: "NaN or infinite"}.get(d.get("loss"), str(d.get("loss")).replace("nan", "NaN"))
        why = ""
        if self._exploded():
            what = f"{d['loss']:.4g}"
            why = (f", over trainer.divergence_factor={self.ceiling.factor:g} times its start "
                   f"({self.ceiling.start:.4g})")
        lr = self.optimizer.param_groups[0]["lr"]
        kept = "the weights from before the rise" if self._exploded() else "the last finite weights"
        saved = (f"checkpoints/last.pt keeps {kept} (step {self._last_saved_step})"
                 if self._last_saved_step is not None else "no checkpoint had been written yet")
        fixes = f"a smaller optimizer.lr (the last step used {lr:g}) or trainer.grad_clip=1.0"
        if str(self.t.precision) != "32":
            fixes += ", or trainer.precision=32"
        return (
            f"training diverged: the training loss became {what} by step {d.get('step')} "
            f"(epoch {d.get('epoch')}){why}, so the run was stopped; {saved}. Try {fixes}"
        )

    def evaluate(self, loader: Any, prefix: str = "val") -> dict[str, float]:
        """The task's validation metrics over ``loader`` as ``prefix/<name>`` (see
        :meth:`_evaluate`), of the averaged weights when ``trainer.ema_decay`` is set."""
        with self.ema.applied() if self.ema is not None else contextlib.nullcontext():
            return self._evaluate(loader, prefix)

    @torch.no_grad()
    def _evaluate(self, loader: Any, prefix: str = "val") -> dict[str, float]:
        """The task's validation metrics over the whole dataset behind ``loader`` (this rank's
        shard of it, from :meth:`eval_loader`), each sample counted once across ranks, as
        ``prefix/<name>``. The unwrapped model is used, so no collective runs per batch."""
        self.beat.mark(VALIDATION, self.step)
        self._sync_buffers()
        self.module.eval()
        names = self.val_names
        sums = torch.zeros(len(names), dtype=torch.float64, device=self.device)
        count = 0
        for batch in loader:
            batch = self._to_device(batch)
            with self._autocast():
                out = self.task.validation_step(self.module, batch)
            n = self.task.batch_size(batch)
            sums.add_(torch.stack([out[k].detach().double() for k in names]), alpha=n)
            count += n
        *totals, count = self._reduce(sums, count)
        self.evaluated_samples = int(count)  # all ranks' (fewer than the split's with a limit)
        return self._means(names, totals, count, prefix)

    def _test(self) -> None:
        """Evaluate ``best.pt`` (the monitored best, not the last weights) on the test split:
        ``test/<name>`` in metrics.json, TensorBoard and the log."""
        if self.test_ds is None or len(self.test_ds) == 0:
            if self.ctx.is_main:
                log.info("no test split in data=%s: test skipped", type(self.data).__name__)
            return
        best = self.ckpt_dir / ckpt_io.BEST
        if self.ctx.is_main and not best.is_file():
            log.warning("%s does not exist: test skipped", best)
        # The trainer keeps its last weights after fit(); best.pt's are only borrowed.
        last = {k: v.to("cpu", copy=True) for k, v in self.module.state_dict().items()}
        result = self.evaluate_checkpoint(best, "test")
        self.module.load_state_dict(last)
        if result is None:
            return
        values = result["metrics"]
        self.test_metrics = {**values, "epoch": result["epoch"]}
        if self.ctx.is_main:
            if self.tb is not None:
                self.tb.scalars(self.step, values)
            shown = "  ".join(f"{k} {v:.4f}" for k, v in values.items())
            log.info("test (best.pt, epoch %d, %d samples)  %s", result["epoch"],
                     result["samples"], shown)

    def evaluate_checkpoint(self, path: Path, split: str = "test") -> Optional[dict]:
        """The task's metrics of checkpoint ``path``'s weights on ``split`` (``test`` or
        ``val``), with every rank, each sample counted once: ``{"metrics": {split/<name>:
        ..}, "epoch": the epoch those weights ended, "samples": n}``, or ``None`` where rank 0
        finds no such file. Rank 0 reads the file and broadcasts the weights, so ranks on
        other nodes need no shared file system. Every rank must call it."""
        dataset = {"test": self.test_ds, "val": self.val_ds}[split]
        if dataset is None or len(dataset) == 0:
            raise ConfigError(f"data={type(self.data).__name__} has no {split} split; "
                              "evaluate split=val, or give the data a test split")
        epoch = torch.tensor([-1], dtype=torch.long, device=self.device)
        if self.ctx.is_main and Path(path).is_file():
            state = ckpt_io.load(path, map_location=self.device)
            self.module.load_state_dict(state["model"])
            # The epoch whose weights these are: the last validated one when it was saved.
            history = state.get("history") or [{"epoch": max(0, state.get("epoch", 1) - 1)}]
            epoch.fill_(int(history[-1]["epoch"]))
        if self.ctx.world_size > 1:
            dist.broadcast(epoch, src=0)
            for tensor in self.module.state_dict().values():
                dist.broadcast(tensor, src=0)
        if int(epoch) < 0:
            return None
        # The weights just loaded are the ones to evaluate (with EMA, the averaged ones of
        # that checkpoint), not the run's current average.
        values = self._evaluate(self.eval_loader(dataset), split)
        return {"metrics": values, "epoch": int(epoch), "samples": self.evaluated_samples}

    def _sync_buffers(self) -> None:
        """Give every rank rank 0's buffers (BatchNorm statistics) before evaluating, so all
        ranks evaluate the weights that rank 0 saves."""
        if self.ctx.world_size > 1:
            for buf in self.module.buffers():
                dist.broadcast(buf, src=0)

    def _end_epoch(self, val: dict[str, float], epoch_time: float, complete: bool = True) -> None:
        """Record a validation, update best/early stopping, checkpoint. ``complete`` is False
        when max_steps ended the epoch part-way: the checkpoint then resumes mid-epoch."""
        self.metrics = val
        validated = self.epoch
        self.history.append({"epoch": self.epoch, "step": self.step, **val})
        improved = self._update_best(val)
        if self.ctx.is_main:
            if self.tb is not None:
                self.tb.scalars(self.step, {**val, "epoch/time_s": epoch_time, "epoch": self.epoch})
                self.tb.scalars(self.step, {f"best/{self.monitor}": self.best_value})
            shown = "  ".join(f"{k} {v:.4f}" for k, v in val.items())
            log.info("epoch %d  step %d  %s%s  (%.1fs)", self.epoch, self.step, shown,
                     "  *best*" if improved else "", epoch_time)
        if self.prunable and self._pruned(val):
            self.status = "pruned"
            if self.ctx.is_main:
                log.info("pruned by the search after epoch %d (%s %.4f)", self.epoch,
                         self.monitor, val[self.monitor])
        if complete:
            self.epoch += 1
            self.batch = 0
        patience = self.t.early_stop_patience
        if patience is not None and self.bad_epochs >= patience and self.status == "running":
            self.status = "early_stopped"
            if self.ctx.is_main:
                log.info("early stop: %s did not improve for %d epochs", self.monitor, patience)
        self._save(best=improved, ranked=(val[self.monitor], validated))
        if self.ctx.is_main:
            write_metrics(self.run_dir, self._result())

    def _pruned(self, val: dict[str, float]) -> bool:
        """Rank 0 reports the monitored value to the trial and asks its pruner; the answer
        reaches every rank in one small broadcast per epoch."""
        flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        if self.reporter is not None:
            flag[0] = int(self.reporter.should_prune(self.epoch, float(val[self.monitor])))
        if self.ctx.world_size > 1:
            dist.broadcast(flag, src=0)
        return bool(flag.item())

    def _update_best(self, val: dict[str, float]) -> bool:
        value = val[self.monitor]
        if not math.isfinite(value):
            self.bad_epochs += 1
            return False
        better = self.best_value is None or (
            value > self.best_value if self.monitor_mode == "max" else value < self.best_value
        )
        if better:
            self.best_value, self.best_epoch, self.bad_epochs = value, self.epoch, 0
        else:
            self.bad_epochs += 1
        return better

    def _interrupt(self, saved: bool = False) -> None:
        """Stop on a signal: checkpoint where we are (all ranks take part), mark interrupted."""
        if not saved:
            self._save(best=False)
        self.status = "interrupted"
        if self.ctx.is_main:
            name = self.stop.name or "a stop signal"
            log.warning("%s: stopped at epoch %d, step %d; checkpoint saved",
                        name if self.stop else "another rank got " + name, self.epoch, self.step)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Optional[dict]:
        """The checkpoint: what an exact resume needs. Every rank must call it (it gathers each
        rank's random state); global rank 0 gets the dict, the others ``None``. Schema::

            format       int, CHECKPOINT_FORMAT
            model        the unwrapped model's state_dict (no "module." prefixes); with
                         trainer.ema_decay, the averaged weights (what was validated)
            raw_model    with trainer.ema_decay only: the trained (not averaged) weights
            ema          with trainer.ema_decay only: {"decay", "updates"}
            top_k        with trainer.save_top_k only: the ranking, {"metric", "mode",
                         "kept": [{"name", "value", "epoch"}, ...]} best first
            optimizer    optimizer.state_dict()
            scheduler    scheduler.state_dict() or None
            scaler       GradScaler.state_dict() or None
            epoch        the epoch in progress (0-based) when saved
            batch        batches of that epoch already done (0 = at the epoch's start)
            step         optimizer steps done in all
            best         {"metric": name, "value": best value or None, "epoch": int or None}
            metrics      the latest validation metrics, e.g. {"val/loss": .., "val/acc": ..}
            history      [{epoch, step, val/...}, ...] of every validation so far
            early_stop   validations without improvement so far
            ranks        one entry per rank: {"rng": generator states (torch, cuda, numpy,
                         python), "train_accum": {"names", "sums", "seen"} not yet logged}
            world_size   the world size that wrote it (``ranks`` has one entry per rank)
            config       the resolved config of the run, plain Python
        """
        mine = {
            "rng": rng_state(),
            "train_accum": {
                "names": list(self._train_names or []),
                "sums": self._train_sums.tolist() if self._train_sums is not None else [],
                "seen": self._seen,
            },
        }
        ranks = [mine]
        if self.ctx.world_size > 1:
            ranks = [None] * self.ctx.world_size
            dist.all_gather_object(ranks, mine)
        if not self.ctx.is_main:
            return None
        return {
            "format": CHECKPOINT_FORMAT,
            "model": self.module.state_dict() if self.ema is None else self.ema.averaged(),
            **({} if self.ema is None else {
                "raw_model": self.module.state_dict(),
                "ema": {"decay": self.ema.decay, "updates": self.ema.updates},
            }),
            **({} if self.top_k is None else {"top_k": self.top_k.state_dict()}),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
            "epoch": self.epoch,
            "batch": self.batch,
            "step": self.step,
            "best": {"metric": self.monitor, "value": self.best_value, "epoch": self.best_epoch},
            "metrics": self.metrics,
            "history": self.history,
            "early_stop": self.bad_epochs,
            "ranks": ranks,
            "world_size": self.ctx.world_size,
            "config": self.config,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved. Random states and unlogged training sums
        are restored only when the world size is the same (else the run is not bit-exact,
        and a warning says so)."""
        self._load_weights(state)
        if self.top_k is not None:
            self.top_k.load_state_dict(state.get("top_k"))
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(_schedule_progress(state["scheduler"]))
        if state.get("scaler") is not None and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        self.epoch, self.batch, self.step = state["epoch"], state["batch"], state["step"]
        self.best_value, self.best_epoch = state["best"]["value"], state["best"]["epoch"]
        self.metrics, self.history = state["metrics"], list(state["history"])
        self.bad_epochs = state["early_stop"]
        ranks = state["ranks"]
        if state["world_size"] == self.ctx.world_size and len(ranks) == self.ctx.world_size:
            mine = ranks[self.ctx.rank]
            set_rng_state(mine["rng"])
            accum = mine["train_accum"]
            if accum["names"]:
                self._train_names = list(accum["names"])
                self._train_sums = torch.tensor(accum["sums"], dtype=torch.float64, device=self.device)
            self._seen = accum["seen"]
        elif self.ctx.is_main:
            log.warning(
                "checkpoint written by %d workers, resumed on %d: random streams start afresh, "
                "so the run is not bit-identical to an uninterrupted one",
                state["world_size"], self.ctx.world_size,
            )

    def _load_weights(self, state: dict) -> None:
        """The model's weights and, with trainer.ema_decay, the average. A checkpoint without
        an average (written without EMA) starts the average at its weights."""
        averaged = "raw_model" in state
        self.module.load_state_dict(state["raw_model" if averaged else "model"])
        if self.ema is None:
            if averaged and self.ctx.is_main:
                log.warning("the checkpoint holds an average of the weights (trainer.ema_decay="
                            "%s), this run has none: it continues the trained weights",
                            state["ema"]["decay"])
            return
        if averaged:
            self.ema.load_state_dict({"averaged": state["model"], "updates": state["ema"]["updates"]})
        else:
            self.ema = EMA(self.module, self.ema.decay)

    def _save(self, best: bool, ranked: Optional[tuple[float, int]] = None) -> None:
        """Every rank contributes its state; global rank 0 writes last.pt (and best.pt, and
        with trainer.save_top_k the file of a validation ``ranked`` = (value, epoch) that
        makes the top k). Files that fell out of the top k are deleted only once the new
        checkpoint is on disk. Non-finite weights are never written: every rank holds the same
        weights, so every rank reaches the same verdict without a collective, and the run
        stops as diverged."""
        self.beat.mark(CHECKPOINT, self.step)
        if not all(bool(torch.isfinite(p).all()) for p in self.module.parameters()):
            if self.diverged is None:
                self.diverged = {"step": self.step, "epoch": self.epoch, "loss": None}
            return
        entry, dropped = None, []
        if self.top_k is not None and ranked is not None:
            entry, dropped = self.top_k.offer(*ranked)  # before state_dict(), which holds it
        state = self.state_dict()
        self._last_saved_step = self.step
        if state is None:
            return
        last = self.ckpt_dir / ckpt_io.LAST
        ckpt_io.save_atomic(state, last)
        if best:
            ckpt_io.copy_atomic(last, self.ckpt_dir / ckpt_io.BEST)
        if entry is not None:
            ckpt_io.copy_atomic(last, self.ckpt_dir / entry)
        for name in dropped:
            (self.ckpt_dir / name).unlink(missing_ok=True)

    def _load(self, path: Path) -> None:
        state = ckpt_io.load(path, map_location=self.device)
        differs = _model_difference(self.module.state_dict(), state["model"])
        if differs:
            raise ConfigError(
                f"checkpoint {path} does not fit this run's model: {differs}. Resume with the "
                "model config the run was started with (its .hydra/config.yaml)"
            )
        try:
            self.load_state_dict(state)
        except (RuntimeError, KeyError, ValueError, TypeError) as exc:
            text = " ".join(str(exc).split())
            raise ConfigError(
                f"checkpoint {path} does not fit this run's model/optimizer ({text[:300]}); "
                "resume with the config the run was started with"
            ) from None
        self._last_saved_step = self.step
        if self.ctx.is_main:
            log.info("resumed from %s at epoch %d, batch %d, step %d", path, self.epoch, self.batch, self.step)

    # ------------------------------------------------------------------ outputs
    def _open_outputs(self, resumed: bool) -> None:
        from ddpexp.tb import TBLogger

        removed = ckpt_io.remove_stale_temporaries(self.ckpt_dir)
        if removed:
            log.info("removed %d stale checkpoint temporaries", len(removed))
        self.tb = TBLogger(self.run_dir / "tb", purge_step=self.step + 1 if resumed else None)
        if self.top_k is not None and resumed:
            strays = self.top_k.reconcile(self.ckpt_dir)
            if strays:
                log.warning("trainer.save_top_k: %s in %s are not in the resumed ranking and are "
                            "left alone", ", ".join(strays), self.ckpt_dir)
        if self.t.profile_steps is not None:
            from ddpexp.profiling import StepProfiler

            self.profiler = StepProfiler(self.t.profile_steps, self.run_dir, self.device.type)
        if not resumed:
            self.tb.config(self.config)
            self.tb.hparams_start(self.hparams)
        show = self.t.progress_bar
        if show is None:
            show = sys.stderr.isatty()
        if show:
            from tqdm import tqdm

            self.bar = tqdm(total=self.batches_per_epoch, leave=False, dynamic_ncols=True)

    def _result(self) -> dict:
        return {
            "status": self.status,
            "epochs": self.epoch,
            "steps": self.step,
            "monitor": self.monitor,
            "monitor_mode": self.monitor_mode,
            "final": self.metrics,
            "best": {self.monitor: self.best_value, "epoch": self.best_epoch},
            "history": self.history,
            "world_size": self.ctx.world_size,
            # The loop's part; the run's parent adds the whole run's wall_time_s at its end.
            "train_time_s": round(time.time() - self.started, 3),
            **({"stopped_by": self.stop.name} if self.status == "interrupted" and self.stop else {}),
            **({"test": self.test_metrics} if self.test_metrics else {}),
            **({"diverged_at_step": self.diverged["step"], "error": self.divergence_message()}
               if self.status == "diverged" and self.diverged else {}),
        }


def _model_difference(mine: Mapping[str, torch.Tensor], saved: Mapping[str, Any], show: int = 4) -> str:
    """How a checkpoint's weights differ from the model's: keys only one side has and
    tensors of other shapes (a few of each), or "" when they fit."""
    def some(names: list[str]) -> str:
        return ", ".join(names[:show]) + (f" and {len(names) - show} more" if len(names) > show else "")

    parts = []
    missing = [k for k in mine if k not in saved]
    extra = [k for k in saved if k not in mine]
    shapes = [f"{k} {list(saved[k].shape)} in the checkpoint vs {list(v.shape)} here"
              for k, v in mine.items()
              if k in saved and isinstance(saved[k], torch.Tensor) and saved[k].shape != v.shape]
    if missing:
        parts.append(f"the checkpoint lacks {some(missing)}")
    if extra:
        parts.append(f"the model has no {some(extra)}")
    if shapes:
        parts.append("shapes differ: " + some(shapes))
    return "; ".join(parts)


def _check_sample_shape(data_cfg: dict, train: Dataset) -> None:
    """``data.shape`` is what the models read their input size from: it must be the shape
    of the data's samples (where a sample is an (input tensor, target) pair)."""
    shape = data_cfg.get("shape")
    if not isinstance(shape, (list, tuple)) or len(train) == 0:
        return
    sample = train[0]
    if not (isinstance(sample, (tuple, list)) and sample and isinstance(sample[0], torch.Tensor)):
        return
    actual = list(sample[0].shape)
    if actual != list(shape):
        raise ConfigError(
            f"data.shape={list(shape)} but the samples of data {data_cfg.get('_target_')} have "
            f"shape {actual}; set data.shape={actual} (the models read their input size from it)"
        )


def _channels_last_pays(model: nn.Module, device: torch.device, precision: str) -> bool:
    """``trainer.channels_last=null``: channels_last where it was measured faster. On the CPU
    oneDNN's convolutions, batch norm and pooling run 1.2-1.9x faster on channels_last
    tensors (docs/benchmarks.md); on a GPU it pays with tensor-core precisions (bf16, 16).
    Only models with 2-d convolutions have anything to gain; for others (an MLP on images)
    reordering each batch would be a copy for nothing."""
    if not any(isinstance(m, nn.Conv2d) for m in model.modules()):
        return False
    return device.type == "cpu" or precision in ("bf16", "16")


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name if it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0].rstrip(".") if text else type(exc).__name__


def _metric_names(out: Any, task: str, method: str) -> list[str]:
    """The names of a task step's metrics, checked once: a dict of scalar tensors with
    ``loss`` among them."""
    if not isinstance(out, Mapping) or "loss" not in out:
        got = sorted(out) if isinstance(out, Mapping) else type(out).__name__
        raise ConfigError(
            f"task {task}: {method} must return a dict of scalar tensors with a 'loss' entry; "
            f"got {got}"
        )
    bad = [k for k, v in out.items() if not (isinstance(v, torch.Tensor) and v.numel() == 1)]
    if bad:
        raise ConfigError(
            f"task {task}: {method} returned non-scalar values for {', '.join(map(str, bad))}; "
            "each entry must be the mean over the batch's samples (a scalar tensor)"
        )
    return list(out)


class FirstBatches:
    """The first ``limit`` batches of each pass over ``loader`` (trainer.limit_val_batches)."""

    def __init__(self, loader: Any, limit: int):
        self.loader, self.limit = loader, limit

    def __iter__(self):
        return itertools.islice(iter(self.loader), self.limit)

    def __len__(self) -> int:
        return min(self.limit, len(self.loader))


@contextlib.contextmanager
def debug_modes(t: TrainerConfig):
    """trainer.detect_anomaly and trainer.deterministic for the length of a run; torch's
    previous settings come back afterwards (a run in a process of its caller's must not
    leave them on)."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    if t.deterministic:
        torch.use_deterministic_algorithms(True)
    try:
        with torch.autograd.set_detect_anomaly(True) if t.detect_anomaly else contextlib.nullcontext():
            yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic)


def _schedule_progress(state: dict) -> dict:
    """A scheduler state without LambdaLR's saved lr-multiplier attributes: the schedule's
    shape (total steps, warm-up) comes from this run's config, only its progress from the
    checkpoint. Otherwise a run first stopped by a smaller max_steps/max_epochs would keep
    that run's length after ``resume=`` extends it."""
    if "lr_lambdas" not in state:
        return state
    return {**state, "lr_lambdas": [None] * len(state["lr_lambdas"])}
