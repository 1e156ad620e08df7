"""An MLflow tracking store as a logger: one MLflow run per ddpexp run or sweep job, the
resolved config as params, every metric point with its step, the status at the end.

It talks to the store through ``MlflowClient`` only (no ``mlflow.start_run`` process state).
The default store is a SQLite file, ``mlflow.db`` in the outputs root, shared by every run and
sweep job: :meth:`MLflowLogger.prepare` creates its schema and the experiment once, in the
launching process, and every database call retries while SQLite reports the database locked,
so jobs running at once share it safely. A store that cannot be used (a server that does not
answer, a database path that is missing, read-only or under a file) is refused there, in
seconds, naming ``logger.<name>.tracking_uri``. Points reach the logger from its writer
thread (:mod:`ddpexp.loggers.writer`), which hands them over in batches; :meth:`flush` sends
them. A resumed session continues the same MLflow run and drops re-logged points it already
stored.

mlflow is an optional dependency (``pip install -e ".[mlflow]"``), imported only when this
logger is built.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging
import os
import random
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import quote

from ddpexp.config.resume import flatten
from ddpexp.errors import ConfigError
from ddpexp.loggers.base import SUCCESS_STATUSES, Logger, RunInfo, StoreRefused

try:
    import fcntl
except ImportError:  # Windows: no lock around the first schema creation
    fcntl = None

log = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "ddpexp"
DB_NAME = "mlflow.db"
# How long a call keeps retrying while SQLite says the database is locked.
LOCK_RETRY_S = 60.0
# What prepare() allows a tracking server before refusing it: one try of 15 s per request (a
# loaded server may take seconds to answer its first one; the first that fails ends it); MLflow's
# own defaults, 7 retries with backoff and 120 s timeouts, take minutes and log every retry.
PREPARE_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}
STATUS_TAG = "ddpexp.status"
BEST_TAG = "ddpexp.best_checkpoint"
RUN_DIR_TAG = "ddpexp.run_dir"
ERROR_TAG = "ddpexp.error"

T = TypeVar("T")


def require_mlflow(module: str = "mlflow") -> Any:
    """Import mlflow (``module`` is its import name), or raise the ConfigError that says how
    to install it."""
    # MLflow 3 sends usage telemetry unless told not to; a run sends nothing anywhere unless
    # the user asks (set MLFLOW_DISABLE_TELEMETRY=false to allow it).
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(missing_message(exc)) from exc


def missing_message(exc: BaseException) -> str:
    """What to do when mlflow does not import."""
    return (f"the MLflow logger needs mlflow, which does not import here ({exc}): "
            'pip install -e ".[mlflow]" (or pip install "mlflow>=3"), '
            "or pick another logger (logger=tensorboard, logger=csv)")


def default_tracking_uri(outputs_root: Path) -> str:
    """``sqlite:///<outputs_root>/mlflow.db`` with an absolute path, the same in every
    process whatever its working dir."""
    return "sqlite:///" + str((Path(outputs_root) / DB_NAME).resolve())


def flatten_params(config: Mapping[str, Any]) -> dict[str, str]:
    """The config as MLflow params: nested keys joined by dots (``trainer.max_epochs``),
    values as ``str()`` gives them (lists whole, e.g. ``data.shape`` = ``[1, 8, 8]``), an empty
    dict as ``{}``."""
    return {key: str(value) for key, value in flatten(config).items()}


def end_state(status: str) -> str:
    """The MLflow run status for a ddpexp status."""
    if status in SUCCESS_STATUSES:
        return "FINISHED"
    return "KILLED" if status == "interrupted" else "FAILED"


def _is_lock_error(exc: BaseException) -> bool:
    """SQLite's "database is locked" (or table/schema locked), however MLflow wrapped it."""
    seen: BaseException | None = exc
    while seen is not None:
        text = str(seen).lower()
        if "database is locked" in text or "table is locked" in text or "schema is locked" in text:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def retry(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``call(*args, **kwargs)``, again with a growing random backoff while SQLite reports
    the database locked, for up to :data:`LOCK_RETRY_S` seconds; other errors at once."""
    deadline = time.monotonic() + LOCK_RETRY_S
    delay = 0.05
    while True:
        try:
            return call(*args, **kwargs)
        except Exception as exc:
            if not _is_lock_error(exc) or time.monotonic() > deadline:
                raise
            log.debug("%s: the database is locked; retrying", getattr(call, "__name__", call))
        time.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, 1.0)


def _sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///PATH`` URI (None for others and in-memory ones)."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def _path_problem(db: Path) -> str | None:
    """Why a SQLite database cannot be at ``db`` (missing dir, a dir under a file, a file
    or dir this process cannot write), or None."""
    db = db.expanduser().absolute()
    if db.is_dir():
        return f"{db} is a directory, not a database file"
    parent = db.parent
    for above in (parent, *parent.parents):
        if above.exists() and not above.is_dir():
            return f"{db} is under {above}, which is a file"
        if above.exists():
            break
    if not parent.is_dir():
        return f"the directory {parent} does not exist; create it or pick another path"
    try:  # SQLite writes its journal next to the database
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as exc:
        return f"cannot write in {parent} ({exc.strerror or exc})"
    if db.exists():
        try:
            with contextlib.closing(sqlite3.connect(str(db), timeout=1)) as con:
                con.execute("BEGIN IMMEDIATE")
                con.rollback()
        except sqlite3.OperationalError as exc:
            if not _is_lock_error(exc):  # locked: another job writes it, which is fine
                return f"cannot write {db} ({exc})"
        except sqlite3.DatabaseError as exc:
            return f"{db} is not an SQLite database ({exc})"
    return None


@contextlib.contextmanager
def _patient_once() -> Iterator[None]:
    """MLflow's HTTP client with :data:`PREPARE_ENV` for the calls inside (it reads them per
    request), the variables as they were afterwards."""
    before = {key: os.environ.get(key) for key in PREPARE_ENV}
    os.environ.update(PREPARE_ENV)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _store_ready(db: Path) -> bool:
    """Whether a process has already created and checked this store's schema: MLflow adds
    its Default experiment only after that, so a row in ``experiments`` says so."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{quote(str(db))}?mode=ro", uri=True, timeout=1)) as con:
            return con.execute("SELECT 1 FROM experiments LIMIT 1").fetchone() is not None
    except sqlite3.Error:
        return False


