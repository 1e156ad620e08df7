"""Benchmark ddpexp against a hand-written PyTorch DDP loop (scripts/plain_ddp.py).

Each case trains the same model on the same data with the same batch size, world size and
steps, once through the real CLI (``python -m ddpexp ...``) and once through the plain loop,
alternating which goes first, for ``--repeats`` rounds; the table quotes medians.

Runners: ``ddpexp`` (its defaults: in-memory data is batched by tensor indexing),
``ddpexp-dl`` (``data.fast_path=false``: the same DataLoader + DistributedSampler pipeline as
the plain loop, so the ratio isolates what the framework costs per step) and ``plain``.

Figures, per run:

- samples/s: steady-state global throughput measured inside rank 0, over the same window for
  both: from the end of optimizer step W (the warm-up, = ddpexp's ``log_every_n_steps``) to the
  end of the last step. ddpexp's comes from its ``train/samples_per_s`` TensorBoard scalars of
  the log steps after W (combined as total samples over total time); the plain loop times the
  same window itself and writes it to a JSON file.
- wall s: the whole command, from the launch to the exit of every process.
- peak MiB: the largest memory footprint of the command's process tree, as the sum of the
  processes' proportional set sizes (PSS, so shared libraries count once), sampled every 0.2 s.
- first step s: from the launch of the command to the end of the first optimizer step on
  rank 0 (ddpexp: the wall time of its ``time/first_step_s`` TensorBoard event).

Cases: ``overhead`` (small MLP, CIFAR-shaped synthetic data, 2 CPU workers, batch 32),
``compute`` (convnet, batch 64), ``startup`` (a 1-step run), ``sweep`` (a ``-m`` sweep of
short runs vs the sum of the same runs done one by one with the plain loop).

The ``search`` case (its own section below) runs the same trials of unequal length through
the asynchronous Optuna search (``hydra/sweeper=optuna_async``) and through Hydra's basic
sweeper in batches of ``max_parallel`` (how a batch sweeper such as hydra-optuna-sweeper with
``n_jobs = max_parallel`` launches them), and compares slot utilisation and wall time.

    python scripts/bench.py                 # all cases, 3 repeats
    python scripts/bench.py --quick         # a tiny case of each, 1 repeat (the test runs it)
    python scripts/bench.py --cases search  # the search case only (--quick: 4 short trials)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
PLAIN = ROOT / "scripts" / "plain_ddp.py"

# Targets of issue 8 (the ratio is ddpexp / plain for samples/s, plain / ddpexp is not used).
TARGETS = {"overhead": 0.97, "compute": 0.99}
STARTUP_SLACK_S = 1.5
SWEEP_MAX_RATIO = 1.15


@dataclass
class Case:
    """One training setup, run identically by both runners."""

    name: str
    model: str
    batch_size: int
    steps: int
    warmup: int  # = ddpexp's trainer.log_every_n_steps
    procs: int = 2
    shape: tuple = (3, 32, 32)
    jobs: int = 1  # > 1: a sweep of this many runs (seed=0..jobs-1)

    @property
    def num_samples(self) -> int:
        # One epoch holds every step, so no epoch boundary (validation, checkpoint) falls
        # inside the measured window.
        return self.steps * self.batch_size * self.procs

    def ddpexp_args(self, dataloader: bool = False) -> list[str]:
        # ++: set the key whether or not data/synthetic.yaml lists it.
        extra = ["++data.fast_path=false"] if dataloader else []
        return extra + [
            "data=synthetic", f"data.shape=[{','.join(map(str, self.shape))}]",
            f"data.num_samples={self.num_samples}", f"data.batch_size={self.batch_size}",
            f"model={self.model}", f"trainer.procs={self.procs}",
            f"trainer.max_steps={self.steps}", f"trainer.log_every_n_steps={self.warmup}",
            "trainer.progress_bar=false",
        ]

    def plain_args(self, seed: int = 0) -> list[str]:
        return [
            "--model", self.model, "--shape", *map(str, self.shape),
            "--num-samples", str(self.num_samples), "--batch-size", str(self.batch_size),
            "--procs", str(self.procs), "--steps", str(self.steps),
            "--warmup", str(self.warmup), "--seed", str(seed),
        ]


@dataclass
class Run:
    """What one command cost."""

    wall_s: float
    peak_mib: float
    samples_per_s: Optional[float] = None
    first_step_s: Optional[float] = None


@dataclass
class Results:
    runs: dict = field(default_factory=dict)  # (case, runner) -> [Run]

    def add(self, case: str, runner: str, run: Run) -> None:
        self.runs.setdefault((case, runner), []).append(run)

    def median(self, case: str, runner: str, attr: str) -> Optional[float]:
        values = [getattr(r, attr) for r in self.runs.get((case, runner), [])]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None


# ---------------------------------------------------------------------- running a command
def _session_pss(sid: int) -> int:
    """Proportional set size, in bytes, of every live process in session ``sid``: shared
    pages (torch's libraries, mapped by every worker) are split between the processes that
    map them, so the sum is the tree's real footprint, unlike a sum of RSS."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) != sid:
                continue
            with open(f"/proc/{entry.name}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except (OSError, IndexError, ValueError):
            continue
    return total


def run_command(cmd: list[str], cwd: Path, env: dict, timeout: float) -> tuple[float, float, float]:
    """Run ``cmd`` in its own session; return (launch time, wall s, peak tree PSS MiB).
    Fails loudly on a non-zero exit, a timeout, or a process left behind."""
    peak = [0]
    done = threading.Event()
    launched = time.time()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _session_pss(proc.pid))
            done.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        raise SystemExit(f"timed out after {timeout}s: {' '.join(cmd)}\n{out}")
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"exit {proc.returncode}: {' '.join(cmd)}\n{out}")
    return launched, wall, peak[0] / 2**20


