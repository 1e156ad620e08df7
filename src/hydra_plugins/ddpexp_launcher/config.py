"""The ``ddp`` launcher's config, registered under ``hydra/launcher``."""

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore


@dataclass
class DdpLauncherConf:
    """``hydra.launcher.*`` keys of the ddp launcher."""

    _target_: str = "hydra_plugins.ddpexp_launcher.ddp_launcher.DdpLauncher"
    # Sweep jobs at once. null: as many as the machine holds (a job takes trainer.gpus free
    # GPUs and a core per worker, while memory lasts); K: K jobs, each on its own equal
    # slice of the GPUs (or CPU cores).
    max_parallel: int | None = None
    # Stop launching new jobs after the first failure (the jobs already running finish).
    fail_fast: bool = False
    # GPUs the sweep may use (null = all visible); each job takes trainer.gpus of them.
    gpus: int | None = None
    # Wall-clock limit of one job in seconds (null = none); a job over it is stopped
    # (SIGTERM, so ddpexp checkpoints) and counts as failed.
    timeout_s: float | None = None
    # After SIGTERM (timeout, Ctrl-C, a scheduler's stop), how long a job may take to save
    # and exit before its whole process group is killed.
    kill_grace_s: float = 30.0
    # Fork each job from one process that has imported torch, Hydra and ddpexp (a job then
    # starts in a fraction of a second); false: every job is a fresh interpreter.
    fork: bool = True
    # Modules of your own that the fork server imports too (your model's library), so that
    # jobs do not import them each.
    preload: list[str] = field(default_factory=list)


ConfigStore.instance().store(group="hydra/launcher", name="ddp", node=DdpLauncherConf,
                             provider="ddpexp")


@dataclass
class RayLauncherConf:
    """``hydra.launcher.*`` keys of the ray launcher (``hydra/launcher=ray``)."""

    _target_: str = "hydra_plugins.ddpexp_launcher.ray_launcher.RayLauncher"
    # The Ray cluster: auto, HOST:PORT (the head's GCS port) or ray://HOST:PORT (Ray Client);
    # null: a Ray of this machine started for the sweep (2 CPUs) and stopped with it.
    address: str | None = None
    # Sweep jobs at once (null: as many as the cluster has room for; each job reserves a
    # CPU per worker and trainer.gpus GPUs on one node, or on each of trainer.nodes nodes).
    max_parallel: int | None = None
    # Stop launching new jobs after the first failure (the jobs already running finish).
    fail_fast: bool = False
    # Wall-clock limit of one job in seconds (null = none); a job over it is stopped
    # (SIGTERM, so ddpexp checkpoints) and counts as failed.
    timeout_s: float | None = None
    # After SIGTERM (timeout, Ctrl-C), how long a job may take to save and exit before its
    # processes are killed.
    kill_grace_s: float = 30.0
    # A job whose node dies is placed again up to this many times, and continues from its
    # last.pt (0: it fails, naming the node).
    retries: int = 0
    # Bytes of the object store of the Ray this sweep starts (address null; null: Ray's own
    # choice, 30% of the memory).
    object_store_memory: int | None = None


ConfigStore.instance().store(group="hydra/launcher", name="ray", node=RayLauncherConf,
                             provider="ddpexp")



# hydra/launcher=submitit_slurm with ddpexp's defaults for SLURM's pre-timeout signal: the
# submitit plugin's own schema, stored again under its name. SLURM sends SIGUSR2
# signal_delay_s before the time limit; ddpexp checkpoints and hands the signal to submitit,
# which requeues the job while max_num_timeout allows. submitit counts every such signal of a
# job under 10 minutes as a timeout, and with Hydra's 0 the sweep then ends in an
# UncompletedJobError. A checkpoint takes seconds, not the 120 s submitit leaves by default.
def store_slurm_defaults() -> None:
    """Store ddpexp's ``submitit_slurm`` defaults (nothing where submitit is not installed)."""
    try:
        from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
    except ImportError:
        return
    ConfigStore.instance().store(group="hydra/launcher", name="submitit_slurm",
                                 node=SlurmQueueConf(max_num_timeout=3, signal_delay_s=60),
                                 provider="submitit_launcher")


store_slurm_defaults()
