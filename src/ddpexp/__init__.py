"""ddpexp: Hydra-configured PyTorch experiments whose runs and sweep jobs are DDP runs."""

__version__ = "0.1.0"
