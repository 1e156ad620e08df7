"""ddpexp's asynchronous Optuna sweeper plugin: ``hydra/sweeper=optuna_async``."""
