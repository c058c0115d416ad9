"""Runs an algorithm for R rounds: jit once, log every round, write the run's files.

Output directory:
  config.json             the resolved configuration (data, algorithm hyperparameters, versions)
  metrics.jsonl           one JSON object per round
  summary.json            best-over-rounds and last metrics, wall/compile/round times, throughput
  client_metrics.npz      per-round sampled ids and per-client accuracy (to recompute any statistic)
  learning_curve.png      accuracy and loss against rounds
  label_distribution.png  clients × classes sample counts
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfl import algorithms, core, models
from fedjax_pfl.data.build import PartitionConfig, build_federated, plot_label_distribution
from fedjax_pfl.data.federated import FederatedData, label_counts


class NonFiniteError(FloatingPointError):
    """Training produced NaN/Inf; the message names the round and the clients."""


DEFAULT_MODEL = {"digits": "mlp", "synthetic": "logreg", "mnist": "mlp", "fashion_mnist": "mlp",
                 "emnist": "mlp", "cifar10": "cnn", "cifar100": "cnn"}


@dataclasses.dataclass
class RunConfig:
    """Everything a run needs. `hparams` holds the algorithm's hyperparameters (CLI or notebook)."""

    algo: str = "fedavg"
    dataset: str = "digits"
    model: str | None = None
    model_cr: float = 2.0
    partition: PartitionConfig = dataclasses.field(default_factory=PartitionConfig)
    rounds: int = 50
    seed: int = 0
    eval_every: int = 1
    eval_clients: str = "all"
    rounds_per_call: int = 1
    state_dtype: str = "float32"
    memory_check: bool = True
    out: str | None = None
    hparams: dict[str, Any] = dataclasses.field(default_factory=dict)
    data_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    progress: bool = True

    def validate(self) -> dict[str, Any]:
        """Checks everything that needs no data; returns the resolved algorithm hyperparameters."""
        spec = algorithms.spec(self.algo)
        if self.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {self.rounds}")
        if self.eval_every < 1:
            raise ValueError(f"--eval-every must be >= 1, got {self.eval_every}")
        if self.model is not None and self.model not in models.MODELS:
            raise ValueError(f"--model must be one of {list(models.MODELS)}, got {self.model!r}")
        if not self.model_cr >= 1:
            raise ValueError(f"--model-cr must be >= 1, got {self.model_cr}")
        if self.state_dtype not in core.STATE_DTYPES:
            raise ValueError(f"--state-dtype must be one of {list(core.STATE_DTYPES)}, "
                             f"got {self.state_dtype!r}")
        if self.rounds_per_call < 1:
            raise ValueError(f"--rounds-per-call must be >= 1, got {self.rounds_per_call}")
        if self.eval_every % self.rounds_per_call:
            raise ValueError(f"--eval-every {self.eval_every} must be a multiple of "
                             f"--rounds-per-call {self.rounds_per_call} (evaluation runs between calls)")
        _eval_clients(self.eval_clients)
        self.partition.validate()
        hparams = spec.resolve(self.hparams)
        if self.rounds_per_call > 1 and hparams["backend"] == "loop":
            raise ValueError("--rounds-per-call needs --backend chunked or vmap (the loop backend "
                             "runs one client at a time from Python)")
        return hparams


def _eval_clients(value: str) -> str | int:
    """'all', 'participants', or K (a fixed random subset of K clients)."""
    value = str(value)
    if value in ("all", "participants"):
        return value
    try:
        k = int(value)
    except ValueError:
        raise ValueError(f"--eval-clients must be 'all', 'participants' or a number of clients, "
                         f"got {value!r}") from None
    if k < 1:
        raise ValueError(f"--eval-clients must be >= 1, got {k}")
    return k


def load_data(cfg: RunConfig) -> tuple[FederatedData, dict[str, Any]]:
    """Reads the dataset (fails fast when absent) and builds the federated split."""
    from fedjax_pfl.data import sources

    raw = sources.load_raw(cfg.dataset, seed=cfg.seed, **cfg.data_options)
    n = int(np.asarray(raw.y).size)
    part = cfg.partition
    if part.scheme != "natural" and part.num_clients > n:
        raise ValueError(f"--clients {part.num_clients} is more than the {n} samples of {cfg.dataset}")
    return build_federated(raw, part)


