"""The metric sinks (fedjax_pfl/sinks/), each read back with the tool's own reader.

Every sink is driven through the callback protocol with the same story: a run that logs rounds
1-4 and is interrupted, then resumed from its round-2 checkpoint with different numbers for
rounds 3-6 (so that a test can tell which session a value came from), then finished. What each
tool reads back is compared, step by step, with the numbers sent, which the test writes down
itself (ROWS_A, ROWS_B): TensorBoard's EventAccumulator, MLflow's MlflowClient on the store the
sink wrote, and W&B's own reader of offline .wandb files (`wandb leet inspect --json`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import run as cli  # noqa: E402  (experiments/run.py)

from fedjax_pfl import sinks
from fedjax_pfl.callbacks import RoundEnd, RunStart

CONFIG = {
    "algo": "fedavg", "dataset": "digits", "rounds": 6, "seed": 3, "out": "ignored",
    "hparams": {"eta_local": 0.05, "local_epochs": 2, "prox": None, "drop_last": True},
    "data": {"partition": "dirichlet", "alpha": 0.3},
    "memory_check": False,        # booleans stay booleans: "True"/"False", never 1/0
    "devices": ["cpu:0", "cpu:1"],
    # Longer than MLflow's 6000-character limit on a param value.
    "note": "n" * 7000,
}
# A resume may change --rounds (runner.RESUMABLE_CHANGES).
CONFIG_RESUMED = {**CONFIG, "rounds": 8}


def _row(r: int, session: int) -> dict:
    """Round r's metrics.jsonl row; accuracy only on even (evaluated) rounds. Values are not
    float32-representable (1/7, ...) and differ between the two sessions."""
    row = {"round": r, "train_loss": 1.0 / (7 * r + session), "client_steps": 10 * r + session,
           "round_time": 0.25 + r / 1000, "algo_note": "text", "stopped": False}
    if r % 2 == 0:
        row["acc_mean"] = r / 13 + session / 1000
    return row


ROWS_A = {r: _row(r, 1) for r in range(1, 5)}   # first session: rounds 1-4, then interrupted
ROWS_B = {r: _row(r, 2) for r in range(3, 7)}   # resumed after round 2: rounds 3-6
NUMERIC = ("train_loss", "client_steps", "round_time", "acc_mean")


def _summary(last_round: int, interrupted: bool) -> dict:
    return {"algo": "fedavg", "interrupted": interrupted, "last_completed_round": last_round,
            "best": {"acc_mean": 0.5}, "best_round": {"acc_mean": 4},
            "last": {"train_loss": 0.01}, "wall_time_s": 12.5, "devices": ["cpu:0"]}


def _drive(make_sink, out: str, between=None) -> None:
    """Session 1 (rounds 1-4, interrupted), `between()`, session 2 (resumed at 2, rounds 3-6).
    A fresh sink object per session, as a new process would make."""
    sink = make_sink()
    sink.on_run_start(RunStart(out, CONFIG, 0, 6))
    for r, row in ROWS_A.items():
        sink.on_round_end(RoundEnd(r, row, np.arange(3)))
    sink.on_run_end(_summary(4, interrupted=True))
    if between is not None:
        between()
    sink = make_sink()
    sink.on_run_start(RunStart(out, CONFIG_RESUMED, 2, 8))
    for r, row in ROWS_B.items():
        sink.on_round_end(RoundEnd(r, row, np.arange(3), final=r == 6))
    sink.on_run_end(_summary(6, interrupted=False))


def _expected_after_resume(key: str) -> dict[int, float]:
    """step -> value the resumed run stands for: rounds 1-2 from session 1, 3-6 from session 2."""
    rows = {**{r: ROWS_A[r] for r in (1, 2)}, **ROWS_B}
    return {r: float(row[key]) for r, row in rows.items() if key in row}


# --- --log and the missing-library message ---------------------------------------------------

def test_parse_log_flag_names_in_order_without_repeats():
    assert sinks.parse_log_flag("tensorboard,mlflow,wandb") == ("tensorboard", "mlflow", "wandb")
    assert sinks.parse_log_flag(" WandB , mlflow,wandb") == ("wandb", "mlflow")
    for nothing in ("", "none", "None", "  ", None):
        assert sinks.parse_log_flag(nothing) == ()


@pytest.mark.parametrize("text", ["tensorbord", "mlflow,csv", "none,wandb", "mlflow,,wandb"])
def test_parse_log_flag_rejects_unknown_names_in_one_line(text):
    with pytest.raises(ValueError) as e:
        sinks.parse_log_flag(text)
    message = str(e.value)
    assert "\n" not in message and message.startswith("log: unknown sink")
    assert cli.message(e.value).startswith("--log: unknown sink")      # run.py says its flag
    for name in sinks.SINKS:
        assert name in message


# Alembic stands for the SQLite store's libraries: poisoning SQLAlchemy itself would also change
# what MLflow registers, process-wide, the first time it looks (MLflow probes it with find_spec).
@pytest.mark.parametrize("sink,library", [("tensorboard", "tensorboard"), ("mlflow", "mlflow"),
                                          ("mlflow", "alembic"), ("wandb", "wandb")])
@pytest.mark.slow
def test_missing_library_names_the_extra(monkeypatch, tmp_path, sink, library):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # None in sys.modules makes `import library` raise ModuleNotFoundError, as when it is absent
    # (its submodules are dropped too: an imported one would be found without its parent); the
    # sink's module is dropped so that make() imports it afresh. monkeypatch puts all back.
    for name in [m for m in sys.modules if m.startswith(library + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, library, None)
    monkeypatch.delitem(sys.modules, f"fedjax_pfl.sinks.{sink}", raising=False)
    with pytest.raises(ImportError) as e:
        sinks.make([sink], str(tmp_path))
    message = str(e.value)
    assert "\n" not in message
    assert f'pip install "fedjax_pfl[{sink}]"' in message and library in message


def test_make_builds_one_callback_per_name(tmp_path):
    made = sinks.make(("tensorboard", "wandb"), str(tmp_path))
    assert [type(s).__module__ for s in made] == ["fedjax_pfl.sinks.tensorboard",
                                                  "fedjax_pfl.sinks.wandb"]
    with pytest.raises(ValueError, match="^log: unknown sink 'csv'"):
        sinks.make(["csv"], str(tmp_path))


def test_a_sink_made_without_out_writes_to_the_runs_out(tmp_path):
    [sink] = sinks.make(["tensorboard"], None)
    sink.on_run_start(RunStart(str(tmp_path / "run"), CONFIG, 0, 6))
    sink.on_run_end(_summary(0, interrupted=False))
    assert os.listdir(tmp_path / "run" / "tensorboard")
    [sink] = sinks.make(["tensorboard"], None)
    with pytest.raises(ValueError, match=r"^log tensorboard needs a run directory \(out\)"):
        sink.on_run_start(RunStart(None, CONFIG, 0, 6))


def test_flatten_keeps_booleans_as_booleans_and_numbers_as_numbers():
    """What the params of MLflow and TensorBoard's HParams are made from: a bool is a bool
    (True is also an int to Python, and must not become 1), an integer an int, a float a float,
    nested keys joined by the separator, anything else the config's compact JSON."""
    from fedjax_pfl.sinks import _common

    flat = _common.flatten({"on": True, "hp": {"off": False, "k": np.int64(3), "eta": 0.5,
                                               "name": "x", "none": None, "ids": [1, 2]}})
    assert flat == {"on": True, "hp.off": False, "hp.k": 3, "hp.eta": 0.5, "hp.name": "x",
                    "hp.none": "null", "hp.ids": "[1,2]"}
    assert {k: type(v) for k, v in flat.items()} == {
        "on": bool, "hp.off": bool, "hp.k": int, "hp.eta": float, "hp.name": str,
        "hp.none": str, "hp.ids": str}
    assert {str(flat[k]) for k in ("on", "hp.off")} == {"True", "False"}   # MLflow's params


