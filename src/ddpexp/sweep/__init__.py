"""Sweeps: the driver that takes a sweep's jobs from their overrides to the summary, the seam
to the engine that runs them (a backend), ddpexp's local backend (each job its own process on
its own slice of cores or GPUs), one job's process, the sweep summary, and the asynchronous
Optuna search's sweeper side (search space, study, pruner). The Hydra plugins under
``hydra_plugins/`` are thin shells over this package."""