@dataclasses.dataclass
class Prepared:
    """A run after its checks: data on device, the algorithm, its compiled program."""

    cfg: RunConfig
    hparams: dict[str, Any]
    data: FederatedData
    data_info: dict[str, Any]
    model_name: str
    algo: Any
    program: core.Program
    root: jax.Array
    round_keys: jax.Array
    eval_ids: np.ndarray | None        # a fixed evaluation subset (--eval-clients K), or None


def prepare(cfg: RunConfig, data: FederatedData | None = None, data_info: dict | None = None) -> Prepared:
    """Phase 1: validate, load the data, build the model, the algorithm and its program."""
    hparams = cfg.validate()
    if data is None:
        data, data_info = load_data(cfg)
    model_name = cfg.model or DEFAULT_MODEL.get(cfg.dataset, "mlp")
    model = models.get(model_name, data.input_shape, data.num_classes, cr=cfg.model_cr)
    algo = algorithms.get(cfg.algo, model=model, **hparams)
    vectorised = hparams["backend"] != "loop"
    mesh = core.client_mesh() if vectorised else None
    data = core.prepare_data(data, mesh)
    program = core.Program(algo, data, mesh=mesh, jit=vectorised, state_dtype=cfg.state_dtype,
                           rounds_per_call=cfg.rounds_per_call)
    root = jax.random.key(cfg.seed)
    subset = _eval_clients(cfg.eval_clients)
    eval_ids = None
    if isinstance(subset, int):
        if subset > data.num_real_clients:
            raise ValueError(f"--eval-clients {subset} is more than the {data.num_real_clients} clients")
        rng = np.random.default_rng(cfg.seed + 7)
        eval_ids = np.sort(rng.choice(data.num_real_clients, subset, replace=False)).astype(np.int32)
    return Prepared(cfg, hparams, data, data_info or {}, model_name, algo, program, root,
                    jax.random.fold_in(root, 1), eval_ids)