# --- TensorBoard ------------------------------------------------------------------------------

def _tensorboard_accumulator(out):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(os.path.join(out, "tensorboard"),
                           size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_scalars_per_round_and_resume(tmp_path):
    out = str(tmp_path)
    from fedjax_pfl.sinks import tensorboard as tb_sink

    def after_first_session():
        acc = _tensorboard_accumulator(out)
        assert set(acc.Tags()["scalars"]) == set(NUMERIC)
        for key in NUMERIC:
            got = {e.step: e.value for e in acc.Scalars(key)}
            # TensorBoard keeps scalars as float32.
            assert got == {r: float(np.float32(row[key])) for r, row in ROWS_A.items()
                           if key in row}, key

    _drive(lambda: tb_sink.Sink(out), out, between=after_first_session)
    acc = _tensorboard_accumulator(out)
    assert set(acc.Tags()["scalars"]) == set(NUMERIC)   # no "round", no text or bool
    for key in NUMERIC:
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        # One value per step: the restart marker dropped session 1's rounds 3-4.
        expected = sorted((r, float(np.float32(v))) for r, v in _expected_after_resume(key).items())
        assert got == expected, key
    from tensorboard.util import tensor_util
    config = acc.Tensors("config")
    assert [e.step for e in config] == [0, 2]
    for event, record in zip(config, (CONFIG, CONFIG_RESUMED)):
        text = tensor_util.make_ndarray(event.tensor_proto).item().decode()
        assert json.loads(text) == record
    summary = acc.Tensors("summary")
    assert json.loads(tensor_util.make_ndarray(summary[-1].tensor_proto).item().decode()) == \
        _summary(6, interrupted=False)
    # The HParams dashboard's values keep their kinds: a boolean as a boolean, not 1/0.
    from tensorboard.plugins.hparams import metadata as hparams_metadata
    content = acc.SummaryMetadata(hparams_metadata.SESSION_START_INFO_TAG).plugin_data.content
    hparams = hparams_metadata.parse_session_start_info_plugin_data(content).hparams
    kinds = {k: (v.WhichOneof("kind"), getattr(v, v.WhichOneof("kind"))) for k, v in hparams.items()}
    assert kinds["hparams/drop_last"] == ("bool_value", True)
    assert kinds["memory_check"] == ("bool_value", False)
    assert kinds["hparams/local_epochs"] == ("number_value", 2.0)
    assert kinds["hparams/prox"] == ("string_value", "null")


# --- MLflow -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def empty_mlflow_db(tmp_path_factory):
    """An MLflow SQLite store with its tables made (MLflow's migrations take seconds; each test
    copies this file instead of making its own)."""
    from mlflow.tracking import MlflowClient
    path = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


def _metric_points(client, run_id, key) -> dict[int, list[float]]:
    points: dict[int, list[float]] = {}
    for m in client.get_metric_history(run_id, key):
        points.setdefault(m.step, []).append(m.value)
    return {step: sorted(values) for step, values in points.items()}


@pytest.mark.slow  # MLflow makes its SQLite tables once: 3-10 s
def test_mlflow_run_params_metrics_status_and_resume(tmp_path, monkeypatch, empty_mlflow_db):
    from mlflow.tracking import MlflowClient
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    from fedjax_pfl.sinks import mlflow as mlflow_sink
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    # MLflow then refuses an overlong param instead of cutting it itself: the sink must cut it.
    monkeypatch.setenv("MLFLOW_TRUNCATE_LONG_VALUES", "false")
    out = str(tmp_path)
    shutil.copy(empty_mlflow_db, tmp_path / "mlflow.db")
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    seen = {}

    def after_first_session():
        seen["run_id"] = open(os.path.join(out, "mlflow_run_id")).read().strip()
        run = client.get_run(seen["run_id"])
        assert run.info.status == "KILLED"
        for key in NUMERIC:
            assert _metric_points(client, seen["run_id"], key) == {
                r: [float(row[key])] for r, row in ROWS_A.items() if key in row}, key

    _drive(lambda: mlflow_sink.Sink(out), out, between=after_first_session)
    experiment = client.get_experiment_by_name("fedjax_pfl")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [seen["run_id"]]   # the resume continued it
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params == {
        "algo": "fedavg", "dataset": "digits", "rounds": "6", "seed": "3", "out": "ignored",
        "hparams.eta_local": "0.05", "hparams.local_epochs": "2", "hparams.prox": "null",
        "hparams.drop_last": "True", "memory_check": "False",
        "data.partition": "dirichlet", "data.alpha": "0.3", "devices": '["cpu:0","cpu:1"]',
        "note": "n" * MAX_PARAM_VAL_LENGTH}
    # Metrics are the rows' numbers and the summary's, never a boolean as 0/1 (the rows'
    # "stopped", the summary's "interrupted").
    assert set(run.data.metrics) == set(NUMERIC) | {
        "summary.last_completed_round", "summary.best.acc_mean", "summary.best_round.acc_mean",
        "summary.wall_time_s"}
    assert run.data.tags["resumed.rounds"] == "8" and run.data.tags["resumed_at_round"] == "2"
    for key in NUMERIC:
        got = _metric_points(client, run.info.run_id, key)
        # MLflow cannot delete points: rounds 3-4 hold session 1's and session 2's values.
        expected = {r: [v] for r, v in _expected_after_resume(key).items()}
        for r in (3, 4):
            if key in ROWS_A[r]:
                expected[r] = sorted([float(ROWS_A[r][key]), float(ROWS_B[r][key])])
        assert got == expected, key
    assert _metric_points(client, run.info.run_id, "summary.best.acc_mean") == {4: [0.5], 6: [0.5]}
    assert _metric_points(client, run.info.run_id, "summary.wall_time_s") == {4: [12.5], 6: [12.5]}
    assert "summary.last.train_loss" not in run.data.metrics


@pytest.mark.slow  # MLflow makes its SQLite tables once: 3-10 s
def test_mlflow_a_fresh_run_in_an_old_directory_gets_a_new_run(tmp_path, monkeypatch,
                                                               empty_mlflow_db):
    """A run that starts afresh (first_round = 0) where an earlier run left OUT/mlflow_run_id
    makes a new MLflow run (the earlier one keeps its own points and status) and keeps the new
    id; only a resume (first_round > 0) continues the run whose id is kept."""
    from mlflow.tracking import MlflowClient

    from fedjax_pfl.sinks import mlflow as mlflow_sink
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    out = str(tmp_path)
    shutil.copy(empty_mlflow_db, tmp_path / "mlflow.db")
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    id_file = os.path.join(out, "mlflow_run_id")

    def session(first_round, rows, interrupted):
        sink = mlflow_sink.Sink(out)
        sink.on_run_start(RunStart(out, CONFIG, first_round, 6))
        for r, row in rows.items():
            sink.on_round_end(RoundEnd(r, row, np.arange(3)))
        sink.on_run_end(_summary(max(rows), interrupted=interrupted))
        return open(id_file).read().strip()

    old = session(0, ROWS_A, interrupted=True)
    new = session(0, ROWS_B, interrupted=True)
    assert new != old
    experiment = client.get_experiment_by_name("fedjax_pfl")
    assert {r.info.run_id for r in client.search_runs([experiment.experiment_id])} == {old, new}
    for run_id, rows in ((old, ROWS_A), (new, ROWS_B)):
        assert _metric_points(client, run_id, "train_loss") == {
            r: [float(row["train_loss"])] for r, row in rows.items()}
    assert session(4, {5: ROWS_B[5]}, interrupted=False) == new
    assert client.get_run(new).info.status == "FINISHED"
    assert client.get_run(old).info.status == "KILLED"
    assert sorted(_metric_points(client, new, "train_loss")) == [3, 4, 5, 6]


@pytest.mark.slow  # MLflow makes its SQLite tables once: 3-10 s
def test_mlflow_uses_the_users_tracking_uri(tmp_path, monkeypatch, empty_mlflow_db):
    from mlflow.tracking import MlflowClient

    from fedjax_pfl.sinks import mlflow as mlflow_sink
    elsewhere = tmp_path / "server.db"
    shutil.copy(empty_mlflow_db, elsewhere)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{elsewhere}")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "mine")
    out = tmp_path / "run"
    sink = mlflow_sink.Sink(str(out))
    sink.on_run_start(RunStart(str(out), CONFIG, 0, 6))
    sink.on_round_end(RoundEnd(1, ROWS_A[1], np.arange(3)))
    sink.on_run_end(_summary(1, interrupted=False))
    assert not (out / "mlflow.db").exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{elsewhere}")
    [run] = client.search_runs([client.get_experiment_by_name("mine").experiment_id])
    assert _metric_points(client, run.info.run_id, "train_loss") == {1: [ROWS_A[1]["train_loss"]]}


# --- Weights & Biases -------------------------------------------------------------------------

def _wandb_records(run_dir) -> list[dict]:
    """The records of the run's .wandb file, decoded by W&B's own reader (wandb-core)."""
    [path] = [f for f in os.listdir(run_dir) if f.endswith(".wandb")]
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json",
                           os.path.join(run_dir, path)],
                          capture_output=True, text=True, timeout=120, check=True)
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture
def wandb_env(monkeypatch):
    for name in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")


