"""``python -m ddpexp`` / ``ddpexp``: compose the config with Hydra and hand it to the fan-out."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omegaconf import DictConfig

# Hydra is imported when the command runs, not with this module: a sweep's fork server
# (ddpexp.sweep.forkserver.start_early) starts first, and imports torch meanwhile.


def task(cfg: "DictConfig") -> float | None:
    """Run one experiment (every job of a sweep calls this); returns the monitored metric
    so that sweepers (ddpexp's optuna_async, Hydra's) can optimise it."""
    import signal

    from ddpexp.launch.fanout import run

    # The run (or job) has begun: a Ctrl-C from here on is its guard's and its trainer's.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return run(cfg)


def main() -> None:
    """Hydra's main on :func:`task`: compose the config from the command line and run it,
    or the sweep it asks for."""
    import hydra

    from ddpexp.config.schema import register_configs

    register_configs()
    hydra.main(version_base="1.3", config_path="pkg://ddpexp.conf", config_name="config")(task)()


def cli() -> None:
    """Console entry point (``ddpexp`` and ``python -m ddpexp``)."""
    import sys

    from ddpexp.sweep import forkserver

    # First of all (it is the sweep's longest wait): a sweep's fork server, if it may fork.
    forkserver.start_early(sys.argv[1:])
    if not _full_error():
        # A Ctrl-C while Hydra composes the config must not land inside OmegaConf, whose
        # clean-up then fails with an error of its own: until the run begins (task()), it
        # ends the command at once.
        import signal

        signal.signal(signal.SIGINT, lambda *_: _stopped_before_the_run())
    try:
        _cli()
    except KeyboardInterrupt:
        forkserver.discard_early()
        _stopped_before_the_run()
    finally:
        forkserver.discard_early()  # the command did not sweep through ddpexp's launcher


def _stopped_before_the_run() -> None:
    """Ctrl-C while Python imports or Hydra composes the config, before a run began (a
    run's own Ctrl-C is its guard's, :func:`ddpexp.launch.failures.guard_run`): one line,
    exit status 130 (128 + SIGINT, as a shell reports it), and no run dir left behind.
    ``HYDRA_FULL_ERROR=1`` shows the traceback."""
    import os
    import signal
    import sys

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while this tidies up
    # Nothing is imported here: the Ctrl-C may have cut an import short (Hydra's, half
    # done, or the very module named here: then its functions may not be defined yet). A run
    # dir was claimed only if the module that claims them was loaded.
    drop_claims = getattr(sys.modules.get("ddpexp.config.rundir"), "drop_unstarted_claims", None)
    if drop_claims is not None:
        drop_claims()
    discard = getattr(sys.modules.get("ddpexp.sweep.forkserver"), "discard_early", None)
    if discard is not None:
        discard()
    if _full_error():
        raise KeyboardInterrupt
    print("stopped by SIGINT before the run started; nothing was saved", file=sys.stderr)
    sys.stderr.flush()
    # Not sys.exit: a Ctrl-C that cut into code an extension ran (PyRun_String) leaves the
    # interpreter set to end by SIGINT whatever status it is given.
    os._exit(130)


def _full_error() -> bool:
    """Whether ``HYDRA_FULL_ERROR`` asks for tracebacks."""
    import os

    return os.environ.get("HYDRA_FULL_ERROR", "").lower() not in ("", "0", "false", "no")


def _cli() -> None:
    import sys

    from ddpexp.errors import DdpexpError
    from ddpexp.launch.proc import exit_now
    from ddpexp.launch.world import detect
    from ddpexp.sweep import forkserver

    try:
        world = detect()
    except DdpexpError as exc:
        sys.exit(str(exc))
    if world is not None:
        forkserver.discard_early()  # every rank of another launcher's world runs one run
        # Another launcher (torchrun, mpirun, srun, env://) started every rank: rank 0 alone
        # reads the command line and runs Hydra; the other ranks run on the config it hands
        # them (ddpexp.launch.ranks).
        from ddpexp.launch import ranks

        problem = ranks.sweep_problem(sys.argv[1:], world) or ranks.fanout_keys_problem(
            sys.argv[1:], world)
        if problem:
            sys.exit(problem if world.rank == 0 else 1)  # said once, by rank 0
        ranks.quiet_torch_warnings()
        try:
            step = ranks.current(world)
        except DdpexpError as exc:
            sys.exit(str(exc))
        if step.rank != 0:
            exit_now(ranks.follow(step))
        earlier = step.earlier_run_dir()
        if earlier is not None:
            # A restart round of torchrun: continue the run the first round started.
            from ddpexp.config.commands import command_line_override

            kept = [a for a in sys.argv[1:]
                    if a.split("=", 1)[0].lstrip("+") not in ("hydra.run.dir", "resume")]
            sys.argv[1:] = [*kept, command_line_override("hydra.run.dir", earlier), "resume=auto"]
        ranks.lead(step, checked_main)
    else:
        checked_main()
    forkserver.discard_early()  # before the exit, which runs no finally
    exit_now(0)  # skips the 1-2 s interpreter teardown of a process that loaded torch


def checked_main() -> None:
    """The command line's checks that come before Hydra (:func:`ddpexp.config.cli.preflight`),
    then Hydra's main. A resume into a run dir composes on the overrides that run was started
    with (:func:`ddpexp.config.resume.with_recorded_overrides`)."""
    import sys

    from ddpexp.config.cli import preflight
    from ddpexp.config.resume import with_recorded_overrides

    sys.argv[1:] = with_recorded_overrides(sys.argv[1:])
    problem = preflight(sys.argv[1:])
    if problem:
        sys.exit(problem)  # exit status 1, the message on stderr
    main()  # a failure leaves through sys.exit inside Hydra, with its own exit code


if __name__ == "__main__":
    cli()