def run(cfg: RunConfig, *, data: FederatedData | None = None, data_info: dict | None = None,
        log: Callable[[str], None] = print, prepared: Prepared | None = None) -> dict[str, Any]:
    """Runs `cfg` and returns the summary (also written to `cfg.out` when it is set).
    `prepared` is the result of `prepare(cfg, …)` when the caller already has it."""
    t_start = time.perf_counter()
    prep = prepared or prepare(cfg, data, data_info)
    program, data = prep.program, prep.data
    primary = jax.process_index() == 0       # in a multi-process run only process 0 writes
    out = cfg.out if primary else None
    if not primary:
        log = lambda *_: None
    init_key = jax.random.fold_in(prep.root, 0)
    state = None
    if not program.traceable_init:     # e.g. FedPC's host-side graph: shapes known after init
        state = program.init(init_key)
    compile_time = program.compile(prep.round_keys)                     # phase 2: compile, plan
    plan = program.memory_plan()
    if cfg.progress or cfg.memory_check:
        log(plan.describe())
    if cfg.memory_check:
        core.check_memory(plan)
    if out:
        os.makedirs(out, exist_ok=True)
        # A summary left by an earlier run in this directory no longer describes its files.
        stale_summary = os.path.join(out, "summary.json")
        if os.path.exists(stale_summary):
            os.remove(stale_summary)
        _write_json(os.path.join(out, "config.json"),
                    _config_record(cfg, prep.hparams, prep.model_name, prep.data_info))
        plot_label_distribution(label_counts(data, "all")[: data.num_real_clients],
                                os.path.join(out, "label_distribution.png"),
                                title=f"{cfg.dataset}: {cfg.partition.scheme} partition")

    if state is None:
        state = program.init(init_key)                                   # phase 3: rounds
    n_real = data.num_real_clients
    history = core.History(n_real)
    sampled_log, acc_log, eval_rounds = [], [], []
    metrics_file = open(os.path.join(out, "metrics.jsonl"), "w") if out else None
    bar = _progress(cfg.rounds, cfg.progress and primary)
    train_time = eval_time = 0.0
    total_steps = 0
    num_sampled = None
    try:
        r = 0
        while r < cfg.rounds:
            count = min(cfg.rounds_per_call, cfg.rounds - r)
            t0 = time.perf_counter()
            state, per_round = program.run_rounds(state, prep.round_keys, r, count)
            call_time = time.perf_counter() - t0
            train_time += call_time
            for i, m in enumerate(per_round):
                row = _round_row(r + i + 1, m, call_time / count)
                sampled = np.asarray(m["sampled"])
                num_sampled = sampled.size
                total_steps += row["client_steps"]
                sampled_log.append(sampled)
                last_of_call = i == len(per_round) - 1
                if last_of_call and ((r + count) % cfg.eval_every == 0 or r + count == cfg.rounds):
                    t1 = time.perf_counter()
                    ids = _eval_ids(prep, sampled, final=r + count == cfg.rounds)
                    evals = program.evaluate(state, ids)
                    eval_time += time.perf_counter() - t1
                    accuracy = _record_evaluation(row, evals, ids, n_real, history, sampled)
                    acc_log.append(accuracy)
                    eval_rounds.append(r + i + 1)
                history.append(row)
                if metrics_file:
                    metrics_file.write(json.dumps(row) + "\n")
                    metrics_file.flush()
                if bar is not None:
                    bar.set_postfix(loss=f"{row['train_loss']:.3f}",
                                    acc=f"{row['acc_mean']:.3f}" if "acc_mean" in row else "-")
                    bar.update(1)
            r += count
    finally:
        if bar is not None:
            bar.close()
        if metrics_file:
            metrics_file.close()
        if out and sampled_log:
            np.savez_compressed(
                os.path.join(out, "client_metrics.npz"), sampled=np.stack(sampled_log),
                eval_rounds=np.asarray(eval_rounds, np.int32),
                accuracy=np.stack(acc_log) if acc_log else np.zeros((0, n_real)))

    wall = time.perf_counter() - t_start                                 # phase 4: report
    rounds_after_first = history.rounds[1:] if len(history.rounds) > 1 else history.rounds
    per_round = float(np.median([row["round_time"] for row in rounds_after_first]))
    summary = {
        "algo": cfg.algo, "dataset": cfg.dataset, "model": prep.model_name, "rounds": cfg.rounds,
        "clients": n_real, "clients_per_round": num_sampled, "backend": prep.hparams["backend"],
        **history.best_and_last(),
        "wall_time_s": wall, "compile_time_s": compile_time, "train_time_s": train_time,
        "eval_time_s": eval_time, "time_per_round_s": per_round,
        "client_steps_per_s": total_steps / max(train_time, 1e-9),
        "devices": [str(d) for d in jax.devices()],
        "memory_plan": dataclasses.asdict(plan),
    }
    communication = _communication_totals(history.rounds)
    if communication:
        summary["communication"] = communication
    if out:
        _write_json(os.path.join(out, "summary.json"), summary)
        plot_learning_curves({cfg.algo: history.rounds}, os.path.join(out, "learning_curve.png"),
                             title=f"{cfg.algo} on {cfg.dataset}",
                             acc_keys=("acc_mean", "acc_worst10", "global_acc_mean"))
    return summary


def _round_row(round_number: int, m: dict, round_time: float) -> dict[str, Any]:
    """One metrics.jsonl row from a round's metrics; stops the run on a non-finite loss."""
    sampled = np.asarray(m["sampled"])
    losses = np.asarray(m["train_loss"], np.float64)
    if not np.all(np.isfinite(losses)):
        trained = np.asarray(m.get("trained", sampled))  # TDPFed trains every client
        bad = trained[~np.isfinite(losses)].tolist()
        raise NonFiniteError(f"round {round_number}: clients {bad} have a non-finite training "
                             "loss; lower --lr or check the data")
    row: dict[str, Any] = {"round": round_number, "train_loss": float(losses.mean()),
                           "client_steps": int(m["client_steps"]), "round_time": round_time}
    row.update(_scalar_metrics(m))
    return row


def _eval_ids(prep: Prepared, sampled: np.ndarray, *, final: bool) -> np.ndarray | None:
    """The clients evaluated this time: all at the last round, else per --eval-clients."""
    if final or prep.cfg.eval_clients == "all":
        return None
    if prep.cfg.eval_clients == "participants":
        return np.asarray(sampled, np.int32)
    return prep.eval_ids


