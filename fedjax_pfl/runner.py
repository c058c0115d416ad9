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
        self.partition.validate()
        return spec.resolve(self.hparams)


def load_data(cfg: RunConfig) -> tuple[FederatedData, dict[str, Any]]:
    """Reads the dataset (fails fast when absent) and builds the federated split."""
    from fedjax_pfl.data import sources

    raw = sources.load_raw(cfg.dataset, seed=cfg.seed, **cfg.data_options)
    n = int(np.asarray(raw.y).size)
    part = cfg.partition
    if part.scheme != "natural" and part.num_clients > n:
        raise ValueError(f"--clients {part.num_clients} is more than the {n} samples of {cfg.dataset}")
    return build_federated(raw, part)


def run(cfg: RunConfig, *, data: FederatedData | None = None, data_info: dict | None = None,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs `cfg` and returns the summary (also written to `cfg.out` when it is set)."""
    hparams = cfg.validate()
    if data is None:
        data, data_info = load_data(cfg)
    data_info = data_info or {}
    model_name = cfg.model or DEFAULT_MODEL.get(cfg.dataset, "mlp")
    model = models.get(model_name, data.input_shape, data.num_classes, cr=cfg.model_cr)
    algo = algorithms.get(cfg.algo, model=model, **hparams)
    out = cfg.out
    if out:
        os.makedirs(out, exist_ok=True)
        # A summary left by an earlier run in this directory no longer describes its files.
        stale_summary = os.path.join(out, "summary.json")
        if os.path.exists(stale_summary):
            os.remove(stale_summary)
        _write_json(os.path.join(out, "config.json"), _config_record(cfg, hparams, model_name, data_info))
        plot_label_distribution(label_counts(data, "all"), os.path.join(out, "label_distribution.png"),
                                title=f"{cfg.dataset}: {cfg.partition.scheme} partition")

    root = jax.random.key(cfg.seed)
    round_keys = jax.random.fold_in(root, 1)
    backend = hparams["backend"]
    t_start = time.perf_counter()
    state = algo.init(jax.random.fold_in(root, 0), data)
    if backend == "loop":
        round_step, evaluate = algo.round_fn, algo.evaluate
        compile_time = 0.0
    else:
        # With several devices the engine splits clients across them; data and state then live
        # on every device once instead of being copied there on every round.
        mesh = core.client_mesh()
        data, state = core.replicate((data, state), mesh)
        everywhere = None if mesh is None else core.replicated_sharding(mesh)
        t0 = time.perf_counter()
        round_step = jax.jit(algo.round_fn, donate_argnums=0, out_shardings=everywhere).lower(
            state, data, jax.random.fold_in(round_keys, 0)).compile()
        evaluate = jax.jit(algo.evaluate).lower(state, data).compile()
        compile_time = time.perf_counter() - t0

    history = core.History(data.num_clients)
    sampled_log, acc_log, eval_rounds = [], [], []
    metrics_path = os.path.join(out, "metrics.jsonl") if out else None
    metrics_file = open(metrics_path, "w") if metrics_path else None
    bar = _progress(cfg.rounds, cfg.progress)
    train_time = eval_time = 0.0
    total_steps = 0
    num_sampled = None
    try:
        for r in range(cfg.rounds):
            t0 = time.perf_counter()
            state, m = round_step(state, data, jax.random.fold_in(round_keys, r))
            m = jax.device_get(m)
            round_time = time.perf_counter() - t0
            train_time += round_time
            sampled = np.asarray(m["sampled"])
            num_sampled = sampled.size
            losses = np.asarray(m["train_loss"], np.float64)
            if not np.all(np.isfinite(losses)):
                trained = np.asarray(m.get("trained", sampled))  # TDPFed trains every client
                bad = trained[~np.isfinite(losses)].tolist()
                raise NonFiniteError(
                    f"round {r + 1}: clients {bad} have a non-finite training loss; lower --lr "
                    "or check the data")
            steps = int(m["client_steps"])
            total_steps += steps
            row: dict[str, Any] = {"round": r + 1, "train_loss": float(losses.mean()),
                                   "client_steps": steps, "round_time": round_time}
            row.update(_scalar_metrics(m))
            sampled_log.append(sampled)
            if (r + 1) % cfg.eval_every == 0 or r + 1 == cfg.rounds:
                t1 = time.perf_counter()
                evals = jax.device_get(evaluate(state, data))
                eval_time += time.perf_counter() - t1
                client = evals["client"]
                row.update(core.summarize(client.correct, client.loss_sum, client.count))
                accuracy = np.asarray(client.correct) / np.maximum(np.asarray(client.count), 1)
                accuracy = np.where(np.asarray(client.count) > 0, accuracy, np.nan)
                row.update(history.record_participants(accuracy, sampled))
                for name, ev in evals.items():
                    if name != "client":
                        row.update(core.summarize(ev.correct, ev.loss_sum, ev.count, prefix=f"{name}_"))
                acc_log.append(accuracy)
                eval_rounds.append(r + 1)
            history.append(row)
            if metrics_file:
                metrics_file.write(json.dumps(row) + "\n")
                metrics_file.flush()
            if bar is not None:
                bar.set_postfix(loss=f"{row['train_loss']:.3f}",
                                acc=f"{row['acc_mean']:.3f}" if "acc_mean" in row else "-")
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        if metrics_file:
            metrics_file.close()
        if out and sampled_log:
            np.savez_compressed(
                os.path.join(out, "client_metrics.npz"), sampled=np.stack(sampled_log),
                eval_rounds=np.asarray(eval_rounds, np.int32),
                accuracy=np.stack(acc_log) if acc_log else np.zeros((0, data.num_clients)))

    wall = time.perf_counter() - t_start
    rounds_after_first = history.rounds[1:] if len(history.rounds) > 1 else history.rounds
    per_round = float(np.median([row["round_time"] for row in rounds_after_first]))
    summary = {
        "algo": cfg.algo, "dataset": cfg.dataset, "model": model_name, "rounds": cfg.rounds,
        "clients": data.num_clients, "clients_per_round": num_sampled, "backend": backend,
        **history.best_and_last(),
        "wall_time_s": wall, "compile_time_s": compile_time, "train_time_s": train_time,
        "eval_time_s": eval_time, "time_per_round_s": per_round,
        "client_steps_per_s": total_steps / max(train_time, 1e-9),
        "devices": [str(d) for d in jax.devices()],
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
