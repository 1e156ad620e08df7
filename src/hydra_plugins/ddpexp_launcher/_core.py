"""The ddp launcher's work (Hydra's plugin discovery skips modules starting with ``_``)."""

import logging
from pathlib import Path
from typing import Any, List, Sequence

from hydra.core.utils import JobReturn, configure_log, filter_overrides, run_job, setup_globals
from omegaconf import open_dict

log = logging.getLogger(__name__)


def launch(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
    """Run the jobs one after the other in this process."""
    setup_globals()
    config = launcher.config
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    sweep_dir = Path(str(config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    log.info("Launching %d jobs locally", len(job_overrides))
    runs: List[JobReturn] = []
    for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
        log.info("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
        sweep_config = launcher.hydra_context.config_loader.load_sweep_config(config, list(overrides))
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = idx
            sweep_config.hydra.job.num = idx
        runs.append(run_job(hydra_context=launcher.hydra_context, task_function=launcher.task_function,
                            config=sweep_config, job_dir_key="hydra.sweep.dir",
                            job_subdir_key="hydra.sweep.subdir"))
        configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    return runs
