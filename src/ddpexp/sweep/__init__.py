"""Sweeps: the ddp launcher's pool of jobs (each its own process on its own slice of cores or
GPUs), one job's process, the sweep summary, and the asynchronous Optuna search's sweeper side
(search space, study, pruner). The Hydra plugins under ``hydra_plugins/`` are thin shells over
this package."""