def _record_evaluation(row: dict, evals: dict, ids, n_real: int, history, sampled) -> np.ndarray:
    """Adds the evaluation statistics to `row`; returns the per-client accuracy [n_real] (NaN
    for clients not evaluated this time)."""
    client = evals["client"]
    correct, count = np.asarray(client.correct), np.asarray(client.count)
    accuracy = np.full(n_real, np.nan)
    acc = np.where(count > 0, correct / np.maximum(count, 1), np.nan)
    where = np.arange(n_real) if ids is None else np.asarray(ids)
    accuracy[where] = acc[: len(where)]
    row.update(core.summarize(client.correct, client.loss_sum, client.count))
    row["eval_clients"] = int(np.sum(count > 0))
    row.update(history.record_participants(accuracy, sampled))
    for name, ev in evals.items():
        if name != "client":
            row.update(core.summarize(ev.correct, ev.loss_sum, ev.count, prefix=f"{name}_"))
    return accuracy


def _communication_totals(rows: list[dict]) -> dict[str, float]:
    """Every per-round `comm_*` metric summed over the rounds run (floats or bits sent), and
    its per-round mean as `<name>_per_round`."""
    totals: dict[str, float] = {}
    for row in rows:
        for k, v in row.items():
            if k.startswith("comm_"):
                totals[k] = totals.get(k, 0.0) + float(v)
    out = {}
    for k, v in sorted(totals.items()):
        out[f"{k[5:]}_total"] = v
        out[f"{k[5:]}_per_round"] = v / max(len(rows), 1)
    return out


def _scalar_metrics(m: dict) -> dict[str, float]:
    """Algorithm-specific scalar metrics (everything but the standard per-client arrays)."""
    out = {}
    for k, v in m.items():
        if k in ("sampled", "trained", "train_loss", "client_steps"):
            continue
        v = np.asarray(v)
        if v.ndim == 0:
            out[k] = float(v)
    return out


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    import sys

    # In a log file (CI) a redraw per round floods the output; redraw at most every 5 s there.
    interval = 0.1 if sys.stderr.isatty() else 5.0
    return tqdm(total=total, desc="rounds", unit="round", dynamic_ncols=True, mininterval=interval)


def plot_learning_curves(runs: dict[str, list[dict]], path: str, title: str = "",
                         acc_keys: tuple[str, ...] = ("acc_mean",)) -> None:
    """Accuracy (each of `acc_keys`) and mean local training loss against rounds, for one or
    several runs (label -> per-round metric rows), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(12, 4.2))
    styles = ("-", ":", "--", "-.")
    palette = plt.get_cmap("tab10" if len(runs) <= 10 else "tab20").colors
    for (label, rows), color in zip(runs.items(), palette * (1 + len(runs) // len(palette))):
        for key, style in zip(acc_keys, styles):
            pts = [(r["round"], r[key]) for r in rows if key in r]
            if pts:
                name = key if len(runs) == 1 else (label if len(acc_keys) == 1 else f"{label} {key}")
                ax_acc.plot(*zip(*pts), style, label=name,
                            color=None if len(runs) == 1 else color)
        ax_loss.plot([r["round"] for r in rows], [r["train_loss"] for r in rows], label=label,
                     color=color)
    ax_acc.set_xlabel("round")
    ax_acc.set_ylabel("client test accuracy")
    ax_acc.legend(fontsize=8)
    ax_acc.grid(alpha=0.3)
    ax_loss.set_xlabel("round")
    ax_loss.set_ylabel("mean local training loss")
    ax_loss.set_yscale("log")
    if len(runs) > 1:
        ax_loss.legend(fontsize=8)
    ax_loss.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _config_record(cfg: RunConfig, hparams: dict, model_name: str, data_info: dict) -> dict:
    record = dataclasses.asdict(cfg)
    record["hparams"] = hparams
    record["model"] = model_name
    record["data"] = data_info
    record["versions"] = {"python": platform.python_version(), "jax": jax.__version__,
                          "numpy": np.__version__}
    return record


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=_json_default)
        f.write("\n")


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)
