"""Benchmark ddpexp against a PyTorch DDP loop as users write it (scripts/plain_ddp.py).

Each case trains the same model on the same data with the same batch size, world size and
steps, once through the real CLI (``python -m ddpexp ...``) and once through the plain loop,
alternating which goes first, for ``--repeats`` rounds; the table quotes medians and, beside
each figure, its ratio to the plain loop's from the same run of this script.

Runners: ``ddpexp`` (its defaults: in-memory data is batched by tensor indexing),
``ddpexp-dl`` (``data.fast_path=false``: the same DataLoader + DistributedSampler pipeline as
the plain loop, so the ratio isolates what the framework costs per step), ``plain``, and with
``--peers`` ``lightning`` (scripts/lightning_ddp.py: the same loop as a LightningModule on
Lightning's DDP strategy, where ``lightning`` or ``pytorch_lightning`` is importable).

Figures, per run:

- samples/s: steady-state global throughput measured inside rank 0, over the same window for
  all: from the end of optimizer step W (the warm-up, = ddpexp's ``log_every_n_steps``) to the
  end of the last step. ddpexp's comes from its ``train/samples_per_s`` TensorBoard scalars of
  the log steps after W (combined as total samples over total time); the plain loop and the
  Lightning script time the same window themselves and write it to a JSON file.
- wall s: the whole command, from the launch to the exit of every process (start-up, the
  end-of-run work and the interpreter exit included).
- max RSS MiB: the peak resident set of the command's largest process (the kernel's
  high-water mark, ``ru_maxrss`` of the waited-for process tree: exact, not sampled).
- first step s: from the launch of the command to the end of the first optimizer step on
  rank 0 (ddpexp: the wall time of its ``time/first_step_s`` TensorBoard event).

Cases: ``overhead`` (small MLP, CIFAR-shaped synthetic data, 2 CPU workers, batch 32),
``compute`` (convnet, batch 64), ``startup`` (a 20-step run on 40,000 samples: start-up, data,
exit and memory), ``sweep`` (a ``-m`` sweep of short runs vs the sum of the same runs done one by
one with the plain loop). ``--gpu``: one GPU, plain vs ddpexp (vs Lightning with ``--peers``),
fp32 and bf16, DDP on one rank (NCCL) and DataParallel, ``torch.compile`` on and off;
``--gpu --dry-run`` runs those cases tiny on the CPU, skipping ``torch.compile``.

The ``search`` case (its own section below) runs the same trials of unequal length through
the asynchronous Optuna search (``hydra/sweeper=optuna_async``) and through Hydra's basic
sweeper in batches of ``max_parallel`` (how a batch sweeper such as hydra-optuna-sweeper with
``n_jobs = max_parallel`` launches them), and compares slot utilisation and wall time.

    python scripts/bench.py                 # all CPU cases, 3 repeats
    python scripts/bench.py --quick         # a tiny case of each, 1 repeat (the test runs it)
    python scripts/bench.py --peers         # with Lightning, where it is installed
    python scripts/bench.py --gpu --peers   # the GPU cases (scripts/gpu_check.sh runs them)
    python scripts/bench.py --cases search  # the search case only (--quick: 4 short trials)
    python scripts/bench.py --cases save    # the loop's stall at a save, async_save on and off
    python scripts/bench.py --cases save-fsdp  # the same, fsdp over 2 workers only
    python scripts/bench.py --cases loggers # logger=tensorboard vs [tensorboard,mlflow], [..,wandb]
    python scripts/bench.py --cases launchers  # an 8-job sweep: ddp launcher vs Hydra's basic, joblib
    python scripts/bench.py --cases gaps       # slot gaps over 8 and 32 trials, slots busy in a search
    python scripts/bench.py --cases scale      # per-job cost of 8-, 32- and 64-job sweeps
    python scripts/bench.py --cases find       # a find lr step against a training step
    python scripts/bench.py --cases data       # streaming readers, and the loop fed by them
"""

from __future__ import annotations

import argparse
import csv
import functools
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLAIN = ROOT / "scripts" / "plain_ddp.py"
LIGHTNING = ROOT / "scripts" / "lightning_ddp.py"

# Targets: samples/s ratio ddpexp / plain; a single run's wall time at most this many seconds
# over the plain loop's; its largest process's peak RSS at most this ratio of the plain loop's.
TARGETS = {"overhead": 1.0, "compute": 1.0}
STARTUP_SLACK_S = 0.5
MEMORY_MAX_RATIO = 1.1
SWEEP_MAX_RATIO = 1.15


@dataclass
class Case:
    """One training setup, run identically by every runner."""

    name: str
    model: str
    batch_size: int
    steps: int
    warmup: int  # = ddpexp's trainer.log_every_n_steps
    procs: int = 2
    shape: tuple = (3, 32, 32)
    jobs: int = 1  # > 1: a sweep of this many runs (seed=0..jobs-1)
    samples: int | None = None  # None: exactly the samples the steps use
    device: str = "cpu"
    strategy: str = "ddp"  # ddp | dp (one process) | fsdp
    precision: str = "32"  # 32 | bf16
    compile: bool = False
    throughput: bool = True  # False: a run measured whole (wall, memory), not per step

    @property
    def num_samples(self) -> int:
        # By default one epoch holds every step, so no epoch boundary (validation,
        # checkpoint) falls inside the measured window.
        return self.samples or self.steps * self.batch_size * self.procs

    @property
    def steady(self) -> bool:
        """Whether the case measures steady-state throughput (steps after the warm-up)."""
        return self.throughput and self.jobs == 1 and self.steps > self.warmup

    def ddpexp_args(self, dataloader: bool = False) -> list[str]:
        # ++: set the key whether or not data/synthetic.yaml lists it.
        extra = ["++data.fast_path=false"] if dataloader else []
        if self.device == "cuda":
            extra += [f"trainer.gpus={self.procs}"]
        else:
            extra += [f"trainer.procs={self.procs}"]
        if self.device == "cuda" or self.strategy != "ddp" or self.procs == 1:
            # The strategy as asked: DDP even on one rank, or DataParallel.
            extra += [f"trainer.strategy={self.strategy}"]
        if self.precision != "32":
            extra += [f"trainer.precision={self.precision}"]
        if self.compile:
            extra += ["trainer.compile=true"]
        return extra + [
            "data=synthetic", f"data.shape=[{','.join(map(str, self.shape))}]",
            f"data.num_samples={self.num_samples}", f"data.batch_size={self.batch_size}",
            f"model={self.model}", f"trainer.max_steps={self.steps}",
            f"trainer.log_every_n_steps={self.warmup}", "trainer.progress_bar=false",
        ]

    def plain_args(self, seed: int = 0) -> list[str]:
        """Arguments of scripts/plain_ddp.py (and scripts/lightning_ddp.py, which shares them)."""
        return [
            "--model", self.model, "--shape", *map(str, self.shape),
            "--num-samples", str(self.num_samples), "--batch-size", str(self.batch_size),
            "--procs", str(self.procs), "--steps", str(self.steps),
            "--warmup", str(self.warmup), "--seed", str(seed), "--device", self.device,
            "--strategy", self.strategy, "--precision", self.precision,
            *(["--compile"] if self.compile else []),
        ]


@dataclass
class Run:
    """What one command cost."""

    wall_s: float
    max_rss_mib: float
    samples_per_s: float | None = None
    first_step_s: float | None = None


@dataclass
class Results:
    runs: dict = field(default_factory=dict)  # (case, runner) -> [Run]

    def add(self, case: str, runner: str, run: Run) -> None:
        self.runs.setdefault((case, runner), []).append(run)

    def median(self, case: str, runner: str, attr: str) -> float | None:
        values = [getattr(r, attr) for r in self.runs.get((case, runner), [])]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def paired(self, case: str, runner: str, attr: str) -> list[float]:
        """``runner``'s figure over the plain loop's from the same round, round by round:
        a drift of the machine between rounds cancels within each pair."""
        mine, theirs = self.runs.get((case, runner), []), self.runs.get((case, "plain"), [])
        # Every round runs every runner of a case once: the two lists pair up exactly.
        return [getattr(a, attr) / getattr(b, attr) for a, b in zip(mine, theirs, strict=True)
                if getattr(a, attr) and getattr(b, attr)]


