"""The launching side of a run: the fan-out of its workers (torch elastic, or one in-process
worker), what each worker process runs, SLURM steps, the stall watchdog, resources of the
machine, and what a failed run leaves behind and prints."""
