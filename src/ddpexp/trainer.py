"""The training loop of one worker: train and validate each epoch, log, checkpoint, resume.

Every rank runs a :class:`Trainer`; only global rank 0 (``ctx.is_main``) writes TensorBoard,
checkpoints and ``metrics.json``. The hot path keeps metrics on the device and talks to the
other ranks only at log steps and epoch ends, so it costs what a hand-written DDP loop costs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.utils import instantiate
from torch import nn

from ddpexp import checkpoint as ckpt_io
from ddpexp.data import DataSource, ResumableDistributedSampler
from ddpexp.dist import DistContext, derive_seed, seed_everything
from ddpexp.errors import ConfigError

log = logging.getLogger("ddpexp")

METRICS_FILE = "metrics.json"


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals that stop a run with a checkpoint: SIGTERM and SIGINT, plus the
    pre-timeout signal of a SLURM job (submitit's ``SUBMITIT_PREEMPT_SIGNAL``, SIGUSR2 by
    default), which only a SLURM or submitit job is sent."""
    sigs = [signal.SIGTERM, signal.SIGINT]
    if any(k.startswith("SUBMITIT_") for k in os.environ) or "SLURM_JOB_ID" in os.environ:
        name = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")
        preempt = getattr(signal, name if name.startswith("SIG") else "SIG" + name, None)
        if preempt is not None and preempt not in sigs:
            sigs.append(preempt)
    return tuple(sigs)