# ---------------------------------------------------------------------- running a command
def run_command(cmd: list[str], cwd: Path, env: dict, timeout: float) -> tuple[float, float, float]:
    """Run ``cmd`` in its own session; return (launch time, wall s, max RSS MiB of its
    largest process). The RSS is the kernel's high-water mark over the process and every
    descendant it waited for (``wait4``'s ``ru_maxrss``). Fails loudly on a non-zero exit or
    a timeout."""
    with tempfile.TemporaryFile("w+") as log:
        launched = time.time()
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        deadline = start + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                os.killpg(proc.pid, 9)
                os.wait4(proc.pid, 0)
                proc.returncode = -9
                log.seek(0)
                raise SystemExit(f"timed out after {timeout}s: {' '.join(cmd)}\n{log.read()}")
            time.sleep(0.01)
        wall = time.perf_counter() - start
        # What the command left behind ends with it: joblib's loky workers outlive the sweep's
        # process by their idle timeout (300 s) and would hold the next run's cores.
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            log.seek(0)
            raise SystemExit(f"exit {proc.returncode}: {' '.join(cmd)}\n{log.read()}")
    return launched, wall, usage.ru_maxrss / 1024  # KiB on Linux


# ---------------------------------------------------------------------- the runners
def _scalars(tb_dir: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}


def steady_rate(events: list, warmup: int) -> float | None:
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


def run_plain(case: Case, work: Path, env: dict, tag: str, timeout: float,
              script: Path = PLAIN) -> Run:
    """The plain loop (or, with ``script=LIGHTNING``, the Lightning script): a "sweep" is
    its runs one by one, their wall times summed."""
    walls, rss, result = [], 0.0, {}
    launched = None
    for seed in range(case.jobs):
        out = work / f"{script.stem}-{tag}-{seed}.json"
        cmd = [sys.executable, str(script), *case.plain_args(seed), "--out", str(out)]
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
PEER = "lightning"


def lightning_installed() -> bool:
    """Whether the Lightning peer can run here (``lightning`` or ``pytorch_lightning``)."""
    return any(importlib.util.find_spec(m) is not None for m in ("lightning", "pytorch_lightning"))


def runners_for(case: Case, peers: bool = False, quick: bool = False) -> list[str]:
    """The throughput targets' cases compare both input pipelines (``quick``: the overhead
    case alone, where the pipeline matters most); the others do not depend on it. Lightning
    (a peer) runs single runs; it has no DataParallel (removed in 2.0)."""
    both = case.steady and case.name in TARGETS and not (quick and case.name != "overhead")
    runners = ["ddpexp", DL, "plain"] if both else ["ddpexp", "plain"]
    if peers and case.jobs == 1 and case.strategy == "ddp":
        runners.append(PEER)
    return runners


def run_one(runner: str, case: Case, work: Path, env: dict, tag: str, timeout: float) -> Run:
    """One command of ``runner`` on ``case``."""
    if runner == "plain":
        return run_plain(case, work, env, tag, timeout)
    if runner == PEER:
        return run_plain(case, work, env, tag, timeout, script=LIGHTNING)
    return run_ddpexp(case, work, env, tag, timeout, dataloader=runner == DL)


# ---------------------------------------------------------------------- the report
def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


COLUMNS = ["case", "runner", "samples/s", "speed ratio", "wall s", "wall ratio",
           "first step s", "max RSS MiB", "memory ratio"]


