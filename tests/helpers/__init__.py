"""Helpers shared by both layers of the suite (``from helpers import ...``):

- ``cli``: the real CLI, in a subprocess of its own session (``run_cli``, ``start_cli``,
  ``finish``) or, for one worker, in this process (``run_cli_in_process``, ``run_cli_here``),
  and what a run wrote (``run_dirs``, ``read_metrics``, ``read_scalars``);
- ``build``: the composed config and a one-process trainer built from it;
- ``files``: datasets in their real file formats;
- ``sweeps``: a sweep's summary table and its optuna study;
- ``tensors``: checkpoints compared tensor by tensor.
"""

from helpers.build import build_trainer, compose_config
from helpers.cli import (
                         FAST,
                         PLUGINS,
                         CliResult,
                         finish,
                         kill_session,
                         one_worker,
                         only_run_dir,
                         plugins_env,
                         read_metrics,
                         read_scalars,
                         run_cli,
                         run_cli_here,
                         run_cli_in_process,
                         run_dirs,
                         run_printed,
                         session_pids,
                         start_cli,
                         stop_session,
                         wait_for,
)
from helpers.files import (
                         TINY_GPT,
                         rows,
                         write_cifar10,
                         write_corpus,
                         write_idx,
                         write_imagefolder,
                         write_mnist,
                         write_parquet_rows,
                         write_shards,
)
from helpers.sweeps import journal_study, summary_by_job, sweep_cases
from helpers.tensors import assert_close_grads, assert_same_tensors

__all__ = [
    "FAST", "PLUGINS", "TINY_GPT", "CliResult", "assert_close_grads", "assert_same_tensors", "build_trainer",
    "compose_config", "finish", "journal_study", "kill_session", "one_worker", "only_run_dir",
    "plugins_env", "read_metrics", "read_scalars", "run_cli", "run_cli_here",
    "run_cli_in_process", "run_dirs", "run_printed", "session_pids", "start_cli",
    "stop_session", "summary_by_job", "sweep_cases", "wait_for", "write_cifar10", "write_corpus",
    "write_idx", "write_imagefolder", "write_mnist", "write_parquet_rows", "write_shards", "rows",
]
