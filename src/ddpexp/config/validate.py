"""Checks of a composed config that its types cannot express; each failure names the
allowed values."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from ddpexp.config.schema import PRECISIONS
from ddpexp.errors import ConfigError


def validate(cfg: DictConfig, launched_elsewhere: bool = False) -> None:
    """Checks that the types alone cannot express; each failure names the allowed values.
    ``launched_elsewhere``: another launcher (torchrun, srun, mpirun) started the ranks and
    decides the nodes, so ddpexp's own rendezvous is not asked for (a ``trainer.nodes`` that
    disagrees with the launcher's is refused by ``launch.fanout.world_plan``)."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(
            "these keys need a value: " + ", ".join(missing)
            + " (e.g. data.root=/path/to/images for data=imagefolder)"
        )
    t = cfg.trainer
    if str(t.precision) not in PRECISIONS:
        raise ConfigError(
            f"trainer.precision={t.precision!r} is not one of {', '.join(PRECISIONS)}"
        )
    for key in ("gpus", "nodes", "accumulate", "tp", "max_epochs", "log_every_n_steps"):
        value = t[key]
        low = 0 if key == "gpus" else 1
        if value < low:
            raise ConfigError(f"trainer.{key}={value} must be >= {low}")
    if t.procs is not None and t.procs < 1:
        raise ConfigError(f"trainer.procs={t.procs} must be >= 1 (or null)")
    if t.max_steps is not None and t.max_steps < 1:
        raise ConfigError(f"trainer.max_steps={t.max_steps} must be >= 1 (or null)")
    for key in ("limit_train_batches", "limit_val_batches", "overfit_batches", "profile_steps",
                "save_top_k"):
        if t[key] is not None and t[key] < 1:
            raise ConfigError(f"trainer.{key}={t[key]} must be >= 1 (or null)")
    check_ema_decay(t.ema_decay)
    if t.max_restarts < 0:
        raise ConfigError(f"trainer.max_restarts={t.max_restarts} must be >= 0")
    if t.dist_timeout_s <= 0:
        raise ConfigError(f"trainer.dist_timeout_s={t.dist_timeout_s} must be > 0")
    _validate_ranges(cfg)
    if t.nodes > 1 and not t.rdzv_endpoint and not launched_elsewhere:
        raise ConfigError(
            f"trainer.nodes={t.nodes} needs trainer.rdzv_endpoint=HOST:PORT, the same on every "
            "node (HOST is the first node's address)"
        )
    if t.monitor is not None and not str(t.monitor).startswith("val/"):
        raise ConfigError(
            f"trainer.monitor={t.monitor!r}: the monitored metric is a validation metric, "
            "val/<name> for a name the task returns (e.g. val/loss)"
        )
    if str(t.precision) == "16" and t.gpus == 0:
        raise ConfigError(
            "trainer.precision=16 (fp16 with a gradient scaler) needs a GPU; "
            "on the CPU use trainer.precision=bf16"
        )
    if t.sync_batchnorm and t.gpus == 0 and (t.procs or 1) * t.nodes > 1:
        raise ConfigError(
            "trainer.sync_batchnorm=true needs GPUs: torch's SyncBatchNorm has no CPU kernel. "
            "On the CPU leave it off (each rank then keeps its own BatchNorm statistics; "
            "validation and checkpoints use rank 0's)"
        )
    for group in ("task", "model", "data", "optimizer"):
        node = cfg.get(group)
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise ConfigError(
                f"the {group} config has no _target_; pick one with {group}=NAME "
                f"or give a YAML with _target_"
            )


# (key, lowest allowed, whether the lowest is excluded, what the value means): values that
# the types accept but that cannot work.
_RANGES = (
    ("trainer.grad_clip", 0, True, "the max gradient norm; null turns clipping off"),
    ("trainer.early_stop_patience", 1, False, "validations without improvement; null = never stop"),
    ("trainer.ckpt_every_steps", 1, False, "optimizer steps between checkpoints; null = at epoch ends"),
    ("trainer.shutdown_grace_s", 0, False, "seconds to checkpoint after a stop signal"),
    ("trainer.rdzv_timeout_s", 0, True, "seconds the nodes wait for each other"),
    ("trainer.divergence_factor", 1, True,
     "how many times its start the training loss may rise to before the run counts as "
     "diverged; null = only a NaN or infinite loss"),
    ("seed", 0, False, "the base seed"),
    ("optimizer.lr", 0, False, "the learning rate"),
    ("data.num_workers", 0, False, "DataLoader worker processes per rank"),
)


def _validate_ranges(cfg: DictConfig) -> None:
    """Numbers out of range, and data keys the YAML leaves untyped (``data.batch_size=1.5``)."""
    for key, low, strict, meaning in _RANGES:
        value = OmegaConf.select(cfg, key, default=None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r} must be a number ({meaning})")
        if value < low or (strict and value == low):
            bound = f"> {low}" if strict else f">= {low}"
            raise ConfigError(f"{key}={value} must be {bound} ({meaning})")
    data = cfg.get("data")
    if not isinstance(data, DictConfig):
        return
    for key, low, nullable in (("batch_size", 1, False), ("prefetch_factor", 1, True)):
        if key not in data:
            continue
        value = data[key]
        if value is None and nullable:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"data.{key}={value!r} must be >= {low}, a whole number"
                              + (", or null" if nullable else ""))
    if data.get("prefetch_factor") is not None and not data.get("num_workers"):
        raise ConfigError(
            f"data.prefetch_factor={data.prefetch_factor} needs data.num_workers > 0 (it is "
            "how many batches each loader worker prepares ahead); set data.num_workers or "
            "leave data.prefetch_factor=null"
        )


def check_ema_decay(decay: float | None) -> None:
    """``trainer.ema_decay`` (the ema callback's ``decay``): in [0, 1), or None for off."""
    if decay is not None and not 0.0 <= float(decay) < 1.0:
        raise ConfigError(f"trainer.ema_decay={decay} must be in [0, 1) (e.g. 0.999), or null")