@pytest.mark.slow  # two W&B service starts and two reader runs: 3-6 s
def test_wandb_offline_run_history_config_and_resume(tmp_path, wandb_env):
    from fedjax_pfl.sinks import wandb as wandb_sink
    out = str(tmp_path)
    _drive(lambda: wandb_sink.Sink(out), out)
    run_id = open(os.path.join(out, "wandb_run_id")).read().strip()
    run_dirs = sorted(os.path.join(out, "wandb", d) for d in os.listdir(os.path.join(out, "wandb"))
                      if d.startswith("offline-run-"))
    # Offline by default, and the resumed session wrote under the same run id.
    assert len(run_dirs) == 2 and all(d.endswith("-" + run_id) for d in run_dirs)
    for run_dir, rows, record, exit_code in ((run_dirs[0], ROWS_A, CONFIG, 130),
                                             (run_dirs[1], ROWS_B, CONFIG_RESUMED, 0)):
        records = _wandb_records(run_dir)
        [run] = [r["run"] for r in records if r["type"] == "run"]
        assert run["run_id"] == run_id and run["project"] == "fedjax_pfl"
        config = {k: v for k, v in run["config"]["update"].items() if k != "_wandb"}
        assert config == record
        history = {r["history"]["step"]["num"]: r["history"]["item"]
                   for r in records if r["type"] == "history"}
        assert sorted(history) == sorted(rows)
        for step, item in history.items():
            logged = {k: v for k, v in item.items() if not k.startswith("_")}
            assert logged == {k: float(rows[step][k]) for k in NUMERIC if k in rows[step]}
        summary = {}
        for r in records:
            if r["type"] == "summary":
                summary.update(r["summary"].get("update", {}))
        assert summary["best"] == {"acc_mean": 0.5} and summary["wall_time_s"] == 12.5
        assert summary["last_completed_round"] == max(rows)
        [exit_record] = [r["exit"] for r in records if r["type"] == "exit"]
        assert exit_record.get("exit_code", 0) == exit_code