# ---------------------------------------------------------------------- the two runners
def _scalars(tb_dir: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}


def steady_rate(events: list, warmup: int) -> Optional[float]:
    """Global samples/s over the log intervals after ``warmup``: each interval holds the same
    number of samples, so the total rate is the harmonic mean of the interval rates."""
    rates = [e.value for e in events if e.step > warmup]
    if not rates:
        return None
    return len(rates) / sum(1.0 / r for r in rates)


def run_ddpexp(case: Case, work: Path, env: dict, tag: str, timeout: float,
               dataloader: bool = False) -> Run:
    out = work / f"ddpexp{'-dl' if dataloader else ''}-{tag}"
    if case.jobs > 1:
        seeds = ",".join(str(i) for i in range(case.jobs))
        cmd = [sys.executable, "-m", "ddpexp", "-m", f"seed={seeds}", *case.ddpexp_args(dataloader),
               f"hydra.sweep.dir={out}"]
    else:
        cmd = [sys.executable, "-m", "ddpexp", *case.ddpexp_args(dataloader), f"hydra.run.dir={out}"]
    launched, wall, rss = run_command(cmd, work, env, timeout)
    run = Run(wall, rss)
    if case.jobs == 1:
        scalars = _scalars(out / "tb")
        run.samples_per_s = steady_rate(scalars.get("train/samples_per_s", []), case.warmup)
        first = scalars.get("time/first_step_s")
        run.first_step_s = first[0].wall_time - launched if first else None
    return run


def run_plain(case: Case, work: Path, env: dict, tag: str, timeout: float) -> Run:
    walls, rss, result = [], 0.0, {}
    launched = None
    for seed in range(case.jobs):  # a "sweep" of the plain loop: the runs one by one
        out = work / f"plain-{tag}-{seed}.json"
        cmd = [sys.executable, str(PLAIN), *case.plain_args(seed), "--out", str(out)]
        t0, wall, peak = run_command(cmd, work, env, timeout)
        launched = launched if launched is not None else t0
        walls.append(wall)
        rss = max(rss, peak)
        result = result or json.loads(out.read_text())
    run = Run(sum(walls), rss, result.get("samples_per_s"))
    if case.jobs == 1 and result.get("first_step_at") is not None:
        run.first_step_s = result["first_step_at"] - launched
    return run


# ddpexp with its default input pipeline (in-memory data batched by tensor indexing), and
# with data.fast_path=false: the same DataLoader + DistributedSampler pipeline as the plain
# loop, which isolates what the framework itself costs per step.
DL = "ddpexp-dl"


