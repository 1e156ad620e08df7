"""ddpexp's Hydra launcher plugin: ``hydra/launcher=ddp``."""