@contextlib.contextmanager
def _schema_lock(uri: str) -> Iterator[None]:
    """One process at a time opens a SQLite store whose schema may not exist yet (MLflow
    migrates an empty database when it first opens it, and two doing so at once collide).
    The lock is a file in the temp dir, keyed by the URI, so nothing appears next to the
    database; once the schema exists (prepare() made it) no lock is taken."""
    db = _sqlite_path(uri)
    if fcntl is None or db is None or _store_ready(db):
        yield
        return
    digest = hashlib.sha1(str(db.resolve()).encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"ddpexp-mlflow-{digest}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _experiment_id(client: Any, name: str) -> str:
    """The id of experiment ``name``, created if missing (another job may create it first)."""
    from mlflow.exceptions import MlflowException

    experiment = retry(client.get_experiment_by_name, name)
    if experiment is None:
        try:
            return retry(client.create_experiment, name)
        except MlflowException:
            experiment = retry(client.get_experiment_by_name, name)
            if experiment is None:
                raise
    if experiment.lifecycle_stage == "deleted":
        raise ConfigError(
            f"the MLflow experiment {name!r} is deleted: restore it "
            f"(mlflow experiments restore --experiment-id {experiment.experiment_id}) "
            "or pick another logger.mlflow.experiment_name")
    return experiment.experiment_id


def _open_store(uri: str, experiment_name: str) -> tuple[Any, str]:
    """A client of the store at ``uri`` and the experiment's id; the first call creates the
    schema of a new SQLite database."""
    require_mlflow()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    with _schema_lock(uri):
        experiment_id = _experiment_id(client, experiment_name)
    return client, experiment_id


def _key_problem(key: str) -> str | None:
    """Why MLflow would refuse ``key`` as a param or metric name (which fails the whole
    batch it is in), or None."""
    from mlflow.utils.validation import (
        MAX_ENTITY_KEY_LENGTH,
        path_not_unique,
        validate_param_and_metric_name,
    )

    if len(key) > MAX_ENTITY_KEY_LENGTH:
        return f"longer than MLflow's {MAX_ENTITY_KEY_LENGTH} characters"
    if not validate_param_and_metric_name(key) or path_not_unique(key):
        return ("not a name MLflow takes (letters, digits, _ - . / : and spaces, "
                "no leading /, no . or .. parts)")
    return None


def _chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


class MLflowLogger(Logger):
    """One MLflow run per ddpexp run: params, metric histories, status and end state.

    ``tracking_uri``: any MLflow tracking URI; ``None`` = ``sqlite:///<outputs root>/mlflow.db``.
    ``run_name``: ``None`` = the run's display name (its dir under the outputs root).
    Points go to the store in batches: the writer hands them over when ``flush_every_points``
    are waiting or ``flush_every_s`` seconds after the last batch, and at the end.
    """

    def __init__(self, tracking_uri: str | None = None,
                 experiment_name: str = DEFAULT_EXPERIMENT, run_name: str | None = None,
                 flush_every_points: int = 1000, flush_every_s: float = 10.0):
        require_mlflow()
        if isinstance(flush_every_points, bool) or not isinstance(flush_every_points, int) \
                or flush_every_points < 1:
            raise ConfigError(f"flush_every_points={flush_every_points!r} must be "
                              "a whole number >= 1 (metric points per batch)")
        if isinstance(flush_every_s, bool) or not isinstance(flush_every_s, (int, float)) \
                or flush_every_s < 0:
            raise ConfigError(f"flush_every_s={flush_every_s!r} must be >= 0 "
                              "(seconds between batches)")
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.flush_every_points = flush_every_points
        self.flush_every_s = float(flush_every_s)
        self.run_id: str | None = None
        self._uri: str | None = None
        self._saved: dict = {}
        self._client: Any = None
        self._run_dir: Path | None = None
        self._buffer: list = []
        # The last step stored for each key before this session (resume): re-logged points
        # at or before it are dropped.
        self._stored_steps: dict[str, int] = {}
        self._param_keys: set[str] = set()
        self._refused: set[str] = set()
        self._finalized = False

    @classmethod
    def prepare(cls, node: dict, outputs_root: Path) -> None:
        """Create the store's schema and the experiment before any job opens it; a store that
        cannot be used is refused in seconds (:class:`StoreRefused` naming ``tracking_uri``)."""
        given = node.get("tracking_uri")
        uri = given or default_tracking_uri(outputs_root)
        shown = uri if given else f"null ({uri})"
        db = _sqlite_path(uri)
        if db is not None and not given:  # the default store's dir is ddpexp's own to make
            db.parent.mkdir(parents=True, exist_ok=True)
        problem = _path_problem(db) if db is not None else None
        if problem:
            raise StoreRefused("tracking_uri", shown, problem)
        try:
            with _patient_once():
                _open_store(uri, node.get("experiment_name") or DEFAULT_EXPERIMENT)
        except ConfigError:
            raise
        except Exception as exc:
            what = ("the tracking server does not answer"
                    if uri.startswith(("http://", "https://")) else "the store cannot be opened")
            text = " ".join(str(exc).split())
            raise StoreRefused("tracking_uri", shown,
                               f"{what} ({type(exc).__name__}: {text[:300]})") from None

    @classmethod
    def record_refusal(cls, node: dict, run: RunInfo, error: str) -> None:
        """One MLflow run for the refused job: its config as params, tagged with its run dir,
        status ``failed`` and the error (``ddpexp.error``), ended as FAILED."""
        from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

        uri = node.get("tracking_uri") or default_tracking_uri(run.outputs_root)
        with _patient_once():
            client, experiment_id = _open_store(uri, node.get("experiment_name") or DEFAULT_EXPERIMENT)
            tags = {RUN_DIR_TAG: str(run.run_dir), STATUS_TAG: "failed",
                    ERROR_TAG: error[:MAX_TAG_VAL_LENGTH]}
            created = retry(client.create_run, experiment_id, tags=tags,
                            run_name=node.get("run_name") or run.name)
            logger = cls()
            logger._client, logger.run_id = client, created.info.run_id
            logger._log_params(flatten_params(run.config))
            retry(client.set_terminated, created.info.run_id, status="FAILED")

    def load_state_dict(self, state: dict) -> None:
        """The MLflow run id (and store) the checkpointed session wrote to."""
        self._saved = dict(state or {})

    def state_dict(self) -> dict:
        """The run id and store."""
        if self.run_id is None:
            return dict(self._saved)
        return {"run_id": self.run_id, "tracking_uri": self._uri}

    def open(self, run: RunInfo) -> None:
        """Continue the saved MLflow run when resuming, else start one with the config as
        params."""
        self._uri = self.tracking_uri or default_tracking_uri(run.outputs_root)
        self._run_dir = Path(run.run_dir)
        self._client, experiment_id = _open_store(self._uri, self.experiment_name)
        if run.resumed:
            run_id = self._saved.get("run_id") or self._find_run(experiment_id, run.run_dir)
            if self._continue(run_id):
                return
        tags = {RUN_DIR_TAG: str(run.run_dir), STATUS_TAG: "running"}
        created = retry(self._client.create_run, experiment_id, tags=tags,
                        run_name=self.run_name or run.name)
        self.run_id = created.info.run_id
        params = flatten_params(run.config)
        self._log_params(params)

    def _find_run(self, experiment_id: str, run_dir: Path) -> str | None:
        """The latest MLflow run tagged with ``run_dir``: for a checkpoint written without
        this logger's state (the logger was added on resume, or an older checkpoint)."""
        if "'" in str(run_dir):
            return None
        found = retry(self._client.search_runs, [experiment_id],
                      filter_string=f"tags.`{RUN_DIR_TAG}` = '{run_dir}'",
                      order_by=["attributes.start_time DESC"], max_results=1)
        return found[0].info.run_id if found else None

    def _continue(self, run_id: str | None) -> bool:
        """Reopen ``run_id`` and read the last step stored for each key; False (with a
        warning) when the store has no such run."""
        from mlflow.exceptions import MlflowException

        if not run_id:
            log.warning("logger.mlflow: neither the checkpoint nor the store names an MLflow "
                        "run of this run dir; this session starts a new MLflow run")
            return False
        try:
            stored = retry(self._client.get_run, run_id)
        except MlflowException:
            stored = None
        if stored is None or stored.info.lifecycle_stage == "deleted":
            log.warning("logger.mlflow: MLflow run %s (of %s) is not in %s; this session starts "
                        "a new MLflow run", run_id, self._saved.get("tracking_uri"), self._uri)
            return False
        self.run_id = run_id
        retry(self._client.update_run, run_id, status="RUNNING")
        retry(self._client.set_tag, run_id, STATUS_TAG, "running")
        for key in stored.data.metrics:
            history = retry(self._client.get_metric_history, run_id, key)
            if history:
                self._stored_steps[key] = max(m.step for m in history)
        return True

    def _accepts(self, key: str, what: str) -> bool:
        """False, with one warning per key, for a name MLflow would refuse."""
        if key in self._refused:
            return False
        problem = _key_problem(key)
        if problem is None:
            return True
        self._refused.add(key)
        log.warning("logger.mlflow: the %s %r is left out: %s", what, key[:300], problem)
        return False

    def _log_params(self, params: Mapping[str, str]) -> None:
        """Params in batches of MLflow's size limits; values cut to its length limit, names
        it refuses left out (with a warning)."""
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        batch = []
        for key, value in params.items():
            if not self._accepts(key, "param"):
                continue
            if len(value) > MAX_PARAM_VAL_LENGTH:
                value = value[:MAX_PARAM_VAL_LENGTH - 3] + "..."
            batch.append(Param(key, value))
            self._param_keys.add(key)
        for chunk in _chunks(batch, MAX_PARAMS_TAGS_PER_BATCH):
            retry(self._client.log_batch, self.run_id, params=chunk)

    def log_hparams(self, params: Mapping[str, Any]) -> None:
        """The overrides that are not config keys (group choices such as ``model=mlp``) as
        params too; the others are already params with their resolved values."""
        extra = {k: str(v) for k, v in params.items() if k not in self._param_keys}
        self._log_params(extra)

    def log_metrics(self, metrics: Mapping[str, float], step: int, epoch: int) -> None:
        """Buffer one point per name at ``step`` (MLflow has no epoch axis; the trainer logs
        ``epoch`` as a metric) for :meth:`flush`."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        for key, value in metrics.items():
            if step <= self._stored_steps.get(key, -1) or not self._accepts(key, "metric"):
                continue
            self._buffer.append(Metric(key, float(value), now, int(step)))

    def flush(self) -> None:
        """Send the buffered points, in batches of MLflow's limit. A batch that fails costs
        the whole buffer (the writer counts those points as lost): nothing is sent twice."""
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        buffer, self._buffer = self._buffer, []
        for chunk in _chunks(buffer, MAX_METRICS_PER_BATCH):
            retry(self._client.log_batch, self.run_id, metrics=chunk)

    def finalize(self, status: str) -> None:
        """Send the buffered points, then tag the status (and best.pt's path) and end the
        run, in that order: the run is ended only once its status tag says how, so the two
        never disagree. A failure is a warning: the tracker's trouble must not change how the
        run ends."""
        if self._finalized or self.run_id is None:
            self._finalized = True
            return
        self._finalized = True
        tags = {STATUS_TAG: status}
        best = cast(Path, self._run_dir) / "checkpoints" / "best.pt"  # set with run_id
        if best.exists():
            tags[BEST_TAG] = str(best.resolve())
        try:
            self.flush()
        except Exception as exc:
            log.warning("logger.mlflow: could not send the last metric points of MLflow run "
                        "%s: %s", self.run_id, exc)
        try:
            self._set_tags(tags)
            retry(self._client.set_terminated, self.run_id, status=end_state(status))
        except Exception as exc:
            log.warning("logger.mlflow: could not end MLflow run %s as %s: %s",
                        self.run_id, status, exc)

    def _set_tags(self, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        retry(self._client.log_batch, self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