def test_wandb_respects_the_users_mode(tmp_path, wandb_env, monkeypatch):
    from fedjax_pfl.sinks import wandb as wandb_sink
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = str(tmp_path)
    sink = wandb_sink.Sink(out)
    sink.on_run_start(RunStart(out, CONFIG, 0, 6))
    sink.on_round_end(RoundEnd(1, ROWS_A[1], np.arange(3)))
    sink.on_run_end(_summary(1, interrupted=False))
    assert not os.path.exists(os.path.join(out, "wandb", "latest-run"))


def test_wandb_is_silent_under_quiet(tmp_path, wandb_env, monkeypatch):
    """--quiet (sinks.make(..., quiet=True)): W&B is started with its silent setting (no banner,
    no sync hints); without it, W&B's own defaults."""
    from fedjax_pfl import sinks as sinks_lib
    from fedjax_pfl.sinks import wandb as wandb_sink

    started = []

    class _Run:
        id = "r1"

    monkeypatch.setattr(wandb_sink.wandb, "init", lambda **kw: started.append(kw) or _Run())
    out = str(tmp_path)
    for quiet in (True, False):
        [sink] = sinks_lib.make(["wandb"], out, quiet=quiet)
        sink.on_run_start(RunStart(out, CONFIG, 0, 6))
    assert started[0]["settings"].silent is True
    assert started[1]["settings"] is None
