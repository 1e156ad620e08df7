"""``python -m ddpexp.find lr [find.KEY=VALUE ...] [overrides]``: choose before you sweep.

``lr`` runs the learning-rate range test (:mod:`ddpexp.modes.find_lr`) on the experiment the
overrides compose, as ``python -m ddpexp`` would train it (its world size, strategy, precision
and accumulation), in a run dir of its own (``outputs/find/<date>/<time>``, or
``hydra.run.dir=DIR``): ``find/lr.json``, ``find/lr.png`` and TensorBoard scalars. It prints
the suggested lr and a multirun command over ``optimizer.lr`` around it. Nothing of any other
run is read or written. docs/find.md has the keys.
"""

from __future__ import annotations

import logging
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddpexp.errors import ConfigError, DdpexpError

USAGE = ("usage: python -m ddpexp.find lr [find.lr_min=1e-6 find.lr_max=1 find.steps=100 "
         "find.smooth=0.98 find.stop_factor=4] [overrides ...]\n"
         "       python -m ddpexp.find batch [find.start=1 find.max_batch=4096 "
         "find.trial_steps=5] [overrides ...]")
KINDS = ("lr", "batch")
FIND_KEYS = {"lr": ("lr_min", "lr_max", "steps", "smooth", "stop_factor"),
             "batch": ("start", "max_batch", "trial_steps")}
INTEGER_KEYS = ("steps", "start", "max_batch", "trial_steps")


