"""One MLflow run per fedjax_pfl run (`--log mlflow`).

Where: $MLFLOW_TRACKING_URI when the user set it (a server, a database, ...), else a local
SQLite store in the run directory, `sqlite:///OUT/mlflow.db` (artifacts, none so far, under
OUT/mlartifacts); view it with `mlflow ui --backend-store-uri sqlite:///OUT/mlflow.db`.
Not `file:OUT/mlruns`: MLflow 3 keeps its file store in maintenance mode and refuses to open one
unless MLFLOW_ALLOW_FILE_STORE=true is set (a user's MLFLOW_TRACKING_URI=file:... still works
with that variable). The experiment is $MLFLOW_EXPERIMENT_NAME, else "fedjax_pfl".

What:
  * params: the configuration record (config.json) flattened with "." ("hparams.eta_local",
    "rounds", "seed", "data.…"); values longer than MLflow's MAX_PARAM_VAL_LENGTH are cut to it.
  * metrics: `callbacks.scalars(row)` every round with step = the round; at the end the
    summary's numbers except "last" (the rounds' own final values) as "summary.…" metrics
    ("summary.best.acc_mean", "summary.wall_time_s", …) at step = the last completed round.
  * status: FINISHED, or KILLED when summary["interrupted"].

Resume (RunStart.first_round > 0): the run whose id is in OUT/mlflow_run_id is set RUNNING again
and continued. MLflow keeps params immutable: keys already logged are not logged again, and a
setting the resume changed (--rounds) is kept as the tag "resumed.<key>". MLflow cannot delete
metric points, so a round after the checkpoint that the interrupted run had logged holds two
points at its step (the same values when the resumed run repeats the rounds exactly).
"""

from __future__ import annotations

import logging
import os
import pathlib
import re
import time
from typing import Any, Mapping

from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.tracking import MlflowClient
from mlflow.utils import validation

from fedjax_pfl.callbacks import Callback, RoundEnd, RunStart, scalars
from fedjax_pfl.sinks import _common

ID_FILE = "mlflow_run_id"
DEFAULT_EXPERIMENT = "fedjax_pfl"
_MAX_VALUE = getattr(validation, "MAX_PARAM_VAL_LENGTH", 6000)
_MAX_KEY = getattr(validation, "MAX_ENTITY_KEY_LENGTH", 250)
_PER_BATCH = getattr(validation, "MAX_PARAMS_TAGS_PER_BATCH", 100)
_METRICS_PER_BATCH = getattr(validation, "MAX_METRICS_PER_BATCH", 1000)


def tracking_uri(out: str) -> str:
    """$MLFLOW_TRACKING_URI when set, else the SQLite store OUT/mlflow.db."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.abspath(out)}/mlflow.db"


class Sink(Callback):
    """Logs params, per-round metrics and the summary into one MLflow run."""

    def __init__(self, out: str | None, quiet: bool = False) -> None:   # (it prints nothing)
        self.out = out
        self.client: MlflowClient | None = None
        self.run_id: str | None = None
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # The default SQLite store needs these (mlflow-skinny leaves them out); importing
            # them now lets `sinks.make` name the extra before any training starts.
            import alembic  # noqa: F401
            import sqlalchemy  # noqa: F401

    def on_run_start(self, start: RunStart) -> None:
        out = _common.run_dir(self.out, start.out, "mlflow")
        default_store = not os.environ.get("MLFLOW_TRACKING_URI")
        # MLflow announces the tables it makes in a new SQLite store at INFO, through the
        # progress bar; a store it cannot open still raises.
        db_log = logging.getLogger("mlflow.store.db.utils")
        level = db_log.level
        db_log.setLevel(logging.WARNING)
        try:
            self.client = MlflowClient(tracking_uri=tracking_uri(out))
        finally:
            db_log.setLevel(level)
        id_file = os.path.join(out, ID_FILE)
        params = {_key(k): str(v)[:_MAX_VALUE] for k, v in _common.flatten(start.config).items()}
        self.run_id = _common.read_id(id_file) if start.first_round > 0 else None
        if self.run_id is not None:
            self.client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            logged = self.client.get_run(self.run_id).data.params
            tags = [RunTag(f"resumed.{k}", v) for k, v in params.items()
                    if k in logged and logged[k] != v]
            tags.append(RunTag("resumed_at_round", str(start.first_round)))
            params = {k: v for k, v in params.items() if k not in logged}
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
            experiment = self.client.get_experiment_by_name(name)
            if experiment is not None:
                experiment_id = experiment.experiment_id
            else:
                artifacts = (pathlib.Path(out).resolve() / "mlartifacts").as_uri()
                experiment_id = self.client.create_experiment(
                    name, artifact_location=artifacts if default_store else None)
            run = self.client.create_run(experiment_id,
                                         run_name=os.path.basename(os.path.abspath(out)))
            self.run_id = run.info.run_id
            _common.write_id(id_file, self.run_id)
            tags = []
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, max(len(items), len(tags)), _PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + _PER_BATCH],
                                  tags=tags[i:i + _PER_BATCH])

    def on_round_end(self, event: RoundEnd) -> None:
        self._log_metrics(scalars(event.row), event.round)

    def on_run_end(self, summary: Mapping[str, Any]) -> None:
        if self.client is None:
            return
        numbers = {k: v for k, v in _common.flatten(
            {k: v for k, v in summary.items() if k != "last"}, prefix="summary.").items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self._log_metrics(numbers, int(summary.get("last_completed_round", 0)))
        status = RunStatus.KILLED if summary.get("interrupted") else RunStatus.FINISHED
        self.client.set_terminated(self.run_id, RunStatus.to_string(status))
        self.client = None

    def _log_metrics(self, values: Mapping[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        metrics = [Metric(_key(k), float(v), now, step) for k, v in values.items()]
        for i in range(0, len(metrics), _METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + _METRICS_PER_BATCH])


def _key(name: str) -> str:
    """`name` as an MLflow key: characters it refuses replaced by "_", cut to its key limit."""
    return re.sub(r"[^\w\-. /:]", "_", name)[:_MAX_KEY]