def runners_for(case: Case) -> list[str]:
    """Throughput cases compare both input pipelines; start-up and sweeps do not depend on it."""
    steady = case.jobs == 1 and case.steps > case.warmup
    return ["ddpexp", DL, "plain"] if steady else ["ddpexp", "plain"]


# ---------------------------------------------------------------------- the report
def _fmt(value: Optional[float], digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def table(cases: list[Case], res: Results, repeats: int) -> str:
    """A markdown table: one row per case and runner, medians of ``repeats`` runs."""
    lines = [
        f"medians of {repeats} run(s) each",
        "",
        "| case | runner | samples/s | ratio | wall s | peak MiB | first step s |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        for runner in runners_for(case):
            m = lambda attr: res.median(case.name, runner, attr)  # noqa: E731
            steady = case.jobs == 1 and case.steps > case.warmup
            ratio = "-"
            if runner != "plain" and (steady or case.jobs > 1):
                if case.jobs > 1:  # the sweep: wall time plain/ddpexp is not what is asked
                    pw = res.median(case.name, "plain", "wall_s")
                    ratio = f"{m('wall_s') / pw:.3f} (wall)" if pw else "n/a"
                else:
                    ps = res.median(case.name, "plain", "samples_per_s")
                    ds = m("samples_per_s")
                    ratio = _fmt(ds / ps if ds and ps else None, 3)
            rate = _fmt(m("samples_per_s"), 0) if steady else "-"
            first = "-" if case.jobs > 1 else _fmt(m("first_step_s"))
            label = f"{case.name} ({describe(case)})"
            lines.append(f"| {label} | {runner} | {rate} | {ratio} | {_fmt(m('wall_s'))} | "
                         f"{_fmt(m('peak_mib'), 0)} | {first} |")
    return "\n".join(lines)


def describe(case: Case) -> str:
    what = f"{case.model}, batch {case.batch_size}, {case.procs} procs, {case.steps} steps"
    return f"{case.jobs} runs of {what}" if case.jobs > 1 else what


def verdicts(cases: list[Case], res: Results) -> list[str]:
    """One line per target: the figure, the target, met or not."""
    out = []
    for case in cases:
        d = lambda attr: res.median(case.name, "ddpexp", attr)  # noqa: E731
        p = lambda attr: res.median(case.name, "plain", attr)  # noqa: E731
        dl = res.median(case.name, DL, "samples_per_s")
        if case.name in TARGETS and dl and p("samples_per_s"):
            ratio = dl / p("samples_per_s")
            goal = TARGETS[case.name]
            default = d("samples_per_s") / p("samples_per_s") if d("samples_per_s") else None
            out.append(f"{case.name}: samples/s ratio, same DataLoader pipeline, {ratio:.3f} "
                       f"(target >= {goal}): " + ("met" if ratio >= goal else "NOT met")
                       + f"; with ddpexp's default in-memory loader {_fmt(default, 3)}")
        elif case.name == "startup" and d("wall_s") and p("wall_s"):
            extra = d("wall_s") - p("wall_s")
            out.append(f"startup: 1-step wall time {extra:+.2f} s vs plain "
                       f"(target <= +{STARTUP_SLACK_S} s): "
                       + ("met" if extra <= STARTUP_SLACK_S else "NOT met"))
        elif case.jobs > 1 and d("wall_s") and p("wall_s"):
            ratio = d("wall_s") / p("wall_s")
            out.append(f"sweep: {case.jobs}-job sweep / sum of {case.jobs} plain runs = "
                       f"{ratio:.3f} (target <= {SWEEP_MAX_RATIO}): "
                       + ("met" if ratio <= SWEEP_MAX_RATIO else "NOT met"))
    return out


# ---------------------------------------------------------------------- the search case
SEARCH = "search"
# The launcher logs each job's end: "#<n> ended (<status>) after <seconds> s".
JOB_ENDED = re.compile(r"#(\d+) ended \((\w+)\) after ([\d.]+) s")


def search_trials(quick: bool) -> list[int]:
    """The trials, as ``trainer.max_epochs`` on the default digits data in batches of 16:
    lengths from a few seconds (mostly start-up) to many epochs, as a search's are."""
    return [1, 8, 1, 4] if quick else [1, 24, 2, 20, 1, 16, 3, 12]


def _busy_s(output: str, jobs: int) -> float:
    """Slot-seconds the sweep's jobs held (from each job's start to its end, as the launcher
    measured them), read from the launcher's log."""
    ended = {int(n): float(s) for n, status, s in JOB_ENDED.findall(output)}
    if len(ended) != jobs:
        raise SystemExit(f"expected {jobs} ended jobs in the sweep's log, found {sorted(ended)}")
    return sum(ended.values())


def _search_command(sweeper: str, epochs: list[int], slots: int, out: Path) -> list[str]:
    common = [sys.executable, "-m", "ddpexp", "-m", "data.batch_size=16",
              "trainer.log_every_n_steps=100000",
              "trainer.progress_bar=false", f"hydra.launcher.max_parallel={slots}",
              f"hydra.sweep.dir={out}"]
    if sweeper == "basic":
        return common + [f"hydra.sweeper.max_batch_size={slots}",
                         "trainer.max_epochs=" + ",".join(map(str, epochs))]
    # The study is created beforehand with these trials queued in order, so both sweepers
    # run the same trials in the same order.
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    out.mkdir(parents=True)
    study = optuna.create_study(study_name="ddpexp", direction="maximize", storage=JournalStorage(
        JournalFileBackend(str(out / "optuna.journal"))))
    for e in epochs:
        study.enqueue_trial({"trainer.max_epochs": e})
    space = "choice(" + ",".join(map(str, sorted(set(epochs)))) + ")"
    return common + ["hydra/sweeper=optuna_async", "resume=auto",
                     f"hydra.sweeper.n_trials={len(epochs)}", f"trainer.max_epochs={space}"]


def search_bench(quick: bool, repeats: int, env: dict, timeout: float, slots: int = 2) -> str:
    """The search case: the same trials through optuna_async and through Hydra's basic
    sweeper in batches of ``slots``; a markdown table of medians."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    epochs = search_trials(quick)
    # Per run: (utilisation, wall s, idle slot-seconds = slots x wall - busy).
    figures: dict[str, list[tuple[float, float, float]]] = {"optuna_async": [], "basic": []}
    with tempfile.TemporaryDirectory(prefix="ddpexp-bench-search-") as tmp:
        for r in range(repeats):
            order = list(figures) if r % 2 == 0 else list(figures)[::-1]
            for sweeper in order:
                out = Path(tmp) / f"{sweeper}-{r}"
                cmd = _search_command(sweeper, epochs, slots, out)
                proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True,
                                      timeout=timeout)
                if proc.returncode != 0:
                    raise SystemExit(f"exit {proc.returncode}: {' '.join(cmd)}\n"
                                     f"{proc.stdout}{proc.stderr}")
                wall = _sweep_wall_s(proc.stdout + proc.stderr)
                busy = _busy_s(proc.stdout + proc.stderr, len(epochs))
                figures[sweeper].append((busy / (slots * wall), wall, slots * wall - busy))
                print(f"[{r + 1}/{repeats}] search   {sweeper:12s} utilisation "
                      f"{busy / (slots * wall):.2f}  wall {wall:.1f}s  idle slot-s "
                      f"{slots * wall - busy:.1f}", file=sys.stderr, flush=True)
    lines = [f"search: {len(epochs)} trials of trainer.max_epochs {epochs} on digits (batch 16), "
             f"{slots} slots, medians of {repeats} run(s)", "",
             "| sweeper | slot utilisation | sweep wall s | idle slot-s |", "|---|---|---|---|"]
    for sweeper, runs in figures.items():
        label = "optuna_async" if sweeper != "basic" else \
            f"basic, batches of {slots} (as a batch sweeper launches)"
        med = [statistics.median(run[i] for run in runs) for i in range(3)]
        lines.append(f"| {label} | {med[0]:.2f} | {med[1]:.1f} | {med[2]:.1f} |")
    return "\n".join(lines)


LOG_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]\[HYDRA\]", re.M)


def _sweep_wall_s(output: str) -> float:
    """From the sweep's first launcher line to its last (the summary): the span in which
    trials could run, the same for both sweepers (Python and Hydra start-up excluded)."""
    from datetime import datetime

    stamps = [datetime.strptime(m, "%Y-%m-%d %H:%M:%S,%f") for m in LOG_STAMP.findall(output)]
    if len(stamps) < 2:
        raise SystemExit("the sweep's log holds no launcher lines")
    return (stamps[-1] - stamps[0]).total_seconds()


# ---------------------------------------------------------------------- main
def make_cases(quick: bool, only: Optional[list[str]]) -> list[Case]:
    if quick:
        # One worker each and tiny shapes: it checks that every figure comes out, cheaply.
        tiny = dict(procs=1, shape=(3, 8, 8))
        cases = [
            Case("overhead", "mlp", 32, steps=6, warmup=2, **tiny),
            Case("compute", "convnet", 64, steps=6, warmup=2, **tiny),
            Case("startup", "mlp", 32, steps=1, warmup=1, **tiny),
            Case("sweep", "mlp", 32, steps=2, warmup=1, jobs=2, **tiny),
        ]
    else:
        cases = [
            Case("overhead", "mlp", 32, steps=400, warmup=20),
            Case("compute", "convnet", 64, steps=100, warmup=20),
            Case("startup", "mlp", 32, steps=1, warmup=1),
            Case("sweep", "mlp", 32, steps=20, warmup=10, jobs=4),
        ]
    if only:
        unknown = set(only) - {c.name for c in cases}
        if unknown:
            raise SystemExit(f"unknown case(s) {sorted(unknown)}; choose from "
                             + ", ".join(c.name for c in cases))
        cases = [c for c in cases if c.name in only]
    return cases


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description="ddpexp vs a hand-written DDP loop")
    p.add_argument("--quick", action="store_true", help="tiny cases, 1 repeat (for the test)")
    p.add_argument("--repeats", type=int, default=None, help="rounds (default 3; 1 with --quick)")
    p.add_argument("--cases", nargs="+", default=None,
                   help="a subset of: overhead compute startup sweep search (--quick runs search "
                        "only when named)")
    p.add_argument("--json", default=None, help="also write every run's figures here")
    p.add_argument("--timeout", type=float, default=600, help="seconds per command")
    args = p.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    with_search = SEARCH in (args.cases or ([] if args.quick else [SEARCH]))
    others = [c for c in args.cases or [] if c != SEARCH]
    cases = make_cases(args.quick, others or None) if others or not args.cases else []

    env = dict(os.environ)
    # Benchmark this checkout, in the workers too, whatever is installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.pop("HYDRA_FULL_ERROR", None)
    res = Results()
    with tempfile.TemporaryDirectory(prefix="ddpexp-bench-") as tmp:
        work = Path(tmp)
        for r in range(repeats):
            for case in cases:
                # Rotate who goes first, so that a drift in machine load hits every runner.
                runners = runners_for(case)
                shift = r % len(runners)
                for runner in runners[shift:] + runners[:shift]:
                    tag = f"{case.name}-{r}"
                    if runner == "plain":
                        run = run_plain(case, work, env, tag, args.timeout)
                    else:
                        run = run_ddpexp(case, work, env, tag, args.timeout,
                                         dataloader=runner == DL)
                    res.add(case.name, runner, run)
                    print(f"[{r + 1}/{repeats}] {case.name:8s} {runner:9s} "
                          f"wall {run.wall_s:6.2f}s  samples/s {_fmt(run.samples_per_s, 0)}  "
                          f"first step {_fmt(run.first_step_s)}s  peak {run.peak_mib:.0f}MiB",
                          file=sys.stderr, flush=True)
    if cases:
        print(table(cases, res, repeats))
        print()
        for line in verdicts(cases, res):
            print(line)
    if with_search:
        print()
        print(search_bench(args.quick, repeats, env, args.timeout))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {f"{c}/{r}": [vars(x) for x in runs] for (c, r), runs in res.runs.items()}, indent=2))


if __name__ == "__main__":
    main()