def split_args(kind: str, args: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """The ``find.*`` settings of ``args`` (typed as the mode's fields) and the rest, the
    experiment's overrides. A sweep, a resume and an unknown ``find.`` key are refused."""
    import difflib

    from omegaconf import OmegaConf

    settings: dict[str, Any] = {}
    rest: list[str] = []
    for arg in args:
        if arg in ("-m", "--multirun"):
            raise ConfigError("python -m ddpexp.find runs one search on one experiment, not a "
                              "sweep (-m): find the lr first, then sweep around it with the "
                              "command it prints")
        key, _, value = arg.partition("=")
        if key.lstrip("+").startswith("find."):
            name = key.lstrip("+")[len("find."):]
            if name not in FIND_KEYS[kind]:
                close = difflib.get_close_matches(name, FIND_KEYS[kind], n=1)
                hint = f"; did you mean find.{close[0]}?" if close else ""
                raise ConfigError(f"find.{name}: no such key of find {kind}{hint} (keys: "
                                  f"{', '.join('find.' + k for k in FIND_KEYS[kind])})")
            parsed = OmegaConf.from_dotlist([f"v={value}"]).v
            if not isinstance(parsed, (int, float)) or isinstance(parsed, bool):
                raise ConfigError(f"{arg}: find.{name} takes a number, not {value!r}")
            if name in INTEGER_KEYS and parsed != int(parsed):
                raise ConfigError(f"{arg}: find.{name} takes an integer, not {value!r}")
            settings[name] = int(parsed) if name in INTEGER_KEYS else float(parsed)
            continue
        if key.lstrip("+") in ("resume", "overwrite"):
            raise ConfigError(f"{arg}: a search starts from the experiment's initial weights in "
                              "a run dir of its own; it resumes nothing")
        rest.append(arg)
    return settings, rest


def find(kind: str, args: Sequence[str]) -> dict:
    """Compose the experiment of ``args``, run the ``kind`` search on it and return rank 0's
    result (with ``run_dir``)."""
    from ddpexp.config.cli import preflight
    from ddpexp.config.compose import composed
    from ddpexp.config.monitor import with_monitor
    from ddpexp.config.rundir import unique_dir
    from ddpexp.config.schema import to_plain, trainer_of
    from ddpexp.config.spec import RunSpec
    from ddpexp.launch.fanout import dispatch, plan_run, world_plan
    from ddpexp.launch.world import detect
    from ddpexp.modes.find_batch import FindBatch
    from ddpexp.modes.find_lr import FindLR

    settings, overrides = split_args(kind, args)
    mode = FindLR(**settings) if kind == "lr" else FindBatch(**settings)
    problem = preflight([o for o in overrides if not o.startswith("hydra.run.dir=")])
    if problem:
        raise ConfigError(problem)
    named = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra.run.dir=")]
    overrides = [o for o in overrides if not o.startswith("hydra.run.dir=")]
    cfg = composed(overrides)
    from omegaconf import open_dict

    with open_dict(cfg):
        cfg.pop("hydra", None)
    config = with_monitor(to_plain(cfg))
    stamp = time.strftime("%Y-%m-%d/%H-%M-%S")
    run_dir = Path(named[-1] if named else unique_dir(f"outputs/find/{stamp}")).absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    world = detect()  # torchrun, srun, mpirun, env://: the launcher's ranks are the world
    plan = world_plan(trainer_of(config), world) if world is not None \
        else plan_run(trainer_of(config))
    spec = RunSpec.build(config, plan, run_dir=run_dir, log_file=run_dir / "find.log",
                         mode=mode, origin={"argv": ["python", "-m", "ddpexp.find", kind, *args]})
    result = dispatch(spec)
    if result is None:
        raise ConfigError("the search ended without a result")
    return {**result, "run_dir": str(run_dir), "overrides": overrides,
            "world_size": plan.world_size, "kind": kind,
            "config_lr": (config.get("optimizer") or {}).get("lr"),
            "config_batch_size": (config.get("data") or {}).get("batch_size")}


def multirun_command(overrides: Sequence[str], lr: float) -> str:
    """A sweep over ``optimizer.lr`` around ``lr`` (a third of it to three times it) on the
    experiment of ``overrides``."""
    values = ",".join(f"{lr * k:.2g}" for k in (1 / 3, 1, 3))
    kept = [o for o in overrides if o.split("=", 1)[0] != "optimizer.lr"]
    return " ".join(["python -m ddpexp -m", *map(shlex.quote, kept), f"optimizer.lr={values}"])


def report(result: dict) -> str:
    """What the search found, for the terminal."""
    if result["kind"] == "batch":
        return report_batch(result)
    lines = [f"find lr: {len(result['lr'])} of {result['steps']} steps from "
             f"{result['lr_min']:g} to {result['lr_max']:g}"
             + (f" (stopped at step {result['stopped_at']}: the loss diverged)"
                if result.get("stopped_at") else "")
             + f", {result['world_size']} worker(s); {result['run_dir']}/find/lr.json, lr.png"]
    suggested = result.get("suggested_lr")
    if suggested is None:
        lines.append("no suggestion: the loss did not fall over the range; widen it "
                     "(find.lr_min, find.lr_max) or give more steps")
    else:
        lines.append(f"suggested lr: {suggested:.3g}")
        lines.append("sweep around it with:\n  " + multirun_command(result["overrides"], suggested))
    return "\n".join(lines)


def report_batch(result: dict) -> str:
    """What the batch search found, and the lr scaling it implies."""
    size = result["batch_size"]
    sizes = ", ".join(f"{t['batch_size']}{'' if t['fits'] else ' (out of memory)'}"
                      for t in result["tried"])
    lines = [f"find batch: tried {sizes}; {result['world_size']} worker(s); "
             f"{result['run_dir']}/find/batch.json",
             f"largest per-worker batch: data.batch_size={size} (limited by "
             f"{result['limited_by']})"]
    if result.get("knee") is not None:
        lines.append(f"throughput grows by under 5% past data.batch_size={result['knee']}")
    lr, base = result.get("config_lr"), result.get("config_batch_size")
    if isinstance(lr, (int, float)) and isinstance(base, int) and base > 0:
        ratio = size / base
        lines.append(f"rules of thumb for the lr at data.batch_size={size} (the config has "
                     f"optimizer.lr={lr:g} at {base}): linear optimizer.lr={lr * ratio:.3g}, "
                     f"square root optimizer.lr={lr * ratio ** 0.5:.3g}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ddpexp.find KIND [overrides]``; exit 1 with one message on bad input."""
    from ddpexp.config.cli import env_flag

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + (__doc__ or "\n\n").split("\n\n", 1)[1],
              file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    kind, rest = args[0], args[1:]
    if kind not in KINDS:
        print(f"error: python -m ddpexp.find {kind}: no such search (searches: "
              f"{', '.join(KINDS)})\n{USAGE}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    from ddpexp.launch.world import detect

    def search() -> int:
        try:
            result = find(kind, rest)
        except DdpexpError as exc:
            if env_flag("HYDRA_FULL_ERROR"):
                raise
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(report(result))
        return 0

    try:
        world = detect()
    except DdpexpError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if world is None:
        return search()
    # Another launcher started every rank: rank 0 composes the experiment and searches, the
    # others run on the spec it hands them (ddpexp.launch.ranks), in its run dir.
    from ddpexp.launch import ranks

    problem = ranks.fanout_keys_problem(rest, world)
    if problem:
        if world.rank == 0:
            print(f"error: {problem}", file=sys.stderr)
        return 1
    ranks.quiet_torch_warnings()
    try:
        step = ranks.current(world)
    except DdpexpError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if step.rank != 0:
        return ranks.follow(step)
    status = [1]
    ranks.lead(step, lambda: status.__setitem__(0, search()))
    return status[0]


if __name__ == "__main__":
    sys.exit(main())