class StopRequested:
    """Turns the :func:`stop_signals` into a flag the loop checks at step boundaries.

    In a process of its own (no elastic agent) a second signal raises ``KeyboardInterrupt``
    at once, for a user who presses Ctrl-C twice. Under torch elastic a second one is
    ignored: Ctrl-C reaches a worker both from the terminal and forwarded by the agent, and
    the agent itself kills workers that overrun ``trainer.shutdown_grace_s``."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.escalate = "TORCHELASTIC_RUN_ID" not in os.environ
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopRequested":
        for sig in stop_signals():
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            if self.escalate:
                raise KeyboardInterrupt
            return
        self.signum = signum

    def __bool__(self) -> bool:
        return self.signum is not None


class Trainer:
    """Builds data, model, optimizer and scheduler from the resolved config, then ``fit()``."""

    def __init__(self, cfg: dict, ctx: DistContext, run_dir: Path, hparams: Optional[dict] = None):
        self.cfg, self.ctx, self.run_dir = cfg, ctx, Path(run_dir)
        self.t = cfg["trainer"]
        self.hparams = hparams or {}
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.device = ctx.device
        self.stop = StopRequested()
        self.stopping = False  # the stop that all ranks agreed on
        self.tb = None
        self.bar = None
        self._build_data()
        self._build_model()
        self._build_optimization()
        self._init_state()

    # ------------------------------------------------------------------ building
    def _build_data(self) -> None:
        self.data: DataSource = instantiate(self.cfg["data"], _convert_="all")
        train_ds, val_ds = self.data.load()[:2]
        if self.cfg["data"].get("num_classes") is None:
            self.cfg["data"]["num_classes"] = self.data.num_classes
        if self.cfg["model"].get("num_classes", 0) is None:
            self.cfg["model"]["num_classes"] = self.data.num_classes
        self.train_sampler = ResumableDistributedSampler(
            train_ds, num_replicas=self.ctx.world_size, rank=self.ctx.rank,
            shuffle=True, seed=self.cfg["seed"], drop_last=False,
        )
        on_gpu = self.device.type == "cuda"
        rank_seed = derive_seed(self.cfg["seed"], self.ctx.rank)
        self.train_loader = self.data.loader(
            train_ds, self.train_sampler, seed=rank_seed, on_gpu=on_gpu, train=True
        )
        # Validation is sharded without padding, so every sample counts exactly once.
        shard = range(self.ctx.rank, len(val_ds), self.ctx.world_size)
        self.val_loader = self.data.loader(
            val_ds, list(shard), seed=rank_seed, on_gpu=on_gpu, train=False
        )
        self.rank_train_samples = len(self.train_sampler)
        self.batches_per_epoch = len(self.train_loader)

    def _build_model(self) -> None:
        seed_everything(self.cfg["seed"])  # the same initial weights on every rank
        model: nn.Module = instantiate(self.cfg["model"], _convert_="all")
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model._target_ built a {type(model).__name__}, not a torch.nn.Module")
        self.memory_format = torch.channels_last if self.t["channels_last"] else torch.preserve_format
        model.to(self.device, memory_format=self.memory_format)
        strategy = self.t["strategy"]
        if self.t["sync_batchnorm"]:
            # torch's SyncBatchNorm has no CPU kernel (config.validate refuses CPU DDP with it);
            # one process has nothing to synchronise, so there it is ignored.
            if strategy == "ddp" and self.device.type != "cpu":
                model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
            elif self.ctx.is_main:
                log.warning("trainer.sync_batchnorm ignored: one process (strategy=%s, %s) has "
                            "no BatchNorm statistics to synchronise", strategy, self.device.type)
        self.module = model
        if strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.model: nn.Module = DDP(model, device_ids=ids)
        elif strategy == "dp" and torch.cuda.device_count() > 1:
            self.model = nn.DataParallel(model)
        else:
            self.model = model
        self.forward = torch.compile(self.model) if self.t["compile"] else self.model
        seed_everything(derive_seed(self.cfg["seed"], self.ctx.rank, 1))  # per-rank stream

    def _build_optimization(self) -> None:
        self.accumulate = self.t["accumulate"]
        opt_factory = instantiate(self.cfg["optimizer"])
        self.optimizer = opt_factory(self.module.parameters())
        steps_per_epoch = math.ceil(self.batches_per_epoch / self.accumulate)
        self.steps_per_epoch = max(1, steps_per_epoch)
        total = self.steps_per_epoch * self.t["max_epochs"]
        if self.t["max_steps"] is not None:
            total = min(total, self.t["max_steps"])
        self.total_steps = total
        sched_cfg = self.cfg.get("scheduler")
        self.scheduler = None
        if sched_cfg and sched_cfg.get("_target_"):
            factory = instantiate(sched_cfg)
            self.scheduler = factory(self.optimizer, total_steps=total,
                                     steps_per_epoch=self.steps_per_epoch)
        precision = str(self.t["precision"])
        self.amp_dtype = {"bf16": torch.bfloat16, "16": torch.float16}.get(precision)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=precision == "16")
        self.params = [p for p in self.module.parameters() if p.requires_grad]

    def _init_state(self) -> None:
        self.epoch, self.batch, self.step = 0, 0, 0
        self.best_value: Optional[float] = None
        self.best_epoch: Optional[int] = None
        self.bad_epochs = 0
        self.metrics: dict[str, float] = {}
        self.history: list[dict] = []
        self.status = "running"
        self.started = time.time()
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        self._loss_sum, self._correct, self._seen = zero.clone(), zero.clone(), 0
        self._last_log_time = time.perf_counter()
        self._grad_norm: Optional[torch.Tensor] = None
        self._first_step_pending = True

    # ------------------------------------------------------------------ the run
    def fit(self, resume_from: Optional[Path] = None) -> dict:
        """Train to ``max_epochs``/``max_steps`` (or early stop, or a stop signal) and return
        the metrics that ``metrics.json`` holds."""
        if resume_from is not None:
            self._load(resume_from)
        if self.ctx.is_main:
            self._open_outputs(resumed=resume_from is not None)
        with self.stop:
            try:
                self._loop()
            finally:
                if self.bar is not None:
                    self.bar.close()
        if self.status == "running":
            self.status = "completed"
        result = self._result()
        if self.ctx.is_main:
            self._write_metrics(result)
            if self.tb is not None:
                self.tb.hparams_end(self.status)
                self.tb.close()
        return result

    def _loop(self) -> None:
        while self.epoch < self.t["max_epochs"] and not self._steps_done():
            epoch_start = time.perf_counter()
            complete = self._train_epoch()
            if self.stopping:
                self._interrupt()
                return
            val = self._evaluate()
            if self.stopping:  # a signal arrived during the last steps or the validation
                self._end_epoch(val, time.perf_counter() - epoch_start, complete)
                self._interrupt(saved=True)
                return
            self._end_epoch(val, time.perf_counter() - epoch_start, complete)
            if self.status != "running":
                return

    def _steps_done(self) -> bool:
        return self.t["max_steps"] is not None and self.step >= self.t["max_steps"]

    def _train_epoch(self) -> bool:
        """One pass over this rank's shard from ``self.batch`` on; True if it reached the end.

        A stop signal is acted on only where all ranks agree on it (``self.stopping``, set at
        log steps and validation), so no rank leaves a collective the others are in."""
        self.model.train()
        bs = self.data.batch_size
        self.train_sampler.set_epoch(self.epoch, skip=self.batch * bs)
        generator = getattr(self.train_loader, "generator", None)
        if generator is not None:  # DataLoader workers' seeds: a function of (rank, epoch)
            generator.manual_seed(derive_seed(self.cfg["seed"], self.ctx.rank, self.epoch, 2))
        if self.bar is not None:
            self.bar.reset(total=self.batches_per_epoch)
            self.bar.update(self.batch)
            self.bar.set_description(f"epoch {self.epoch}")
        group_end = 0
        for i, (x, y) in enumerate(self.train_loader, start=self.batch):
            if i >= group_end:  # the first micro-batch of an optimizer step
                group_end = min(i + self.accumulate, self.batches_per_epoch)
                group_samples = min(self.rank_train_samples - i * bs, (group_end - i) * bs)
            last_micro = i + 1 == group_end
            self._run_batch(x, y, last_micro, group_samples)
            if self.bar is not None:
                self.bar.update(1)
            if not last_micro:
                continue
            self.batch = i + 1
            log_now = (self.step + 1) % self.t["log_every_n_steps"] == 0
            self._optimizer_step(log_now)
            self.step += 1
            if self._first_step_pending:
                self._log_first_step()
            if log_now:
                self._log_step()  # also agrees on self.stopping across ranks
            elif self.ctx.world_size == 1 and self.stop:
                self.stopping = True  # nobody to agree with: stop at this step
            if self.stopping or self._steps_done():
                return self.batch >= self.batches_per_epoch
            every = self.t["ckpt_every_steps"]
            if every and self.step % every == 0 and self.batch < self.batches_per_epoch:
                self._save(best=False)
        self.batch = self.batches_per_epoch
        return True

    def _autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def _to_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.device.type != "cpu":
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        if self.memory_format is torch.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y

    def _run_batch(self, x: torch.Tensor, y: torch.Tensor, last_micro: bool, group_samples: int) -> None:
        """Forward and backward of one micro-batch. The loss is the sum over the micro-batch
        divided by the samples of the whole optimizer step, so that accumulating N batches of
        B gives the gradient of one batch of N*B."""
        x, y = self._to_device(x, y)
        sync = last_micro or not isinstance(self.model, nn.parallel.DistributedDataParallel)
        with contextlib.nullcontext() if sync else self.model.no_sync():
            with self._autocast():
                out = self.forward(x)
                loss_sum = F.cross_entropy(out.float(), y, reduction="sum")
            self.scaler.scale(loss_sum / group_samples).backward()
        self._loss_sum += loss_sum.detach()
        self._correct += (out.detach().argmax(1) == y).sum()
        self._seen += len(y)

    def _optimizer_step(self, log_now: bool) -> None:
        clip = self.t["grad_clip"]
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

    def _log_first_step(self) -> None:
        """Record start-up cost once per session: ``time/first_step_s`` is the seconds from
        the end of the trainer's set-up (data, model, optimizer built) to the end of its
        first optimizer step; the event's wall time, when that step ended, is what
        scripts/bench.py reads."""
        self._first_step_pending = False
        if self.tb is not None:
            self.tb.scalars(self.step, {"time/first_step_s": time.time() - self.started})

    def _reduce(self, *values: torch.Tensor | float) -> list[float]:
        """Sum scalars over all ranks in one collective (the stop flag rides along)."""
        stats = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.device)
                             for v in (*values, float(bool(self.stop)))])
        if self.ctx.world_size > 1:
            dist.all_reduce(stats)
        *sums, stop = stats.tolist()
        if stop:
            self.stopping = True
        return sums

    def _log_step(self) -> None:
        loss_sum, correct, seen = self._reduce(self._loss_sum, self._correct, self._seen)
        now = time.perf_counter()
        rate = seen / max(now - self._last_log_time, 1e-9)
        self._last_log_time = now
        self._loss_sum.zero_()
        self._correct.zero_()
        self._seen = 0
        if not self.ctx.is_main:
            return
        values = {
            "train/loss": loss_sum / max(seen, 1),
            "train/acc": correct / max(seen, 1),
            "train/lr": self._step_lr,
            "train/samples_per_s": rate,
        }
        if self._grad_norm is not None:
            values["train/grad_norm"] = float(self._grad_norm)
        if self.tb is not None:
            self.tb.scalars(self.step, values)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{values['train/loss']:.4f}", refresh=False)

    @torch.no_grad()
    def _evaluate(self) -> dict[str, float]:
        """Loss and accuracy over the whole validation set, each sample counted once across
        ranks; the unwrapped model is used so no collective runs per batch."""
        self._sync_buffers()
        self.module.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        correct = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        for x, y in self.val_loader:
            x, y = self._to_device(x, y)
            with self._autocast():
                out = self.module(x)
            loss_sum += F.cross_entropy(out.float(), y, reduction="sum")
            correct += (out.argmax(1) == y).sum()
            count += len(y)
        loss_sum, correct, count = self._reduce(loss_sum, correct, count)
        count = max(count, 1)
        return {"val/loss": loss_sum / count, "val/acc": correct / count}

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
        self.history.append({"epoch": self.epoch, "step": self.step, **val})
        improved = self._update_best(val)
        if self.ctx.is_main:
            if self.tb is not None:
                self.tb.scalars(self.step, {**val, "epoch/time_s": epoch_time, "epoch": self.epoch})
                self.tb.scalars(self.step, {f"best/{self.t['monitor']}": self.best_value})
            log.info(
                "epoch %d  step %d  val/loss %.4f  val/acc %.4f%s  (%.1fs)",
                self.epoch, self.step, val["val/loss"], val["val/acc"],
                "  *best*" if improved else "", epoch_time,
            )
        if complete:
            self.epoch += 1
            self.batch = 0
        patience = self.t["early_stop_patience"]
        if patience is not None and self.bad_epochs >= patience:
            self.status = "early_stopped"
            if self.ctx.is_main:
                log.info("early stop: %s did not improve for %d epochs", self.t["monitor"], patience)
        self._save(best=improved)
        if self.ctx.is_main:
            self._write_metrics(self._result())

    def _update_best(self, val: dict[str, float]) -> bool:
        value = val[self.t["monitor"]]
        better = (
            self.best_value is None
            or (value > self.best_value if self.t["monitor_mode"] == "max" else value < self.best_value)
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
            name = signal.Signals(self.stop.signum).name if self.stop.signum else "a stop signal"
            log.warning("%s: stopped at epoch %d, step %d; checkpoint saved",
                        name if self.stop.signum else "another rank got " + name,
                        self.epoch, self.step)

    # ------------------------------------------------------------------ checkpoints
    def _save(self, best: bool) -> None:
        """Every rank contributes its RNG state; global rank 0 writes last.pt (and best.pt)."""
        mine = {
            "rng": ckpt_io.rng_state(),
            "train_accum": [float(self._loss_sum), float(self._correct), self._seen],
        }
        states = [mine]
        if self.ctx.world_size > 1:
            states = [None] * self.ctx.world_size
            dist.all_gather_object(states, mine)
        if not self.ctx.is_main:
            return
        state = ckpt_io.build(
            model=self.module.state_dict(),
            optimizer=self.optimizer.state_dict(),
            scheduler=self.scheduler.state_dict() if self.scheduler is not None else None,
            scaler=self.scaler.state_dict() if self.scaler.is_enabled() else None,
            epoch=self.epoch,
            batch=self.batch,
            step=self.step,
            best={"metric": self.t["monitor"], "value": self.best_value, "epoch": self.best_epoch},
            metrics=self.metrics,
            history=self.history,
            early_stop=self.bad_epochs,
            ranks=states,
            world_size=self.ctx.world_size,
            config=self.cfg,
        )
        last = self.ckpt_dir / ckpt_io.LAST
        ckpt_io.save_atomic(state, last)
        if best:
            ckpt_io.link_atomic(last, self.ckpt_dir / ckpt_io.BEST)

    def _load(self, path: Path) -> None:
        state = ckpt_io.load(path, map_location=self.device)
        try:
            self.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            if self.scheduler is not None and state.get("scheduler") is not None:
                self.scheduler.load_state_dict(_schedule_progress(state["scheduler"]))
            if state.get("scaler") is not None and self.scaler.is_enabled():
                self.scaler.load_state_dict(state["scaler"])
        except (RuntimeError, KeyError, ValueError) as exc:
            raise ConfigError(
                f"checkpoint {path} does not fit this run's model/optimizer ({str(exc).splitlines()[0]}); "
                "resume with the config the run was started with"
            ) from None
        self.epoch, self.batch, self.step = state["epoch"], state["batch"], state["step"]
        self.best_value, self.best_epoch = state["best"]["value"], state["best"]["epoch"]
        self.metrics, self.history = state["metrics"], list(state["history"])
        self.bad_epochs = state["early_stop"]
        ranks = state["ranks"]
        if state["world_size"] == self.ctx.world_size and len(ranks) == self.ctx.world_size:
            mine = ranks[self.ctx.rank]
            ckpt_io.set_rng_state(mine["rng"])
            loss_sum, correct, self._seen = mine["train_accum"]
            self._loss_sum.fill_(loss_sum)
            self._correct.fill_(correct)
        elif self.ctx.is_main:
            log.warning(
                "checkpoint written by %d workers, resumed on %d: random streams start afresh, "
                "so the run is not bit-identical to an uninterrupted one",
                state["world_size"], self.ctx.world_size,
            )
        if self.ctx.is_main:
            log.info("resumed from %s at epoch %d, batch %d, step %d", path, self.epoch, self.batch, self.step)

    # ------------------------------------------------------------------ outputs
    def _open_outputs(self, resumed: bool) -> None:
        from ddpexp.tb import TBLogger

        removed = ckpt_io.remove_stale_temporaries(self.ckpt_dir)
        if removed:
            log.info("removed %d stale checkpoint temporaries", len(removed))
        self.tb = TBLogger(self.run_dir / "tb", purge_step=self.step + 1 if resumed else None)
        if not resumed:
            self.tb.config(self.cfg)
            metric = self.t["monitor"]
            self.tb.hparams_start(self.hparams, ["val/acc", "val/loss", f"best/{metric}"])
        show = self.t["progress_bar"]
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
            "monitor": self.t["monitor"],
            "monitor_mode": self.t["monitor_mode"],
            "final": self.metrics,
            "best": {self.t["monitor"]: self.best_value, "epoch": self.best_epoch},
            "history": self.history,
            "world_size": self.ctx.world_size,
            "wall_time_s": round(time.time() - self.started, 3),
            **({"stopped_by": signal.Signals(self.stop.signum).name}
               if self.status == "interrupted" and self.stop.signum else {}),
        }

    def _write_metrics(self, result: dict) -> None:
        write_metrics(self.run_dir, result)


def _schedule_progress(state: dict) -> dict:
    """A scheduler state without LambdaLR's saved lr-multiplier attributes: the schedule's
    shape (total steps, warm-up) comes from this run's config, only its progress from the
    checkpoint. Otherwise a run first stopped by a smaller max_steps/max_epochs would keep
    that run's length after ``resume=`` extends it."""
    if "lr_lambdas" not in state:
        return state
    return {**state, "lr_lambdas": [None] * len(state["lr_lambdas"])}


def write_metrics(run_dir: Path, result: dict) -> None:
    """Atomically replace ``run_dir/metrics.json``."""
    path = Path(run_dir) / METRICS_FILE
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(result, indent=2, default=float) + "\n")
    os.replace(tmp, path)
