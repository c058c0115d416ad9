"""Round statistics over clients (host side, numpy), and best-over-rounds bookkeeping.

Definitions (clients without test data are left out of every statistic):
  acc_mean       unweighted mean over clients of correct_i / n_i   (the papers' "mean accuracy")
  acc_weighted   Σ correct_i / Σ n_i                                 (sample-weighted)
  acc_std        population standard deviation over clients (ddof = 0)
  acc_min        lowest client accuracy
  acc_p10        10th percentile over clients (numpy's linear interpolation)
  acc_worst10    mean of the ⌈0.1·K⌉ lowest client accuracies (K clients with test data)
  loss           unweighted mean over clients of the mean test loss; loss_weighted: Σ/Σ n_i
`client_spread` gives the same acc_std, acc_worst10 and acc_min, and acc_max (the best client),
from one evaluation's per-client accuracies (the summary's "fairness", pFL-Bench's spread and
bottom decile). `first_round_reaching` is the convergence round (the first round whose metric
reaches a fraction of its best).
For per-token and multi-label tasks a "sample" above is a scored unit (a real token; a true tag
for recall@k) and the loss is per real token (`models.Model.metric` / `weight`).
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np


def summarize(correct, loss_sum, count, prefix: str = "", loss_count=None) -> dict[str, float]:
    """The statistics above for one evaluation; keys are prefixed with `prefix`. `count` is what
    accuracy divides by (test samples, or scored tokens / true tags); `loss_count` what the loss
    divides by when it differs (real tokens; None: `count`)."""
    correct = np.asarray(correct, np.float64)
    loss_sum = np.asarray(loss_sum, np.float64)
    count = np.asarray(count, np.float64)
    units = count if loss_count is None else np.asarray(loss_count, np.float64)
    has = count > 0
    if not has.any():
        return {}
    acc = correct[has] / count[has]
    loss = loss_sum[has] / np.maximum(units[has], 1e-300)
    stats = {
        "acc_mean": acc.mean(),
        "acc_weighted": correct[has].sum() / count[has].sum(),
        "acc_std": acc.std(),
        "acc_min": acc.min(),
        "acc_p10": np.percentile(acc, 10),
        "acc_worst10": worst_decile(acc),
        "loss": loss.mean(),
        "loss_weighted": loss_sum[has].sum() / units[has].sum(),
    }
    return {prefix + k: float(v) for k, v in stats.items()}


def worst_decile(acc: np.ndarray) -> float:
    """Mean of the ⌈0.1·K⌉ lowest of K accuracies: the bottom decile, at least one client
    (pFL-Bench's "bottom 10 %"; summary.json's and metrics.jsonl's acc_worst10)."""
    acc = np.sort(np.asarray(acc, np.float64))
    return float(acc[: max(1, math.ceil(0.1 * acc.size))].mean())


def client_spread(accuracy) -> dict[str, float | int]:
    """The spread of one evaluation's per-client accuracies (NaN: a client not evaluated, or
    without test data, left out as in `summarize`): "clients" K, "acc_mean", "acc_std"
    (population, ddof = 0), "acc_worst10" (`worst_decile`), "acc_min" (the worst client),
    "acc_max" (the best client). Empty where no client has an accuracy."""
    acc = np.asarray(accuracy, np.float64).ravel()
    acc = acc[~np.isnan(acc)]
    if acc.size == 0:
        return {}
    return {"clients": int(acc.size), "acc_mean": float(acc.mean()), "acc_std": float(acc.std()),
            "acc_worst10": worst_decile(acc), "acc_min": float(acc.min()),
            "acc_max": float(acc.max())}


def participation_split(accuracy, unseen) -> dict[str, float | int]:
    """One evaluation's accuracy split between the clients that may train and those held out
    (`unseen` [N] bool; NaN accuracies, clients not evaluated or without test data, left out):
    "acc_mean_seen" and "acc_mean_unseen" (unweighted means over clients, as acc_mean),
    "participation_gap" = acc_mean_seen − acc_mean_unseen (pFL-Bench's participation
    generalisation gap, Chen et al. 2022, §3.3: participating minus unseen clients' accuracy;
    positive where training on a client helps it), and the client counts "clients_seen",
    "clients_unseen". A side without an accuracy is left out, and the gap with it."""
    acc = np.asarray(accuracy, np.float64).ravel()
    unseen = np.asarray(unseen, bool).ravel()
    out: dict[str, float | int] = {}
    for name, side in (("seen", acc[~unseen]), ("unseen", acc[unseen])):
        side = side[~np.isnan(side)]
        out[f"clients_{name}"] = int(side.size)
        if side.size:
            out[f"acc_mean_{name}"] = float(side.mean())
    if "acc_mean_seen" in out and "acc_mean_unseen" in out:
        out["participation_gap"] = float(out["acc_mean_seen"]) - float(out["acc_mean_unseen"])
    return out


def rounds_trained(sampled, num_clients: int) -> np.ndarray:
    """[N] int: in how many of the logged rounds each client was sampled (`sampled` [R, M]
    ids, −1 for an empty Poisson slot), i.e. trained (client_metrics.npz's `rounds_trained`)."""
    ids = np.asarray(sampled).ravel()
    ids = ids[(ids >= 0) & (ids < num_clients)]
    return np.bincount(ids.astype(np.int64), minlength=num_clients).astype(np.int64)


def first_round_reaching(rows, key: str, fraction: float) -> tuple[float, int] | None:
    """(the threshold `fraction` · best, the first round whose `key` reaches it) over metric
    rows ({"round": r, key: value, …}; rows without `key`, or NaN, are skipped); None where no
    row has `key`. The convergence round of pFL-Bench's tables (there: 95 % of the best)."""
    seen = [(row["round"], float(row[key])) for row in rows
            if isinstance(row.get(key), (int, float)) and row[key] == row[key]]
    if not seen:
        return None
    threshold = fraction * max(v for _, v in seen)
    return threshold, next(r for r, v in seen if v >= threshold)


class History:
    """Per-round metrics plus the per-client best accuracy over rounds in which a client took part.

    `participant_best_mean` is pFedSOP's Table II statistic: for each client, the maximum of its
    accuracy over the evaluated rounds in which it was sampled; averaged (unweighted) over the
    clients that were ever evaluated after taking part.
    """

    def __init__(self, num_clients: int):
        self.rounds: list[dict[str, float]] = []
        self.best_when_sampled = np.full(num_clients, -np.inf)

    def record_participants(self, accuracy: np.ndarray, sampled: np.ndarray) -> dict[str, float]:
        """Updates per-client bests from this round's sampled clients; returns derived metrics."""
        accuracy = np.asarray(accuracy, np.float64)
        sampled = np.asarray(sampled)
        acc = accuracy[sampled]
        ok = ~np.isnan(acc)
        ids = sampled[ok]
        self.best_when_sampled[ids] = np.maximum(self.best_when_sampled[ids], acc[ok])
        seen = np.isfinite(self.best_when_sampled)
        out = {"participant_best_clients": int(seen.sum())}
        if seen.any():          # (a Poisson-sampled run may not have had a participant yet)
            out["participant_best_mean"] = float(self.best_when_sampled[seen].mean())
        if ok.any():
            out["acc_participants"] = float(acc[ok].mean())
        return out

    def append(self, metrics: Mapping[str, float]) -> None:
        self.rounds.append(dict(metrics))

    def best_and_last(self) -> dict[str, dict[str, float]]:
        """For every numeric metric: its best value over rounds (max; min for losses) and its last."""
        best: dict[str, float] = {}
        last: dict[str, float] = {}
        for row in self.rounds:
            for k, v in row.items():
                if k == "round" or not isinstance(v, (int, float)) or isinstance(v, bool):
                    continue
                if v != v:  # NaN
                    continue
                last[k] = v
                lower_is_better = "loss" in k or k.endswith("_std") or k.endswith("_time")
                if k not in best:
                    best[k] = v
                else:
                    best[k] = min(best[k], v) if lower_is_better else max(best[k], v)
        return {"best": best, "last": last}
