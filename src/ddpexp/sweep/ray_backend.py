"""The Ray backend (:mod:`ddpexp.sweep.backend`) of the ray launcher
(``hydra/launcher=ray``): every sweep job a ddpexp run on a node of a Ray cluster.

A job reserves its workers' CPUs (``trainer.procs``, a CPU each) and GPUs
(``trainer.gpus``) on a node, as Ray counts them, in :class:`~ddpexp.sweep.ray_cluster.Unit` s: a CPU (with a GPU) of
one node held by a one-bundle placement group pinned to that node by its node-id label. A
job with ``trainer.nodes=N`` holds such units on N different nodes, joined as an env://
world whose address is the first node. The units of a job that ended stay the sweep's for
:data:`IDLE_S`, and the next job on their node starts in them at once: Ray places a
reservation on resources that were just given back only at its next scheduling round
(0.3 s on an idle machine, over a second on a busy one). The sweep keeps one
:class:`~ddpexp.sweep.ray_job.NodeAgent` actor per node (no resources of its own), which
forks the processes of each job whose units are on its node from a server that imported
torch, Hydra and ddpexp once (:mod:`ddpexp.sweep.ray_job`): a job starts within
milliseconds of its units being reserved, not after a fresh Ray worker and a fresh
interpreter. A job with GPUs sees its units' GPUs, as a task in each unit reads them from Ray.

A job starts as soon as some node has its CPUs free (:meth:`RayBackend.start` checks
the nodes' room as this sweep holds it, then waits briefly for the new units); the
jobs that end are taken as Ray reports them, the first finished first (``ray.wait``). A job
asking for more than any node has is refused before anything is reserved, naming the job and
the nodes' sizes. A node that dies mid-job ends that job as failed, naming the node, or,
with ``hydra.launcher.retries=N``, places it again (up to N times) to continue from its
``last.pt``. What a job's ending means, time limits, ``fail_fast``, Ctrl-C and the summary
are the driver's (:mod:`ddpexp.sweep.driver`).

``hydra.launcher.address`` unset starts a Ray of this machine for the sweep (2 CPUs' worth)
and stops it after; set, it is a running cluster's address (``auto``, ``host:port``,
``ray://host:port``), refused within :data:`~ddpexp.sweep.ray_cluster.CONNECT_TIMEOUT_S` when nothing answers there.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from omegaconf import OmegaConf, open_dict

from ddpexp.errors import ConfigError
from ddpexp.sweep.backend import Backend, Ended, HydraSetup, Job, job_env, payload
from ddpexp.sweep.ray_cluster import (
    Need,
    Node,
    Placed,
    Unit,
    amount,
    fits,
    need_of,
    nodes_of,
    probe,
    remove_group,
    too_large,
    world_ranks,
)
from ddpexp.sweep.settings import RaySettings

log = logging.getLogger("hydra_plugins.ddpexp_launcher")

# How long start() waits for new units that the sweep's own count says fit (Ray takes some
# milliseconds to reserve them); those not ready by then are given back for a later try.
PLACE_WAIT_S = 5.0
# How long the units of an ended job stay the sweep's, for its next job on their node,
# before they go back to the cluster.
IDLE_S = 2.0
# How long a node where Ray did not place new units in time is tried after the others (a
# node that has just died is listed alive until Ray misses its heartbeats).
LATE_S = 60.0
# The label by which Ray names each node's id, which pins a unit to its node.
NODE_LABEL = "ray.io/node-id"
# After rank 0 of a job over several nodes has ended, how long the other ranks have to end.
FOLLOWERS_GRACE_S = 10.0
# How long the nodes have to answer whether they can write the sweep dir.
STORAGE_CHECK_S = 120.0
# With nothing of the sweep running and no room for the next job, how long to wait before
# looking at the cluster's nodes again.
NO_ROOM_S = 1.0
# The local Ray a sweep without an address starts: this machine's cores, up to 2.
LOCAL_CPUS = 2
# Ray's worker processes run at niceness 15 by default; the jobs' training is the point of
# the node's agent, so it (and what it forks) runs at normal priority (what Ray's own job
# supervisor asks for).
RUNNER_ENV = {"RAY_worker_niceness": "0"}
# Calls that each node's agent takes at once: a run() per job on the node, and signal()s.
AGENT_CONCURRENCY = 64
# How long the agents have to close their fork servers as the sweep ends.
CLOSE_S = 5.0


# ------------------------------------------------------------------------------ the backend
class RayBackend(Backend):
    """Jobs in Ray placement groups, run by each node's agent: :meth:`start` reserves a
    job's bundles and has the agents of their nodes start its processes, :meth:`wait` takes
    the jobs Ray reports ended (first finished), :meth:`stop` signals the job's processes on
    their nodes."""

    def __init__(self, settings: RaySettings, hydra: HydraSetup) -> None:
        self.hydra = hydra
        self.address: str | None = settings.address or None
        self.parallel = settings.max_parallel
        self.retries = max(0, settings.retries)
        self.object_store_memory = settings.object_store_memory
        self.running: list[Job] = []
        self.nodes: list[Node] = []
        # Every node seen during the sweep: a job too large for all of them is refused; one
        # that only a node that died could hold waits for another like it.
        self.seen: list[Node] = []
        self.idle: list[Unit] = []  # units of ended jobs, kept for the next (IDLE_S)
        self._refreshed = 0.0
        self._late: dict[str, float] = {}  # node id -> when Ray last did not place units there
        self._refused: list[Ended] = []
        self._connected = False
        self._storage_checked = False
        self._agent_class: Any = None
        self.agents: dict[str, Any] = {}  # node id -> its NodeAgent actor

    # -------------------------------------------------------------- the cluster
    def __enter__(self) -> RayBackend:
        import ray

        if self.address is None:
            self._start_local()
        else:
            probe(self.address)
            try:
                ray.init(address=self.address, log_to_driver=True)
            except Exception as exc:
                raise ConfigError(f"hydra.launcher.address={self.address}: Ray could not connect "
                                  f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})."
                                  " Give the address of a running cluster's head (ray status "
                                  "prints it)") from None
        self._connected = True
        from ddpexp.sweep.ray_job import NodeAgent

        self._agent_class = ray.remote(NodeAgent)
        self._refresh()
        log.info("Ray cluster %s: %d node(s): %s", self.address or "of this machine",
                 len(self.nodes), "; ".join(f"{n.ip} (node {n.id[:8]}) {amount(n.cpus, n.gpus)}"
                                           for n in self.nodes))
        return self

    def _start_local(self) -> None:
        """A Ray of this machine for the sweep. Ray gives its raylet a fixed 30 s to register
        and a loaded machine can miss it: one more try before the sweep is refused."""
        import ray

        for attempt in (1, 2):
            try:
                ray.init(num_cpus=min(LOCAL_CPUS, os.cpu_count() or 1), include_dashboard=False,
                         object_store_memory=self.object_store_memory, log_to_driver=True)
                return
            except Exception as exc:  # Ray raises bare Exceptions when its services do not start
                ray.shutdown()  # whatever of it did start ends here
                if attempt == 2:
                    raise ConfigError(
                        f"hydra/launcher=ray could not start a Ray on this machine "
                        f"({_first_line(exc)}); on a busy machine try again, or give a running "
                        "cluster's hydra.launcher.address") from None
                log.warning("a Ray of this machine did not start (%s): trying once more",
                            _first_line(exc))

    def _check_storage(self, sweep_dir: str) -> None:
        """Refuse a sweep dir that a node of the cluster cannot write (every job writes its
        run dir there, from whichever node it runs on), with one message naming the nodes."""
        import ray

        self._storage_checked = True
        refs = [self._agent(n.id).cannot_write.remote(sweep_dir) for n in self.nodes]
        try:
            answers = ray.get(refs, timeout=STORAGE_CHECK_S)
        except Exception as exc:  # a node that cannot run a task at all: its jobs will say
            log.warning("could not check that every Ray node writes %s: %s", sweep_dir,
                        _first_line(exc))
            return
        bad = [f"{n.ip} (node {n.id[:8]}): {why}"
               for n, why in zip(self.nodes, answers, strict=True) if why]
        if bad:
            raise ConfigError(
                f"hydra.sweep.dir={sweep_dir}: not every node of the Ray cluster can write it "
                f"({'; '.join(bad)}). Put the sweep dir on storage every node mounts at the "
                "same path (NFS, a shared volume)")

    def __exit__(self, *exc: Any) -> None:
        if not self._connected:
            return
        import ray

        try:
            for job in self.running:
                if isinstance(job.handle, Placed):
                    self._release(job.handle, kill=True)
            for unit in self.idle:
                remove_group(unit.pg)
            self.idle.clear()
            closing = [agent.close.remote() for agent in self.agents.values()]
            ray.wait(closing, num_returns=len(closing), timeout=CLOSE_S)
            self.agents.clear()
        finally:
            ray.shutdown()
            self._connected = False

    def _refresh(self) -> None:
        """The cluster's alive nodes, keeping what this sweep's jobs hold on each."""
        import ray

        used = {n.id: (n.used_cpus, n.used_gpus) for n in self.nodes}
        self.nodes = nodes_of(ray.nodes())
        for node in self.nodes:
            node.used_cpus, node.used_gpus = used.get(node.id, (0.0, 0.0))
        known = {n.id for n in self.seen}
        self.seen += [Node(n.id, n.ip, n.cpus, n.gpus) for n in self.nodes if n.id not in known]
        alive = {n.id for n in self.nodes}
        for gone in [i for i in self.agents if i not in alive]:
            del self.agents[gone]
        self._give_back([u for u in self.idle if u.node not in alive])
        self._refreshed = time.monotonic()

    def _agent(self, node_id: str) -> Any:
        """The agent of a node, started for the sweep the first time a node needs it."""
        agent = self.agents.get(node_id)
        if agent is None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            agent = self._agent_class.options(
                num_cpus=0, max_concurrency=AGENT_CONCURRENCY, max_restarts=0,
                runtime_env={"env_vars": RUNNER_ENV},
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote()
            self.agents[node_id] = agent
        return agent

    def describe(self) -> str:
        where = f"at {self.address}" if self.address else "of this machine, started for the sweep"
        cap = f", up to {self.parallel} at once" if self.parallel else ""
        return (f"on the Ray cluster {where}: each job starts as soon as a node has its "
                f"workers' CPUs (and GPUs) free{cap}")

    @property
    def free(self) -> int:
        """Free CPUs of the cluster as this sweep holds it (0 once ``max_parallel`` jobs run)."""
        if self.parallel is not None and len(self.running) >= self.parallel:
            return 0
        return int(sum(max(0.0, n.cpus - n.used_cpus) for n in self.nodes))

    # -------------------------------------------------------------- jobs
    def start(self, job: Job) -> bool:
        """Reserve the job's bundles and start it; False when the cluster has no room for it
        now. A job that no node could ever hold is taken and reported ended (refused)."""
        if not self._storage_checked and job.config is not None:
            # The sweep dir as the driver resolved it into the job's config, once; then the
            # nodes' fork servers import while the first jobs are placed.
            self._check_storage(str(job.config.hydra.sweep.dir))
            for agent in self.agents.values():
                agent.warm.remote()
        need = need_of(job)
        refused = too_large(need, self.seen)
        if refused is not None:
            self._refresh()  # a node may have joined since
            refused = too_large(need, self.seen)
        if refused is not None:
            job.started = time.time()
            log.error("\t%s: refused before it was queued: %s", job.label, refused)
            self._refused.append(Ended(job, None, f"refused before it was queued: {refused}"))
            self.running.append(job)
            return True
        if self.parallel is not None and len(self.running) >= self.parallel:
            return False
        if not fits(need, self.nodes):
            if not self.running:
                # Nothing of the sweep runs, so no end will make room: the cluster is short
                # of nodes (one died, one is coming): look again in a moment.
                time.sleep(NO_ROOM_S)
                self._refresh()
            return False
        units = self._reserve(need)
        if units is None:  # held by someone else's tasks: asked again later
            return False
        job.handle = Placed(need, units)
        self._launch(job)
        self.running.append(job)
        return True

    def _reserve(self, need: Need) -> list[list[Unit]] | None:
        """The units of a job of ``need``, on the nodes with room for it as this sweep holds
        them: the idle units of ended jobs there first, new ones pinned to the node for the
        rest. None, holding nothing for the job, when no node has room or Ray did not place
        the new units within :data:`PLACE_WAIT_S` (another user's tasks hold those CPUs, or
        the node has just died)."""
        import ray

        chosen = self._choose(need)
        if chosen is None:
            return None
        taken: list[list[Unit]] = []
        new: list[Unit] = []
        for node in chosen:
            units = self._take_idle(node, need)
            with_gpu, cpu_only = need.units()
            more = [self._unit(node.id, True) for _ in range(with_gpu - sum(u.gpu for u in units))]
            more += [self._unit(node.id, False)
                     for _ in range(cpu_only - sum(not u.gpu for u in units))]
            taken.append(units + more)
            new += more
        if new:
            refs = [u.pg.ready() for u in new]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PLACE_WAIT_S)
            if len(ready) < len(refs):
                placed = set(ready)
                late = [u for u, ref in zip(new, refs, strict=True) if ref not in placed]
                self._give_back(late)
                self._park([u for units in taken for u in units if u not in late])
                # A node that died a moment ago is still listed alive until Ray misses its
                # heartbeats: the nodes are looked at again, and this one tried last.
                for unit in late:
                    self._late[unit.node] = time.monotonic()
                self._refresh()
                return None
        return taken

    def _choose(self, need: Need) -> list[Node] | None:
        """The nodes for a job of ``need``: those where this sweep has idle units first (the
        job starts in them without asking Ray), then the fullest that fits (a small job
        leaves the larger room to a larger one), a node where Ray was late of late last;
        None when too few have room."""
        room = [n for n in self.nodes if n.fits(need)]
        if len(room) < need.nodes:
            return None
        now = time.monotonic()
        idle = {n.id: sum(u.node == n.id for u in self.idle) for n in room}
        late = {i for i, when in self._late.items() if now - when < LATE_S}
        room.sort(key=lambda n: (n.id in late, -min(idle[n.id], need.cpus),
                                 n.cpus - n.used_cpus, n.gpus - n.used_gpus))
        return room[:need.nodes]

    def _take_idle(self, node: Node, need: Need) -> list[Unit]:
        """The idle units of ``node`` that a job of ``need`` uses there. The node's other idle
        units go back to the cluster when the job's new units need their room."""
        with_gpu, cpu_only = need.units()
        mine = [u for u in self.idle if u.node == node.id]
        take = [u for u in mine if u.gpu][:with_gpu] + [u for u in mine if not u.gpu][:cpu_only]
        rest = [u for u in mine if u not in take]
        self.idle = [u for u in self.idle if u.node != node.id]
        new_cpus = need.cpus - len(take)
        new_gpus = need.gpus - sum(u.gpu for u in take)
        held_cpus = node.used_cpus + len(take) + len(rest)
        held_gpus = node.used_gpus + sum(u.gpu for u in take) + sum(u.gpu for u in rest)
        if node.cpus - held_cpus < new_cpus or node.gpus - held_gpus < new_gpus:
            self._give_back(rest)
        else:
            self.idle += rest
        return take

    def _unit(self, node_id: str, gpu: bool) -> Unit:
        """A new unit on the node: a one-bundle placement group pinned there."""
        from ray.util.placement_group import placement_group

        bundle = {"CPU": 1.0, **({"GPU": 1.0} if gpu else {})}
        return Unit(node_id, gpu, placement_group([bundle],
                                                  bundle_label_selector=[{NODE_LABEL: node_id}]))

    def _park(self, units: Sequence[Unit]) -> None:
        """Keep ``units`` for the sweep's next jobs on their nodes, :data:`IDLE_S` at most."""
        now = time.monotonic()
        for unit in units:
            unit.idle_since = now
        self.idle += units

    def _give_back(self, units: Sequence[Unit]) -> None:
        """Hand ``units`` back to the cluster."""
        for unit in units:
            remove_group(unit.pg)
        gone = set(map(id, units))
        self.idle = [u for u in self.idle if id(u) not in gone]

    def _launch(self, job: Job) -> None:
        """Have the agents of a placed job's nodes start its processes."""
        import cloudpickle
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        placed: Placed = job.handle
        placed.replacing = False
        self._hold(placed, +1)
        need = placed.need
        placed.agents = [self._agent(node) for node in placed.nodes]
        # The GPU Ray gave each unit, as a task in it sees it (asked once a unit).
        unknown = [u for units in placed.units for u in units if u.gpu and u.gpu_id is None]
        if unknown:
            task = ray.remote(_gpu_ids)
            found = ray.get([task.options(
                num_cpus=0, num_gpus=1, max_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    u.pg, placement_group_bundle_index=0)).remote() for u in unknown], timeout=120)
            for unit, ids in zip(unknown, found, strict=True):
                unit.gpu_id = ids[0]
        gpu_ids = [[str(u.gpu_id) for u in units if u.gpu] if need.gpus else None
                   for units in placed.units]
        ranks: list[list[dict[str, str]]] = [[{}]]
        if need.nodes > 1:
            addr, port = ray.get(placed.agents[0].where.remote(), timeout=120)
            ranks = world_ranks(need, addr, port)
            config = job.config
            assert config is not None, "a started job has its config"
            with open_dict(config):
                # The address the ranks meet at: what trainer.nodes>1 asks to be named.
                config.trainer.rdzv_endpoint = f"{addr}:{port}"
        job.started = time.time()
        env = {**job_env(job), "OMP_NUM_THREADS": str(need.cpus), "MKL_NUM_THREADS": str(need.cpus)}
        spec = pickle.dumps({"sys_path": list(sys.path), "cores": []})
        spec += cloudpickle.dumps(payload(self.hydra, job))
        ref = ray.put(spec)
        placed.key = f"{job.idx}.{placed.attempt}"
        placed.runs = [agent.run.remote(placed.key, ref, env, ranks[i], gpu_ids[i])
                       for i, agent in enumerate(placed.agents)]
        again = f", attempt {placed.attempt + 1}" if placed.attempt else ""
        log.info("\t%s  [Ray: %s on %s%s]", job.label, amount(need.cpus, need.gpus),
                 ", ".join(self._ip(n) for n in placed.nodes), again)

    def _hold(self, placed: Placed, sign: int) -> None:
        """Count a job's units as held (``+1``) or given back (``-1``) on their nodes."""
        for units in placed.units:
            for node in self.nodes:
                if node.id == units[0].node:
                    node.used_cpus = max(0.0, node.used_cpus + sign * len(units))
                    node.used_gpus = max(0.0, node.used_gpus + sign * sum(u.gpu for u in units))

    def _ip(self, node_id: str) -> str:
        """A node as the log names it: its address and the start of its id (the nodes of
        one machine share the address)."""
        ip = next((n.ip for n in self.nodes if n.id == node_id), "?")
        return f"{ip} (node {node_id[:8]})"

    def wait(self, timeout: float) -> list[Ended]:
        """The jobs that ended, the first Ray reports first, waiting up to ``timeout``
        seconds; their bundles are released."""
        import ray

        if self._refused:
            ended, self._refused = self._refused, []
            for end in ended:
                self.running.remove(end.job)
            return ended
        now = time.monotonic()
        self._give_back([u for u in self.idle if now - u.idle_since > IDLE_S])
        for job in self.running:
            if isinstance(job.handle, Placed) and job.handle.replacing:
                self._place_again(job)
        leads = {j.handle.runs[0]: j for j in self.running
                 if isinstance(j.handle, Placed) and j.handle.runs and not j.handle.replacing}
        if not leads:
            time.sleep(timeout)
            return []
        done, _ = ray.wait(list(leads), num_returns=1, timeout=timeout)
        ended = []
        for ref in done:
            job = leads[ref]
            end = self._ended(job)
            if end is not None:
                ended.append(end)
                self.running.remove(job)
        return ended

    def _ended(self, job: Job) -> Ended | None:
        """What a job whose rank-0 run returned left; None when it is placed again."""
        import cloudpickle
        import ray
        from ray.exceptions import RayError

        placed: Placed = job.handle
        try:
            out: dict[str, Any] = ray.get(placed.runs[0])
        except RayError as exc:
            lost = ", ".join(self._ip(n) for n in placed.nodes)
            why = f"its Ray node {lost} died or lost its agent ({_first_line(exc)})"
            for node, agent in zip(placed.nodes, placed.agents, strict=False):
                if self.agents.get(node) is agent:  # a node that lives on gets a new one
                    del self.agents[node]
            if placed.attempt < self.retries and job.stopping_since is None:
                self._replace(job, why)
                return None
            self._release(placed, kill=True)
            self._refresh()
            return Ended(job, None, why)
        if len(placed.runs) > 1:
            # The other nodes' ranks end with rank 0 (their collectives break if not).
            _, left = ray.wait(placed.runs[1:], num_returns=len(placed.runs) - 1,
                               timeout=FOLLOWERS_GRACE_S)
            if left:
                for agent in placed.agents[1:]:
                    agent.signal.remote(placed.key, signal.SIGKILL)
        self._release(placed)
        code = out["codes"][0]
        name = _signal_name(-code) if code < 0 else None
        if out["result"] is not None:
            try:
                return Ended(job, cloudpickle.loads(out["result"]), signal=name)
            except Exception:
                pass  # a torn result: said as a process that left none
        if code < 0:
            return Ended(job, None, f"its process was killed by {name or f'signal {-code}'}", name)
        return Ended(job, None, f"its process exited with code {code} without a result")

    def _replace(self, job: Job, why: str) -> None:
        """Place a job whose node died again: it continues from its last checkpoint."""
        placed: Placed = job.handle
        self._release(placed, kill=True)
        self._refresh()
        placed.attempt += 1
        log.warning("\t#%d: %s; placing it again (hydra.launcher.retries=%d, retry %d), to "
                    "continue from its last checkpoint", job.idx, why, self.retries,
                    placed.attempt)
        config = job.config
        assert config is not None, "a started job has its config"
        with open_dict(config):
            if OmegaConf.select(config, "resume", default=None) in (None, "null"):
                config.resume = "auto"
        placed.agents, placed.runs = [], []
        placed.replacing = True

    def _place_again(self, job: Job) -> None:
        """Launch a job whose node died once some node has room for it again (the nodes are
        looked at again every :data:`NO_ROOM_S`: one may join)."""
        placed: Placed = job.handle
        if not fits(placed.need, self.nodes):
            if time.monotonic() - self._refreshed >= NO_ROOM_S:
                self._refresh()
            return
        units = self._reserve(placed.need)
        if units is not None:
            placed.units = units
            self._launch(job)

    def _release(self, placed: Placed, kill: bool = False) -> None:
        """Let go of a job's units: kept for the sweep's next job on their nodes, or, with
        ``kill`` (its node died, the sweep ends), its processes ended and the units handed
        back to the cluster."""
        self._hold(placed, -1)
        units = [u for node_units in placed.units for u in node_units]
        placed.units = []
        if kill:
            for agent in placed.agents:
                try:
                    agent.signal.remote(placed.key, signal.SIGKILL)
                except Exception:
                    pass
            self._give_back(units)
        else:
            self._park(units)
        placed.agents = []

    def stop(self, job: Job, force: bool = False) -> None:
        placed = job.handle
        if not isinstance(placed, Placed):
            return
        if placed.replacing:  # nothing runs yet: it ends now, unplaced
            placed.replacing = False
            self._refused.append(Ended(job, None, "it was stopped while waiting to be placed "
                                                  "again after its node died"))
            return
        for agent in placed.agents:
            try:
                agent.signal.remote(placed.key, signal.SIGKILL if force else signal.SIGTERM)
            except Exception:
                pass


def _gpu_ids() -> list[str]:
    """The GPUs Ray gave the task this runs as (a unit's, in its placement group)."""
    import ray

    return [str(i) for i in ray.get_gpu_ids()]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _signal_name(number: int) -> str | None:
    try:
        return signal.Signals(number).name
    except ValueError:
        return None
