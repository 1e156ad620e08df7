"""``python -m ddpexp`` / ``ddpexp``: compose the config with Hydra and hand it to the fan-out."""

from typing import Optional

import hydra
from omegaconf import DictConfig

from ddpexp.config import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="pkg://ddpexp.conf", config_name="config")
def main(cfg: DictConfig) -> Optional[float]:
    """Run one experiment (every job of a sweep calls this); returns the monitored metric
    so that sweepers (ddpexp's optuna_async, Hydra's) can optimise it."""
    from ddpexp.launch import run

    return run(cfg)


def cli() -> None:
    """Console entry point (``ddpexp`` and ``python -m ddpexp``)."""
    import sys

    from ddpexp.config import preflight

    problem = preflight(sys.argv[1:])
    if problem:
        sys.exit(problem)  # exit status 1, the message on stderr
    main()  # a failure leaves through sys.exit inside Hydra, with its own exit code
    from ddpexp.proc import exit_now

    exit_now(0)  # skips the 1-2 s interpreter teardown of a process that loaded torch


if __name__ == "__main__":
    cli()
