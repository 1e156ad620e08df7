"""What the launching process and its workers share, below both: who a process is in the run,
the process group's set-up and teardown, free ports and seeds (:mod:`.dist`), the signals that
stop a run with a checkpoint (:mod:`.signals`), a worker's heartbeat with the phases the stall
watchdog reads (:mod:`.heartbeat`), what makes a job an ``optuna_async`` trial: its
environment, the study's storage and the pruner (:mod:`.trial`), and the tag of a sweep job's
console lines (:mod:`.jobtag`). It imports no other ddpexp
package but the floors (errors), so that the parent side (``launch``, ``sweep``) and the
worker side (``training``, ``strategies``, ``callbacks``, ``loggers``, ``checkpoint``) both
stand on it and never on each other."""