def table(cases: list[Case], res: Results, repeats: int, peers: bool = False) -> str:
    """A markdown table: one row per case and runner, medians of ``repeats`` runs, and each
    figure's ratio to the plain loop's (speed: higher is better; wall and memory: lower)."""
    lines = [
        f"medians of {repeats} run(s) each; ratios are runner / plain",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for case in cases:
        for runner in runners_for(case, peers):
            if res.runs.get((case.name, runner)):
                lines.append(_row(case, runner, res))
    return "\n".join(lines)


def _row(case: Case, runner: str, res: Results) -> str:
    """The table's row of one case and runner."""
    m = functools.partial(res.median, case.name, runner)
    p = functools.partial(res.median, case.name, "plain")

    def ratio(attr: str) -> str:
        if runner == "plain":
            return "-"
        mine, theirs = m(attr), p(attr)
        return _fmt(mine / theirs if mine and theirs else None, 3)

    rate = _fmt(m("samples_per_s"), 0) if case.steady else "-"
    first = "-" if case.jobs > 1 else _fmt(m("first_step_s"))
    label = f"{case.name} ({describe(case)})"
    return (f"| {label} | {runner} | {rate} | {ratio('samples_per_s') if case.steady else '-'} | "
            f"{_fmt(m('wall_s'))} | {ratio('wall_s')} | {first} | "
            f"{_fmt(m('max_rss_mib'), 0)} | {ratio('max_rss_mib')} |")


def describe(case: Case) -> str:
    what = f"{case.model}, batch {case.batch_size}, {case.procs} procs, {case.steps} steps"
    if case.samples:
        what += f", {case.samples} samples"
    if case.name.startswith("gpu"):
        what += f", {case.device} {case.strategy} {'bf16' if case.precision == 'bf16' else 'fp32'}"
        what += ", compiled" if case.compile else ""
    return f"{case.jobs} runs of {what}" if case.jobs > 1 else what


def verdicts(cases: list[Case], res: Results) -> list[str]:
    """One line per target: the figure, the target, met or not."""
    out = []
    for case in cases:
        d = functools.partial(res.median, case.name, "ddpexp")
        p = functools.partial(res.median, case.name, "plain")
        if case.name in TARGETS and d("samples_per_s") and p("samples_per_s"):
            ratio = d("samples_per_s") / p("samples_per_s")
            goal = TARGETS[case.name]
            dl = res.median(case.name, DL, "samples_per_s")
            pairs = res.paired(case.name, "ddpexp", "samples_per_s")
            out.append(f"{case.name}: samples/s ratio {ratio:.3f} (target >= {goal}): "
                       + ("met" if ratio >= goal else "NOT met")
                       + "; on the plain loop's DataLoader pipeline "
                       + _fmt(dl / p("samples_per_s") if dl else None, 3)
                       + f"; round by round {statistics.median(pairs):.3f} "
                       f"(median of {len(pairs)}, from {min(pairs):.3f} to {max(pairs):.3f})")
        elif case.name == "startup" and d("wall_s") and p("wall_s"):
            extra = d("wall_s") - p("wall_s")
            out.append(f"startup: {case.steps}-step wall time {extra:+.2f} s vs plain "
                       f"(target <= +{STARTUP_SLACK_S} s): "
                       + ("met" if extra <= STARTUP_SLACK_S else "NOT met"))
            mem = d("max_rss_mib") / p("max_rss_mib")
            out.append(f"memory: largest process {mem:.3f} x the plain loop's "
                       f"(target <= {MEMORY_MAX_RATIO}): "
                       + ("met" if mem <= MEMORY_MAX_RATIO else "NOT met"))
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


# ---------------------------------------------------------------------- the slot gaps case
GAPS = "gaps"
JOB_START = re.compile(r"^\[([^\]]+)\]\[HYDRA\]\s+#(\d+) : ", re.M)
JOB_END = re.compile(r"^\[([^\]]+)\]\[HYDRA\]\s+#(\d+) ended ", re.M)


def slot_gaps(output: str) -> list[float]:
    """Seconds from each job's end to the start of the next job after it, as the launcher
    logged both (the next start after an end is the freed slot's: the others are busy); an
    end that no start follows (the search's tail) counts none."""
    from datetime import datetime

    def stamp(text: str) -> float:
        return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()

    events = sorted([(m.start(), "start", stamp(m.group(1))) for m in JOB_START.finditer(output)]
                    + [(m.start(), "end", stamp(m.group(1))) for m in JOB_END.finditer(output)])
    gaps, ends = [], []
    for _, kind, at in events:
        if kind == "end":
            ends.append(at)
        elif ends:
            gaps.append(at - ends.pop(0))
    return gaps


_JOB_CLOCK = """
import json, time
from ddpexp import Callback

class JobClock(Callback):
    # The job's own clock (epoch seconds): trainer built, first step ended, fit ended.
    def setup(self, trainer):
        self.times = {"built": time.time()}

    def on_train_batch_end(self, trainer):
        self.times.setdefault("first", time.time())

    def on_fit_end(self, trainer, result):
        self.times["last"] = time.time()
        if trainer.is_main:
            (trainer.run_dir / "job_clock.json").write_text(json.dumps(self.times))
"""
JOB_CLOCK = ["+callbacks.jobclock._target_=bench_job_clock.JobClock"]


def with_job_clock(env: dict, where: Path) -> dict:
    """``env`` with the JobClock callback importable (a module written into ``where``)."""
    (where / "bench_job_clock.py").write_text(_JOB_CLOCK)
    return {**env, "PYTHONPATH": os.pathsep.join([str(where), env.get("PYTHONPATH", "")])}


def job_times(run_dir: Path) -> dict[str, float] | None:
    """When a sweep job did what, read from what it left in its run dir (epoch seconds):
    ``start`` (its process started: metrics.json's mtime less its wall_time_s), ``hydra``
    (Hydra's job set-up wrote .hydra/config.yaml), ``built`` (the trainer built: data, model,
    probe), ``first`` (its first optimizer step ended), ``last`` (its fit ended: the last
    result), the three from the JobClock callback's job_clock.json, and ``recorded`` (its
    parent wrote the final record, after every worker ended: metrics.json's mtime). None for
    a job that left no clock."""
    record = run_dir / "metrics.json"
    try:
        metrics = json.loads(record.read_text())
        clock = json.loads((run_dir / "job_clock.json").read_text())
    except (OSError, ValueError):
        return None
    recorded = record.stat().st_mtime
    return {"start": recorded - float(metrics["wall_time_s"]),
            "hydra": (run_dir / ".hydra" / "config.yaml").stat().st_mtime, **clock,
            "recorded": recorded, "job": float(run_dir.name) if run_dir.name.isdigit() else -1}


def between_jobs(run_dirs: Sequence[Path], slots: int,
                 ended: dict[int, float] | None = None) -> list[dict[str, float]]:
    """What each job after the first ``slots`` cost its slot between jobs, from the run dirs:
    from the ended job's last result to this job's first step (``total``), as ``teardown``
    (the last result to the ended job's final record: loggers closed, workers ended),
    ``handover`` (that record to this job's process start: the ended job's exit, the
    launcher seeing it, the fork), ``setup`` (process start to .hydra/config.yaml: Hydra's
    job set-up), ``build`` (to the trainer built: data, model, probe) and ``first_step``.
    A job's slot is that of the job that ended last before it started (the others were
    busy). ``ended``: when the launcher logged each job's end (by job number), which splits
    the hand-over into ``exit`` (the record to the launcher seeing the process end: the
    job's own teardown) and ``launch`` (from there to the next process start)."""
    jobs = sorted((t for t in map(job_times, run_dirs) if t is not None), key=lambda t: t["start"])
    free = sorted(jobs[:slots], key=lambda t: t["recorded"])
    out = []
    for job in jobs[slots:]:
        done = [t for t in free if t["recorded"] <= job["start"]] or free[:1]
        before = max(done, key=lambda t: t["recorded"])
        free.remove(before)
        free.append(job)
        out.append({"total": job["first"] - before["last"],
                    "teardown": before["recorded"] - before["last"],
                    "handover": job["start"] - before["recorded"],
                    "setup": job["hydra"] - job["start"], "build": job["built"] - job["hydra"],
                    "first_step": job["first"] - job["built"]})
        seen = (ended or {}).get(int(before["job"]))
        if seen is not None:
            out[-1].update(exit=seen - before["recorded"], launch=job["start"] - seen)
    return out


def between_table(name: str, parts: list[dict[str, float]], log_gaps: list[float]) -> list[str]:
    """One row of the between-jobs table: medians of each part, and the launcher-log gap."""
    def med(key: str) -> str:
        values = [p[key] for p in parts if key in p]
        return f"{statistics.median(values):.3f}" if values else "-"

    return [f"| {name} | {med('total')} | {max(p['total'] for p in parts):.3f} | "
            f"{med('teardown')} | {med('handover')} ({med('exit')} + {med('launch')}) | "
            f"{med('setup')} | {med('build')} | {med('first_step')} | "
            f"{f'{statistics.median(log_gaps):.3f}' if log_gaps else '-'} | {len(parts)} |"]


BETWEEN_HEADER = ["| sweep | last result to next first step, median s | largest s | fit end to "
                  "final record s | record to next process start s (job exit + launch) | "
                  "Hydra set-up s | build s | first step s | launcher-log gap s | gaps |",
                  "|---|---|---|---|---|---|---|---|---|---|"]


def job_ends(output: str) -> dict[int, float]:
    """When the launcher logged each job's end, by job number."""
    from datetime import datetime

    return {int(m.group(2)): datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            for m in JOB_END.finditer(output)}


def slot_busy(run_dirs: Sequence[Path], slots: int) -> dict[str, float]:
    """How busy a sweep kept its slots, from the run dirs: each slot from its first job's
    process start to its last job's final record, the share of that span its jobs spent in
    their training loops (``train``: trainer built to fit ended) and in their processes
    (``held``: process start to final record). A job's slot is that of the job that ended last
    before it started, as in :func:`between_jobs`; a slot that has no job left to run is not
    counted idle after its last one (the sweep's tail)."""
    jobs = sorted((t for t in map(job_times, run_dirs) if t is not None), key=lambda t: t["start"])
    lanes = [[job] for job in jobs[:slots]]
    for job in jobs[slots:]:
        done = [lane for lane in lanes if lane[-1]["recorded"] <= job["start"]] or lanes[:1]
        max(done, key=lambda lane: lane[-1]["recorded"]).append(job)
    span = sum(lane[-1]["recorded"] - lane[0]["start"] for lane in lanes)
    return {"train": sum(t["last"] - t["built"] for t in jobs) / span,
            "held": sum(t["recorded"] - t["start"] for t in jobs) / span,
            "train_s": statistics.median(t["last"] - t["built"] for t in jobs)}


def busy_search(quick: bool, repeats: int, env: dict, timeout: float, slots: int = 2) -> list[str]:
    """An optuna_async search of trials of about 0.6 to 2 s of training (digits in batches of
    64 for 6 to 18 epochs): how busy it keeps its ``slots`` slots (:func:`slot_busy`)."""
    n, epochs = (4, "choice(2,4)") if quick else (8, "choice(6,10,14,18)")
    lines = ["", f"busy: optuna_async, {n} trials of trainer.max_epochs={epochs} (digits, batch "
             f"64), {slots} slots, {repeats} run(s)", "",
             "| run | median training s | slots busy training | slots busy in a job process | "
             "last result to next first step, median s | Hydra set-up s | build s |",
             "|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="ddpexp-bench-busy-") as tmp:
        for r in range(repeats):
            out = Path(tmp) / f"busy-{r}"
            cmd = [sys.executable, "-m", "ddpexp", "-m", "hydra/sweeper=optuna_async", *JOB_CLOCK,
                   f"hydra.sweeper.n_trials={n}", "hydra.sweeper.sampler.name=random",
                   f"hydra.sweeper.sampler.seed={r}", f"hydra.launcher.max_parallel={slots}",
                   "optimizer.lr=choice(0.01,0.03,0.1)", f"trainer.max_epochs={epochs}",
                   "data.batch_size=64", "trainer.test=false", "trainer.progress_bar=false",
                   f"hydra.sweep.dir={out}"]
            run_command(cmd, Path(tmp), with_job_clock(env, Path(tmp)), timeout)
            dirs = [d.parent.parent for d in out.glob("*/.hydra/config.yaml")]
            busy, parts = slot_busy(dirs, slots), between_jobs(dirs, slots)
            total, setup, build = (statistics.median(p[key] for p in parts)
                                   for key in ("total", "setup", "build"))
            lines.append(f"| {r + 1} | {busy['train_s']:.2f} | {busy['train']:.3f} | "
                         f"{busy['held']:.3f} | {total:.3f} | {setup:.3f} | {build:.3f} |")
            print(f"[{r + 1}/{repeats}] busy     training {busy['train']:.3f}  held "
                  f"{busy['held']:.3f}", file=sys.stderr, flush=True)
    return lines


def gaps_bench(quick: bool, repeats: int, env: dict, timeout: float, slots: int = 2) -> str:
    """The search's slot gaps: optuna_async searches of one-epoch trials (random sampler over
    lr and batch size, the default digits data) of 8 and of 32 trials on ``slots`` slots; the
    median and the largest gap from a trial's end to the next trial's start."""
    sizes = [4] if quick else [8, 32]
    lines = [f"gaps: optuna_async, one-epoch trials on digits, {slots} slots, {repeats} run(s)",
             "", "| trials | median gap s | largest gap s | gaps |", "|---|---|---|---|"]
    between = [""] + BETWEEN_HEADER
    with tempfile.TemporaryDirectory(prefix="ddpexp-bench-gaps-") as tmp:
        for n in sizes:
            gaps: list[float] = []
            parts: list[dict[str, float]] = []
            for r in range(repeats):
                out = Path(tmp) / f"{n}-{r}"
                cmd = [sys.executable, "-m", "ddpexp", "-m", "hydra/sweeper=optuna_async", *JOB_CLOCK,
                       f"hydra.sweeper.n_trials={n}", "hydra.sweeper.sampler.name=random",
                       f"hydra.sweeper.sampler.seed={r}", f"hydra.launcher.max_parallel={slots}",
                       "optimizer.lr=choice(0.01,0.03,0.1)", "data.batch_size=choice(64,128)",
                       "trainer.max_epochs=1", "trainer.test=false", "trainer.progress_bar=false",
                       "trainer.log_every_n_steps=100000", f"hydra.sweep.dir={out}"]
                proc = subprocess.run(cmd, cwd=tmp, env=with_job_clock(env, Path(tmp)),
                                      capture_output=True, text=True, timeout=timeout, check=False)
                if proc.returncode != 0:
                    raise SystemExit(f"exit {proc.returncode}: {' '.join(cmd)}\n"
                                     f"{proc.stdout}{proc.stderr}")
                found = slot_gaps(proc.stdout + proc.stderr)
                gaps += found
                parts += between_jobs([d.parent.parent for d in out.glob("*/.hydra/config.yaml")],
                                      slots, job_ends(proc.stdout + proc.stderr))
                print(f"[{r + 1}/{repeats}] gaps     {n:3d} trials  median "
                      f"{_fmt(statistics.median(found), 3)} s  largest {_fmt(max(found), 3)} s",
                      file=sys.stderr, flush=True)
            lines.append(f"| {n} | {statistics.median(gaps):.3f} | {max(gaps):.3f} | "
                         f"{len(gaps)} |")
            between += between_table(f"{n} trials", parts, gaps)
    return "\n".join(lines + between + busy_search(quick, repeats, env, timeout, slots))


# ---------------------------------------------------------------------- the scale case
SCALE = "scale"


def _own_peak_mib(pid: int) -> float | None:
    """The peak resident memory of process ``pid`` itself (``VmHWM``), None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def scale_bench(quick: bool, repeats: int, env: dict, timeout: float) -> str:
    """How the launcher's cost grows with the sweep: sweeps of 8, 32 and 64 tiny jobs (one
    epoch of digits in batches of 256, one worker each, ``max_parallel: null``): each job's
    overhead (its wall minus its training, as its summary row says), the gap from a job's end
    to the next job's start (the launcher's bookkeeping: the table rewrite, the next compose
    and fork), and the launcher process's own peak memory (its ``VmHWM``, read as it runs)."""
    sizes = [2, 4] if quick else [8, 32, 64]
    rows: dict[int, dict[str, list[float]]] = {n: {"over": [], "gap": [], "peak": []} for n in sizes}
    with tempfile.TemporaryDirectory(prefix="ddpexp-bench-scale-") as tmp:
        for r in range(repeats):
            for n in sizes if r % 2 == 0 else sizes[::-1]:
                out = Path(tmp) / f"{n}-{r}"
                cmd = [sys.executable, "-m", "ddpexp", "-m", f"seed=range(0,{n})",
                       "data.batch_size=256", "trainer.max_epochs=1", "trainer.test=false",
                       "trainer.progress_bar=false", f"hydra.sweep.dir={out}"]
                with tempfile.TemporaryFile("w+") as log:
                    proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=log,
                                            stderr=subprocess.STDOUT, text=True,
                                            start_new_session=True)
                    peak, deadline = 0.0, time.monotonic() + timeout
                    while proc.poll() is None:
                        peak = max(peak, _own_peak_mib(proc.pid) or 0.0)
                        if time.monotonic() > deadline:
                            os.killpg(proc.pid, 9)
                            proc.wait()
                            raise SystemExit(f"timed out after {timeout}s: {' '.join(cmd)}")
                        time.sleep(0.05)
                    log.seek(0)
                    output = log.read()
                if proc.returncode != 0:
                    raise SystemExit(f"exit {proc.returncode}: {' '.join(cmd)}\n{output}")
                with open(out / "summary.csv", newline="") as f:
                    over = [float(row["wall_time_s"]) - float(row["train_time_s"])
                            for row in csv.DictReader(f)]
                gaps = slot_gaps(output)
                rows[n]["over"].append(statistics.median(over))
                rows[n]["gap"].append(statistics.median(gaps) if gaps else float("nan"))
                rows[n]["peak"].append(peak)
                print(f"[{r + 1}/{repeats}] scale    {n:3d} jobs  overhead "
                      f"{statistics.median(over):.2f} s  gap {_fmt(rows[n]['gap'][-1], 3)} s  "
                      f"launcher peak {peak:.0f} MiB", file=sys.stderr, flush=True)
    base = sizes[0]

    def med(n: int, key: str) -> float:
        return statistics.median(rows[n][key])

    lines = [f"scale: sweeps of {', '.join(map(str, sizes))} tiny jobs, medians of {repeats} "
             "run(s)", "", "| jobs | job overhead s | / smallest | end-to-next-start gap s "
             "| launcher peak MiB | / smallest |", "|---|---|---|---|---|---|"]
    for n in sizes:
        lines.append(f"| {n} | {med(n, 'over'):.2f} | {med(n, 'over') / med(base, 'over'):.2f} "
                     f"| {med(n, 'gap'):.3f} | {med(n, 'peak'):.0f} "
                     f"| {med(n, 'peak') / med(base, 'peak'):.2f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------- the launchers case
LAUNCHERS = "launchers"
# The sweep a researcher runs first: 8 jobs of one worker on the default digits data.
LAUNCHER_SWEEP = ["optimizer.lr=0.01,0.03,0.1,0.3", "data.batch_size=32,64",
                  "trainer.max_epochs=3", "trainer.progress_bar=false"]


def _launcher_variants(quick: bool = False) -> dict[str, list[str]]:
    """What runs the sweep: ddpexp's launcher at its defaults, Hydra's basic launcher (every
    job in the sweep's own process, one after another) and, where they are installed, Hydra's
    joblib launcher (a pool of worker processes, as many as cores) and ddpexp's ray launcher
    on a Ray of this machine (not with ``--quick``: Ray's own start takes longer than the
    quick sweep)."""
    variants = {"ddp (defaults)": [], "basic": ["hydra/launcher=basic"]}
    if importlib.util.find_spec("hydra_plugins.hydra_joblib_launcher") is not None:
        variants["joblib"] = ["hydra/launcher=joblib"]
    if not quick and importlib.util.find_spec("ray") is not None:
        # A Ray of this machine that the sweep starts and stops (2 CPUs), its start included.
        variants["ray (local)"] = ["hydra/launcher=ray",
                                   "hydra.launcher.object_store_memory=100000000"]
    return variants


def launchers_bench(quick: bool, repeats: int, env: dict, timeout: float) -> str:
    """The launchers case: one 8-job sweep run whole (launch to exit) by each launcher, in
    alternating order; for ddpexp's launcher also each job's start-up as its summary row
    says (``wall_time_s - train_time_s``: the job process's start to its first step and its
    end-of-run work). A markdown table of medians."""
    sweep = (["optimizer.lr=0.01,0.1", "data.batch_size=32", "trainer.max_epochs=1",
              "trainer.progress_bar=false"] if quick else LAUNCHER_SWEEP)
    variants = _launcher_variants(quick)
    walls: dict[str, list[float]] = {name: [] for name in variants}
    overheads: list[float] = []
    parts: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="ddpexp-bench-launchers-") as tmp:
        for r in range(repeats):
            names = list(variants) if r % 2 == 0 else list(variants)[::-1]
            for name in names:
                out = Path(tmp) / f"{name.split()[0]}-{r}"
                cmd = [sys.executable, "-m", "ddpexp", "-m", *sweep, *variants[name], *JOB_CLOCK,
                       f"hydra.sweep.dir={out}"]
                _, wall, _ = run_command(cmd, Path(tmp), with_job_clock(env, Path(tmp)), timeout)
                walls[name].append(wall)
                if name.startswith("ddp"):
                    with open(out / "summary.csv", newline="") as f:
                        overheads += [float(row["wall_time_s"]) - float(row["train_time_s"])
                                      for row in csv.DictReader(f)]
                if name == "ddp (defaults)":
                    dirs = [d.parent.parent for d in out.glob("*/.hydra/config.yaml")]
                    parts += between_jobs(dirs, os.cpu_count() or 1)
                print(f"[{r + 1}/{repeats}] launchers {name:15s} wall {wall:.1f}s",
                      file=sys.stderr, flush=True)
    jobs = 1
    for value in sweep:
        if "," in value:
            jobs *= value.count(",") + 1
    basic = statistics.median(walls["basic"])
    lines = [f"launchers: a {jobs}-job sweep ({' '.join(sweep)}, digits, one worker a job), "
             f"launch to exit, medians of {repeats} alternating run(s); "
             f"{os.cpu_count()} cores", "",
             "| launcher | sweep wall s | wall / basic |", "|---|---|---|"]
    for name, values in walls.items():
        wall = statistics.median(values)
        lines.append(f"| {name} | {wall:.1f} | {wall / basic:.2f} |")
    ddp = statistics.median(walls["ddp (defaults)"]) / basic
    worst = max(overheads)
    lines += ["", f"sweep: ddp launcher at its defaults / basic = {ddp:.2f} (target <= 0.9: "
              f"{'met' if ddp <= 0.9 else 'NOT met'}); a job's wall - train time: median "
              f"{statistics.median(overheads):.2f} s, most {worst:.2f} s (target < 1 s: "
              f"{'met' if worst < 1.0 else 'NOT met'})"]
    if "joblib" not in walls:
        lines.append("skipped: joblib (hydra-joblib-launcher is not installed)")
    if parts:
        lines += ["", "between jobs, from the run dirs (ddp launcher at its defaults):", "",
                  *BETWEEN_HEADER, *between_table(f"{jobs} jobs", parts, [])]
    return "\n".join(lines)


