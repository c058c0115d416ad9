"""A sweep's results: one row per group's hyperparameters (mean ± std over the seeds), the
Markdown table, results.json and the learning curves."""

from __future__ import annotations

import os
from typing import Sequence

from fedjax_pfl.sweep.plan import Group


def _stat(values) -> str:
    import numpy as np

    values = [v for v in values if v is not None]
    if not values:
        return "–"
    return f"{100 * np.mean(values):.2f} ± {100 * np.std(values):.2f}"


def result_row(dataset: str, algo: str, label_: str, summaries: Sequence[dict]) -> dict:
    """One row of a sweep's table: the runs of one (dataset, algorithm, hyperparameters), mean ±
    std over their seeds of the best and last mean client accuracy (%), the last worst-10 % and
    global accuracy, and, for private runs, ε after the last round at δ."""
    get = lambda kind, key: [s[kind].get(key) for s in summaries]  # noqa: E731
    return {"dataset": dataset, "algo": algo, "hparams": label_ or "defaults",
            "seeds": len(summaries),
            "best": _stat(get("best", "acc_mean")), "last": _stat(get("last", "acc_mean")),
            "worst10": _stat(get("last", "acc_worst10")),
            "global": _stat(get("last", "global_acc_mean")), **_privacy_columns(summaries)}


def _privacy_columns(summaries) -> dict:
    """A private group's ε at δ after its last round (the same for every seed: ε depends on the
    noise multiplier, the clients per round, N, the rounds and δ); None: no noise, no bound."""
    if not any("privacy" in s for s in summaries):
        return {}
    eps = [s["privacy"]["dp_epsilon"] for s in summaries]
    return {"dp_epsilon": None if None in eps else max(eps),
            "dp_delta": summaries[0]["privacy"]["delta"]}


def group_results(group: Group, summaries: Sequence[dict]) -> tuple[list[dict], dict[str, list]]:
    """(one `result_row` per traced combination of `group`, each combination's runs' metrics
    rows by its curve name) from the group's run summaries (`run_group`'s, rows included)."""
    rows, curves = [], {}
    for tc in group.traced:
        name_ = group.label(tc)
        cell = [s for s in summaries if s["traced"] == tc]
        rows.append(result_row(group.dataset, group.algo, name_, cell))
        curves[f"{group.dataset} {group.algo} {name_}".strip()] = [s["rows"] for s in cell]
    return rows, curves


def results_table(rows: Sequence[dict]) -> str:
    """The rows as results.md: a Markdown table, with an ε column when any run is private."""
    private = any("dp_delta" in r for r in rows)
    eps = lambda r: ("—" if "dp_delta" not in r else "∞" if r["dp_epsilon"] is None  # noqa: E731
                     else f"{r['dp_epsilon']:.3g} (δ = {r['dp_delta']:.2g})")
    lines = ["# Sweep", "", "Mean client accuracy (%) as mean ± std over seeds: best round, last "
             "round, worst 10 % of clients (last), global model (last)"
             + ("; ε of client-level DP after the last round." if private else "."), "",
             "| dataset | algorithm | hyperparameters | seeds | best | last | worst 10% | global |"
             + (" ε |" if private else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if private else "")]
    lines += [f"| {r['dataset']} | {r['algo']} | {r['hparams']} | {r['seeds']} | {r['best']} | "
              f"{r['last']} | {r['worst10']} | {r['global']} |" + (f" {eps(r)} |" if private else "")
              for r in rows]
    return "\n".join(lines) + "\n"


def write_results(out: str, rows: Sequence[dict], curves: dict[str, list]) -> None:
    """OUT/results.md (`results_table`), OUT/results.json (the rows) and OUT/curves.png (mean
    accuracy per round, ± std over the seeds, per curve)."""
    import json

    import numpy as np

    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(results_table(rows))
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(list(rows), f, indent=2)
    from matplotlib.figure import Figure  # outside pyplot: the caller's backend stays

    fig = Figure(figsize=(9, 5))
    ax = fig.subplots()
    for name_, runs in curves.items():
        series = [[(r["round"], r["acc_mean"]) for r in rows_ if "acc_mean" in r] for rows_ in runs]
        if not series or not series[0]:
            continue
        rounds = [x for x, _ in series[0]]
        values = np.array([[y for _, y in s] for s in series if len(s) == len(rounds)])
        mean, std = values.mean(axis=0), values.std(axis=0)
        ax.plot(rounds, mean, label=name_)
        ax.fill_between(rounds, mean - std, mean + std, alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel("mean client test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "curves.png"), dpi=100)