# ---------------------------------------------------------------------- the fsdp case
LOGGERS = "loggers"
FIND = "find"
# The loggers case's variants: the default logger alone, and with a tracker beside it.
LOGGER_VARIANTS = {"tensorboard": "logger=tensorboard",
                   "tensorboard+mlflow": "logger=[tensorboard,mlflow]",
                   "tensorboard+wandb": "logger=[tensorboard,wandb]"}


def loggers_bench(quick: bool, repeats: int, env: dict, timeout: float) -> str:
    """What a tracker costs a run: the overhead case's loop through ddpexp with
    ``logger=tensorboard``, with ``logger=[tensorboard,mlflow]`` (the default SQLite store, in
    the bench's temp dir) and with ``logger=[tensorboard,wandb]`` (offline, under the run
    dir), logging every 10 steps, rotating which goes first; per step, samples/s as the other
    cases measure it; at start-up, launch to the first step's end (``time/first_step_s``) and
    the command's wall time; each as the median of the paired ratios to tensorboard alone."""
    if quick:
        case = Case(LOGGERS, "mlp", 32, steps=12, warmup=2, procs=1, shape=(3, 8, 8))
    else:
        case = Case(LOGGERS, "mlp", 32, steps=400, warmup=10)
    names = [name for name in LOGGER_VARIANTS if name != "tensorboard+wandb" or _has("wandb")]
    figures: dict[str, dict[str, list[float]]] = {
        name: {"rate": [], "first": [], "wall": []} for name in names}
    env = {**env, "WANDB_SILENT": "true"}
    with tempfile.TemporaryDirectory(prefix="ddpexp-bench-") as tmp:
        work = Path(tmp)
        for r in range(repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                out = work / f"{name}-{r}"
                cmd = [sys.executable, "-m", "ddpexp", *case.ddpexp_args(), LOGGER_VARIANTS[name],
                       f"hydra.run.dir={out}"]
                launched, wall, _ = run_command(cmd, work, env, timeout)
                scalars = _scalars(out / "tb")
                rate = steady_rate(scalars.get("train/samples_per_s", []), case.warmup)
                first = scalars.get("time/first_step_s")
                first_s = first[0].wall_time - launched if first else None
                for key, value in (("rate", rate), ("first", first_s), ("wall", wall)):
                    figures[name][key].append(float("nan") if value is None else value)
                print(f"[{r + 1}/{repeats}] loggers  {name:18s} samples/s {_fmt(rate, 0)}  "
                      f"first step {_fmt(first_s)} s  wall {_fmt(wall)} s",
                      file=sys.stderr, flush=True)
    base = figures["tensorboard"]

    def paired(name: str, key: str) -> float:
        return statistics.median(v / b for v, b in zip(figures[name][key], base[key], strict=True))

    lines = [f"loggers: {describe(case)}, {repeats} round(s), medians", "",
             "| logger | samples/s | ratio (paired) | launch to first step s | ratio (paired) "
             "| wall s | ratio (paired) |", "|---|---|---|---|---|---|---|"]
    for name in names:
        f = figures[name]
        lines.append(f"| {LOGGER_VARIANTS[name]} | {statistics.median(f['rate']):.0f} "
                     f"| {paired(name, 'rate'):.3f} | {statistics.median(f['first']):.2f} "
                     f"| {paired(name, 'first'):.3f} | {statistics.median(f['wall']):.2f} "
                     f"| {paired(name, 'wall'):.3f} |")
    return "\n".join(lines)


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


FSDP = "fsdp"
TP = "tp"
# The memory case's layouts of 2 workers: (overrides, data-parallel replicas).
LAYOUTS = {"ddp": (["trainer.strategy=ddp"], 2), "fsdp": (["trainer.strategy=fsdp"], 2),
           "tp": (["trainer.strategy=ddp", "trainer.tp=2"], 1)}


def fsdp_args(quick: bool, strategy: str, text: Path, out: Path) -> list[str]:
    """The GPT of about 151M parameters (12 blocks of width 1024) with AdamW on 2 workers
    (quick: 2 blocks of width 64), the same run in ``strategy``'s layout (LAYOUTS) with the
    same global batch of 8 windows: 4 per replica, 8 for the one replica of tp=2."""
    size = ["model.n_layer=2", "model.n_embd=64", "model.n_head=4"] if quick else \
        ["model.n_layer=12", "model.n_embd=1024", "model.n_head=16"]
    steps, every = (4, 2) if quick else (9, 3)
    layout, replicas = LAYOUTS[strategy]
    return [sys.executable, "-m", "ddpexp", "task=lm", "model=gpt", *size, "data=text",
            f"data.path={text}", "data.block_size=64", f"data.batch_size={8 // replicas}",
            "optimizer=adamw", "trainer.procs=2", *layout, f"trainer.max_steps={steps}",
            f"trainer.log_every_n_steps={every}", "trainer.limit_val_batches=2", "trainer.test=false",
            "trainer.progress_bar=false", "+callbacks.model_state._target_=ddpexp.callbacks.ModelStateSize",
            f"hydra.run.dir={out}"]


def fsdp_bench(quick: bool, repeats: int, env: dict, timeout: float,
               layouts: Sequence[str] = ("ddp", "fsdp")) -> str:
    """The same GPT run in each of ``layouts`` (LAYOUTS: ddp, fsdp, tp=2), rotating which
    goes first: the largest process's peak RSS, the per-rank model state (counted by the
    ModelStateSize callback) against 16 bytes a parameter divided by the ranks, per-step
    time and tokens/s; a markdown table of medians and the memory ratios' verdicts."""
    figures: dict[str, list[dict]] = {name: [] for name in layouts}
    block, batch, procs = 64, 8, 2  # the global batch: windows per step over all replicas
    with tempfile.TemporaryDirectory(prefix="ddpexp-bench-fsdp-") as tmp:
        text = Path(tmp) / "text.txt"
        text.write_text((ROOT / "README.md").read_text())
        for r in range(repeats):
            for strategy in [*layouts[r % len(layouts):], *layouts[:r % len(layouts)]]:
                out = Path(tmp) / f"{strategy}-{r}"
                _, wall, rss = run_command(fsdp_args(quick, strategy, text, out), Path(tmp), env, timeout)
                sc = _scalars(out / "tb")
                rate = steady_rate(sc.get("train/samples_per_s", []), 3 if not quick else 2)
                figures[strategy].append({
                    "rss_mib": rss, "wall_s": wall, "samples_per_s": rate,
                    "state_bytes": sc["memory/model_state_bytes"][0].value,
                    "params": sc["memory/parameters"][0].value})
                print(f"[{r + 1}/{repeats}] memory-case {strategy:4s} wall {wall:6.1f}s  "
                      f"max RSS {rss:.0f}MiB  samples/s {_fmt(rate)}", file=sys.stderr, flush=True)

    def med(strategy: str, key: str) -> float | None:
        values = [f[key] for f in figures[strategy] if f[key] is not None]
        return statistics.median(values) if values else None

    params = figures["ddp"][0]["params"]
    lines = [f"GPT of {params / 1e6:.1f}M parameters, AdamW, {procs} workers on the CPU (gloo), "
             f"{batch} x {block} tokens per step over all replicas; medians of {repeats} round(s)",
             "", "| layout | model state per rank MiB | / (16P/N) | peak RSS MiB (largest process) "
             "| s per step | tokens/s |", "|---|---|---|---|---|---|"]
    for strategy in layouts:
        world = 1 if strategy == "ddp" else procs  # the ranks the model state is split over
        state, rate = med(strategy, "state_bytes"), med(strategy, "samples_per_s")
        # samples_per_s counts the samples of every replica (of one, at tp=2).
        lines.append(
            f"| {' '.join(LAYOUTS[strategy][0])} | {state / 2**20:.0f} | "
            f"{state / (16 * params / world):.3f} | {med(strategy, 'rss_mib'):.0f} | "
            f"{_fmt(batch / rate if rate else None, 3)} | {_fmt(rate * block if rate else None, 0)} |")
    lines.append("")
    for strategy in layouts[1:]:
        ratio = med(strategy, "rss_mib") / med("ddp", "rss_mib")
        state_ratio = med(strategy, "state_bytes") / (16 * params / procs)
        lines.append(f"{strategy}/ddp peak RSS: {ratio:.2f} (target <= 0.7: "
                     f"{'met' if ratio <= 0.7 else 'MISSED'}); {strategy} model state per rank "
                     f"/ (16P/N): {state_ratio:.3f}" + (
                         f" (target <= 1.02: {'met' if state_ratio <= 1.02 else 'MISSED'})"
                         if strategy == "fsdp" else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------- the save case
SAVE = "save"
# The save case's variants: no checkpoint mid-run, and every few steps (SAVE_PLAN) in the loop or
# in the background (trainer.async_save).
SAVE_VARIANTS = {"none": [], "sync": ["trainer.async_save=false"],
                 "async": ["trainer.async_save=true"]}


# The save case's strategies: one process, or fsdp over 2 gloo workers (every rank writes its
# shards of the sharded last.pt; in the background with DCP's async save).
SAVE_STRATEGIES = {"single": ["trainer.strategy=single"],
                   "fsdp": ["trainer.strategy=fsdp", "trainer.procs=2"]}


def save_args(quick: bool, variant: str, text: Path, out: Path, strategy: str = "single") -> list[str]:
    """The fsdp case's GPT of about 151M parameters (quick: 2 blocks of width 64) with AdamW
    on the CPU under ``strategy`` (SAVE_STRATEGIES), logging every step; ``variant`` saves
    ``last.pt`` every few steps (SAVE_PLAN) in the loop or in the background, or not
    mid-run."""
    every_n, steps = SAVE_PLAN[strategy]
    size = ["model.n_layer=2", "model.n_embd=64", "model.n_head=4"] if quick else \
        ["model.n_layer=12", "model.n_embd=1024", "model.n_head=16"]
    every = [f"trainer.ckpt_every_steps={every_n}"] if variant != "none" else []
    return [sys.executable, "-m", "ddpexp", "task=lm", "model=gpt", *size, "data=text",
            f"data.path={text}", "data.block_size=32", "data.batch_size=2", "optimizer=adamw",
            *SAVE_STRATEGIES[strategy], f"trainer.max_steps={steps}",
            "trainer.log_every_n_steps=1", "trainer.limit_val_batches=1", "trainer.test=false",
            "trainer.progress_bar=false", *every, *SAVE_VARIANTS[variant],
            "+callbacks.clock._target_=bench_clock.StepClock",
            f"+callbacks.clock.path={out / 'step_ends.json'}", f"hydra.run.dir={out}"]


# (save every N steps, steps) under each strategy: three saves mid-run, about 15 s apart
# (one process: 0.8 to 1 s a step; fsdp over 2 workers: 5.5 s a step), further apart than
# the write of the full-size checkpoint takes in the loop (3 to 5 s). A background save
# waits for the one before it (one save in flight): where the write, at the lowest
# priority beside a loop that keeps both cores busy, has not ended by the next save, that
# save's stop is the rest of it (docs/benchmarks.md).
SAVE_PLAN = {"single": (16, 49), "fsdp": (4, 13)}


def saved_at(strategy: str) -> list[int]:
    """The steps that save mid-run (the last step saves at the end of every run)."""
    every_n, steps = SAVE_PLAN[strategy]
    return list(range(every_n, steps, every_n))


# A callback that the save case's runs load from the bench's temp dir: the loop's own clock
# at the end of each optimizer step. (TensorBoard's event times are stamped by the logger's
# writer thread, which a save in the loop's thread delays.)
_STEP_CLOCK = """
import json, time
from ddpexp import Callback

class StepClock(Callback):
    def __init__(self, path):
        self.path, self.ends = path, []

    def on_train_batch_end(self, trainer):
        self.ends.append(time.perf_counter())

    def on_fit_end(self, trainer, result):
        if trainer.is_main:
            with open(self.path, "w") as f:
                json.dump(self.ends, f)
"""


def _step_ends(out: Path) -> list[float]:
    """The loop's clock at the end of each optimizer step (the StepClock callback's)."""
    return json.loads((out / "step_ends.json").read_text())


def _stops(ends: list[float], saved: Sequence[int]) -> list[float]:
    """The seconds each mid-run save stopped the loop, read inside one run: the interval
    from the end of its step to the end of the next, minus the median interval between
    steps that follow no save (robust to a load that drifts between runs)."""
    # ends[i] is the end of step i + 1; intervals[s] is the time from step s - 1 to step s.
    intervals = {s: ends[s - 1] - ends[s - 2] for s in range(2, len(ends) + 1)}
    plain = statistics.median(v for s, v in intervals.items() if s - 1 not in saved)
    return [intervals[s + 1] - plain for s in saved]


def _size(path: Path) -> int:
    """The bytes of a checkpoint: a file, or a sharded directory's files."""
    return sum(p.stat().st_size for p in path.iterdir()) if path.is_dir() else path.stat().st_size


def save_bench(quick: bool, repeats: int, env: dict, timeout: float,
               strategies: Sequence[str] = tuple(SAVE_STRATEGIES)) -> str:
    """:func:`save_strategy_bench` under each of ``strategies``, one table each."""
    return "\n\n".join(save_strategy_bench(quick, repeats, env, timeout, s) for s in strategies)


def save_strategy_bench(quick: bool, repeats: int, env: dict, timeout: float,
                        strategy: str = "single") -> str:
    """The loop's stall at a save, in the loop (``async_save=false``) and in the background
    (``true``): the loop time (end of step 1 to end of the last step) of a run that saves
    mid-run minus that of the same run without, per save; and the stop read inside each
    run (:func:`_stops`). Peak RSS (of the largest process: under fsdp one worker) over the
    run without saves is what the saves cost in memory (for the background one, its
    snapshot). Alternates the order; a markdown table of medians and the target's verdict
    (the async stall under 20% of the sync one)."""
    figures: dict[str, list[dict]] = {name: [] for name in SAVE_VARIANTS}
    with tempfile.TemporaryDirectory(prefix="ddpexp-bench-save-") as tmp:
        text = Path(tmp) / "text.txt"
        text.write_text((ROOT / "README.md").read_text())
        (Path(tmp) / "bench_clock.py").write_text(_STEP_CLOCK)
        env = {**env, "PYTHONPATH": os.pathsep.join([tmp, env.get("PYTHONPATH", "")])}
        for r in range(repeats):
            names = list(SAVE_VARIANTS)
            for name in names[r % 3:] + names[:r % 3]:
                out = Path(tmp) / f"{name}-{r}"
                _, wall, rss = run_command(save_args(quick, name, text, out, strategy), Path(tmp),
                                           env, timeout)
                ends = _step_ends(out)
                size = _size(out / "checkpoints" / "last.pt")
                stops = _stops(ends, saved_at(strategy)) if name != "none" else []
                figures[name].append({"loop_s": ends[-1] - ends[0], "wall_s": wall, "rss_mib": rss,
                                      "ckpt_mib": size / 2**20, "stops": stops})
                shutil.rmtree(out / "checkpoints")  # some GB each at full size
                print(f"[{r + 1}/{repeats}] save-case {strategy} {name:5s} loop {ends[-1] - ends[0]:6.2f}s "
                      f"wall {wall:6.1f}s  max RSS {rss:.0f}MiB  last.pt {size / 2**20:.0f}MiB  "
                      f"stops {' '.join(f'{x:.2f}' for x in stops)}  "
                      f"load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)

    def med(name: str, key: str) -> float:
        return statistics.median(f[key] for f in figures[name])

    base_loop, base_rss = med("none", "loop_s"), med("none", "rss_mib")
    saves = len(saved_at(strategy))
    stall = {name: statistics.median((f["loop_s"] - b["loop_s"]) / saves for f, b in
                                     zip(figures[name], figures["none"], strict=True))
             for name in ("sync", "async")}
    stop = {name: statistics.median(x for f in figures[name] for x in f["stops"])
            for name in ("sync", "async")}
    where = "one process" if strategy == "single" else "fsdp over 2 gloo workers"
    lines = [f"GPT ({'2 x 64' if quick else '12 x 1024, about 151M parameters'}), AdamW, "
             f"{where} on the CPU, {SAVE_PLAN[strategy][1]} steps of 2 x 32 tokens, last.pt "
             f"{med('sync', 'ckpt_mib'):.0f} MiB saved at steps "
             f"{', '.join(map(str, saved_at(strategy)))}; medians of {repeats} round(s), load average "
             f"{os.getloadavg()[0]:.1f} at the end", "",
             "| trainer.async_save | loop s | stall per save s (loop - no-save loop) "
             "| stop at a save s (in-run) | peak RSS MiB | RSS over no saves MiB |",
             "|---|---|---|---|---|---|",
             f"| (no saves mid-run) | {base_loop:.2f} | | | {base_rss:.0f} | |"]
    for name in ("sync", "async"):
        lines.append(f"| {str(name == 'async').lower()} | {med(name, 'loop_s'):.2f} | "
                     f"{stall[name]:.2f} | {stop[name]:.2f} | {med(name, 'rss_mib'):.0f} | "
                     f"{med(name, 'rss_mib') - base_rss:.0f} |")

    def verdict(a: float, b: float) -> str:
        if b <= 0:  # the saves in the loop cost less than the noise: nothing to compare
            return f"not measurable (sync {b:.2f} s)"
        ratio = max(a, 0.0) / b
        return f"{ratio:.2f} (target < 0.2: {'met' if ratio < 0.2 else 'MISSED'})"

    lines += ["", f"async / sync stall per save: {verdict(stall['async'], stall['sync'])}; "
              f"async / sync stop at a save: {verdict(stop['async'], stop['sync'])}"]
    return "\n".join(lines)


# ---------------------------------------------------------------------- the defaults case
DEFAULTS = "defaults"
# The overhead case's MLP as a user runs it: 40,000 samples (625 steps an epoch on 2 workers
# of batch 32), trainer.max_steps and the defaults otherwise, so that epoch ends (validation
# of the 512-sample split, last.pt and best.pt) fall inside the measured window. Each variant
# turns one default off; the difference to "defaults" is what that default costs.
DEFAULT_SAMPLES, DEFAULT_STEPS, DEFAULT_FROM = 40_000, 1500, 20
DEFAULT_VARIANTS = {
    "defaults": [],
    "validation on 1 batch": ["trainer.limit_val_batches=1"],
    "no checkpoints": ["~callbacks.checkpoint", "trainer.test=false"],
    "no lr monitor": ["~callbacks.lr_monitor"],
    "train/* scalars every 500 steps": ["trainer.log_every_n_steps=500"],
}


def defaults_case(quick: bool) -> Case:
    steps, samples = (60, 1000) if quick else (DEFAULT_STEPS, DEFAULT_SAMPLES)
    return Case("defaults", "mlp", 32, steps, DEFAULT_FROM, samples=samples)


def defaults_bench(quick: bool, repeats: int, env: dict, timeout: float) -> str:
    """samples/s of the tiny MLP over several epochs, ddpexp at its defaults and with one
    default off at a time, against the plain loop, each timed by its own loop's clock from
    the end of step DEFAULT_FROM to the end of the last (ddpexp: a callback the bench loads,
    rank 0's clock at each optimizer step's end; the plain loop: its own window), so that
    the epoch ends of ddpexp's defaults count. Alternates the order; paired ratios."""
    case = defaults_case(quick)
    rates: dict[str, list[float]] = {name: [] for name in [*DEFAULT_VARIANTS, "plain"]}
    with tempfile.TemporaryDirectory(prefix="ddpexp-bench-defaults-") as tmp:
        work = Path(tmp)
        (work / "bench_clock.py").write_text(_STEP_CLOCK)
        env = {**env, "PYTHONPATH": os.pathsep.join([tmp, env.get("PYTHONPATH", "")])}
        for r in range(repeats):
            names = list(rates)
            for name in names[r % len(names):] + names[:r % len(names)]:
                if name == "plain":
                    rate = run_plain(case, work, env, f"defaults-{r}", timeout).samples_per_s
                else:
                    out = work / f"v{names.index(name)}-{r}"
                    cmd = [sys.executable, "-m", "ddpexp", *case.ddpexp_args(),
                           *DEFAULT_VARIANTS[name], "+callbacks.clock._target_=bench_clock.StepClock",
                           f"+callbacks.clock.path={out / 'step_ends.json'}", f"hydra.run.dir={out}"]
                    run_command(cmd, work, env, timeout)
                    ends = _step_ends(out)
                    window = ends[-1] - ends[case.warmup - 1]
                    rate = (len(ends) - case.warmup) * case.batch_size * case.procs / window
                    shutil.rmtree(out)
                assert rate is not None
                rates[name].append(rate)
                print(f"[{r + 1}/{repeats}] defaults-case {name:32s} samples/s {rate:7.0f}  "
                      f"load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    plain = statistics.median(rates["plain"])
    base = [a / b for a, b in zip(rates["defaults"], rates["plain"], strict=True)]
    lines = [f"MLP, batch 32, 2 procs, {case.steps} steps over {case.num_samples} samples "
             f"({case.num_samples // (case.batch_size * case.procs)} steps an epoch), timed from "
             f"step {case.warmup} to the last; medians of {repeats} round(s), load average "
             f"{os.getloadavg()[0]:.1f} at the end", "",
             "| ddpexp | samples/s | / plain (paired) | / defaults (paired) |", "|---|---|---|---|"]
    for name in DEFAULT_VARIANTS:
        mine = rates[name]
        vs_plain = [a / b for a, b in zip(mine, rates["plain"], strict=True)]
        vs_defaults = [a / b for a, b in zip(mine, rates["defaults"], strict=True)]
        lines.append(f"| {name} | {statistics.median(mine):.0f} | {statistics.median(vs_plain):.3f} "
                     f"| {statistics.median(vs_defaults):.3f} |")
    lines.append(f"| (plain loop) | {plain:.0f} | 1.000 | |")
    ratio = statistics.median(base)
    lines += ["", f"defaults: samples/s ratio {ratio:.3f} (target >= 1.0): "
              f"{'met' if ratio >= 1.0 else 'MISSED'}"]
    return "\n".join(lines)


# ---------------------------------------------------------------------- main
def make_cases(quick: bool, only: list[str] | None) -> list[Case]:
    if quick:
        # One worker each and tiny shapes: it checks that every figure comes out, cheaply.
        tiny = dict(procs=1, shape=(3, 8, 8))
        cases = [
            Case("overhead", "mlp", 32, steps=6, warmup=2, **tiny),
            Case("compute", "convnet", 64, steps=6, warmup=2, **tiny),
            Case("startup", "mlp", 32, steps=2, warmup=1, samples=512, throughput=False, **tiny),
            Case("sweep", "mlp", 32, steps=2, warmup=1, jobs=2, **tiny),
        ]
    else:
        cases = [
            Case("overhead", "mlp", 32, steps=400, warmup=20),
            Case("compute", "convnet", 64, steps=100, warmup=20),
            # What a debug run or a sweep of short jobs pays: start-up, data, the end-of-run
            # validation and checkpoint, exit; and memory, on a data set of 470 MiB per rank.
            Case("startup", "mlp", 32, steps=20, warmup=10, samples=40_000, throughput=False),
            Case("sweep", "mlp", 32, steps=20, warmup=10, jobs=4),
        ]
    return _select(cases, only)


def gpu_cases(dry_run: bool, only: list[str] | None) -> tuple[list[Case], list[str]]:
    """The GPU cases, and what was skipped. ``dry_run``: the same cases, tiny, on the CPU
    (gloo instead of NCCL), without those that need CUDA (``torch.compile``'s GPU code)."""
    if dry_run:
        base = dict(device="cpu", procs=1, shape=(3, 8, 8), steps=4, warmup=2)
    else:
        base = dict(device="cuda", procs=1, shape=(3, 32, 32), steps=300, warmup=50)
    cases = [
        Case("gpu-fp32", "convnet", 256, **base),
        Case("gpu-bf16", "convnet", 256, precision="bf16", **base),
        Case("gpu-dp", "convnet", 256, strategy="dp", **base),
        Case("gpu-fsdp", "convnet", 256, strategy="fsdp", precision="bf16", **base),
        Case("gpu-compile", "convnet", 256, precision="bf16", compile=True, **base),
    ]
    skipped = []
    if dry_run:
        skipped = [f"{c.name} (torch.compile needs CUDA here)" for c in cases if c.compile]
        # gpu-bf16's flags are gpu-fsdp's but for the strategy: the dry run keeps one of them.
        skipped.append("gpu-bf16 (on a GPU only; gpu-fsdp runs its bf16 flags here)")
        cases = [c for c in cases if not c.compile and c.name != "gpu-bf16"]
    return _select(cases, only), skipped


def _select(cases: list[Case], only: list[str] | None) -> list[Case]:
    if only:
        unknown = set(only) - {c.name for c in cases}
        if unknown:
            raise SystemExit(f"unknown case(s) {sorted(unknown)}; choose from "
                             + ", ".join(c.name for c in cases))
        cases = [c for c in cases if c.name in only]
    return cases


def find_bench(quick: bool, repeats: int, env: dict, timeout: float) -> str:
    """What a ``find lr`` step costs against a training step of the same experiment: the
    overhead case trained (its steady samples/s, as the loop case measures it, as seconds
    per step) and searched over as many steps (the search's mean step after the first,
    ``step_s`` of find/lr.json), alternating which goes first; medians of the paired ratios."""
    if quick:
        case = Case(FIND, "mlp", 32, steps=20, warmup=2, procs=1, shape=(3, 8, 8))
    else:
        case = Case(FIND, "mlp", 32, steps=400, warmup=10)
    train, search = [], []
    with tempfile.TemporaryDirectory(prefix="ddpexp-bench-") as tmp:
        work = Path(tmp)
        for r in range(repeats):
            for which in (["train", "find"] if r % 2 == 0 else ["find", "train"]):
                out = work / f"{which}-{r}"
                if which == "train":
                    cmd = [sys.executable, "-m", "ddpexp", *case.ddpexp_args(),
                           f"hydra.run.dir={out}"]
                    run_command(cmd, work, env, timeout)
                    rate = steady_rate(_scalars(out / "tb").get("train/samples_per_s", []),
                                       case.warmup)
                    step = case.batch_size * case.procs / rate if rate else float("nan")
                    train.append(step)
                else:
                    args = [a for a in case.ddpexp_args() if not a.startswith("trainer.max_steps")]
                    cmd = [sys.executable, "-m", "ddpexp.find", "lr", *args,
                           f"find.steps={case.steps}", "find.lr_max=0.05", "find.stop_factor=1e9",
                           f"hydra.run.dir={out}"]
                    run_command(cmd, work, env, timeout)
                    step = json.loads((out / "find" / "lr.json").read_text())["step_s"]
                    search.append(step)
                print(f"[{r + 1}/{repeats}] find     {which:5s} {step * 1000:.2f} ms/step",
                      file=sys.stderr, flush=True)
    ratios = [s / t for s, t in zip(search, train, strict=True)]
    return "\n".join([
        f"find: {describe(case)}, {repeats} round(s), medians", "",
        "| runner | ms per step | ratio (paired) |", "|---|---|---|",
        f"| training | {statistics.median(train) * 1000:.2f} | - |",
        f"| find lr | {statistics.median(search) * 1000:.2f} | {statistics.median(ratios):.3f} |",
        "", f"find: a search step costs {statistics.median(ratios):.3f}x a training step "
        f"(target <= 1.1): {'met' if statistics.median(ratios) <= 1.1 else 'missed'}"])


def data_bench(quick: bool, repeats: int, env: dict, timeout: float) -> str:
    """scripts/data_bench.py: the readers considered for data=shards, and the loop fed by
    augmented shards against pre-loaded tensors."""
    import data_bench as cases

    return cases.data_bench(quick, repeats, env, timeout)


DATA = "data"
# Cases that run commands of their own and print their own table: name -> the bench.
OWN_CASES: dict[str, Callable[[bool, int, dict, float], str]] = {
    SEARCH: search_bench, FSDP: fsdp_bench,
    TP: functools.partial(fsdp_bench, layouts=("ddp", "fsdp", "tp")), LOGGERS: loggers_bench, LAUNCHERS: launchers_bench,
    GAPS: gaps_bench, SAVE: save_bench, SCALE: scale_bench, DEFAULTS: defaults_bench,
    FIND: find_bench, DATA: data_bench,
    **{f"{SAVE}-{s}": functools.partial(save_bench, strategies=(s,)) for s in SAVE_STRATEGIES}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="ddpexp vs a hand-written DDP loop")
    p.add_argument("--quick", action="store_true", help="tiny cases, 1 repeat (for the test)")
    p.add_argument("--repeats", type=int, default=None, help="rounds (default 3; 1 with --quick)")
    p.add_argument("--cases", nargs="+", default=None,
                   help="a subset of: overhead compute startup sweep search (--quick runs search "
                        "only when named; with --gpu: gpu-fp32 gpu-bf16 gpu-dp gpu-fsdp gpu-compile; fsdp: "
                        "the memory case, tp: the same with tensor parallelism (tp=2) beside, loggers: a tracker's cost per step, launchers: an 8-job "
                        "sweep under ddpexp's and Hydra's launchers, gaps: the search's slot "
                        "gaps over 8 and 32 trials, save: the loop's stall at a checkpoint with "
                        "trainer.async_save on and off, one process and fsdp over 2 workers "
                        "(save-single, save-fsdp: one of them), scale: sweeps of 8, 32 and 64 tiny jobs, "
                        "defaults: the tiny MLP over epochs at ddpexp's defaults and with each "
                        "off, data: streaming readers and the loop fed by augmented shards, "
                        "each only when named)")
    p.add_argument("--peers", action="store_true",
                   help="add Lightning (scripts/lightning_ddp.py) where it is installed")
    p.add_argument("--gpu", action="store_true", help="the GPU cases instead of the CPU ones")
    p.add_argument("--dry-run", action="store_true",
                   help="with --gpu: run the GPU cases tiny on the CPU, skipping what needs CUDA")
    p.add_argument("--json", default=None, help="also write every run's figures here")
    p.add_argument("--timeout", type=float, default=600, help="seconds per command")
    args = p.parse_args(argv)
    if args.dry_run and not args.gpu:
        p.error("--dry-run goes with --gpu")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    repeats = args.repeats or (1 if args.quick or args.dry_run else 3)
    skipped: list[str] = []
    named = args.cases or []
    # The cases of their own: search runs by default (not with --quick), the others when named.
    own = [c for c in OWN_CASES if c in named or (c == SEARCH and not args.quick and not named)]
    if args.gpu:
        own = []
        cases, skipped = gpu_cases(args.dry_run, args.cases)
        if not args.dry_run:
            import torch

            if not torch.cuda.is_available():
                raise SystemExit("--gpu needs CUDA (torch.cuda.is_available() is false here); "
                                 "--gpu --dry-run runs the GPU cases on the CPU")
    else:
        others = [c for c in named if c not in OWN_CASES]
        cases = make_cases(args.quick, others or None) if others or not args.cases else []
    peers = args.peers and lightning_installed()
    if args.peers and not peers:
        skipped.append("lightning (neither lightning nor pytorch_lightning is importable)")

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
                runners = runners_for(case, peers, quick=args.quick)
                shift = r % len(runners)
                for runner in runners[shift:] + runners[:shift]:
                    run = run_one(runner, case, work, env, f"{case.name}-{r}", args.timeout)
                    res.add(case.name, runner, run)
                    print(f"[{r + 1}/{repeats}] {case.name:8s} {runner:9s} "
                          f"wall {run.wall_s:6.2f}s  samples/s {_fmt(run.samples_per_s, 0)}  "
                          f"first step {_fmt(run.first_step_s)}s  max RSS {run.max_rss_mib:.0f}MiB",
                          file=sys.stderr, flush=True)
    if cases:
        print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(table(cases, res, repeats, peers))
        print()
        for line in verdicts(cases, res):
            print(line)
    for what in skipped:
        print(f"skipped: {what}")
    for name in own:
        print()
        print(OWN_CASES[name](args.quick, repeats, env, args.timeout))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {f"{c}/{r}": [vars(x) for x in runs] for (c, r), runs in res.runs.items()}, indent=2))


if __name__ == "__main__":
    main()
