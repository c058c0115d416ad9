"""Figures of a run, kept apart from the data and engine layers (matplotlib is imported lazily).

  label_distribution_figure(counts)    clients × classes heatmap of a partition's label counts
  plot_label_distribution(counts, path)  the same, written as a PNG (the runner's
                                         label_distribution.png)
  plot_learning_curves(runs, path)     accuracy and training loss against rounds, one or
                                         several runs (the runner's learning_curve.png)
  client_accuracy_figure(accuracy)     the final per-client accuracies, sorted, and their
                                         histogram (the runner's client_accuracy.png)
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

# Client ticks are thinned to at most this many, at a step of 1, 2 or 5 × 10^k.
MAX_CLIENT_TICKS = 25
MAX_SIZE_BARS = 500          # clients drawn as one bar each in the sizes panel


def client_tick_step(num_clients: int, max_ticks: int = MAX_CLIENT_TICKS) -> int:
    """The smallest step in 1, 2, 5, 10, 20, 50, … that puts at most `max_ticks` ticks on
    0, step, 2·step, … < num_clients."""
    step, scale = 1, 1
    while True:
        for mult in (1, 2, 5):
            step = mult * scale
            if -(-num_clients // step) <= max_ticks:
                return step
        scale *= 10


def label_distribution_figure(counts: np.ndarray, *, title: str = "", share: bool = False,
                              class_names: Sequence[str] | None = None):
    """A heatmap of a [clients, classes] count matrix, with the clients' sample counts above it.

    Colour is the count of class c on client k (or, with `share`, its share of client k's
    samples), explained by a colourbar. Client ticks are integers, thinned to at most 25 for many
    clients (every client for ≤ 25); every class is labelled. Cells show their count when the
    matrix is small enough to read them (≤ 30 clients and ≤ 20 classes). The sizes are a bar per
    client up to `MAX_SIZE_BARS` clients, one filled step outline beyond.

    Returns the matplotlib Figure; its axes are [sizes, heatmap, colourbar].
    """

    counts = np.asarray(counts)
    if counts.ndim != 2 or counts.size == 0:
        raise ValueError(f"counts must be a non-empty [clients, classes] matrix, got shape {counts.shape}")
    n_clients, n_classes = counts.shape
    names = [str(c) for c in range(n_classes)] if class_names is None else [str(c) for c in class_names]
    if len(names) != n_classes:
        raise ValueError(f"{len(names)} class names for {n_classes} classes")
    sizes = counts.sum(axis=1)
    values = counts / np.maximum(sizes, 1)[:, None] if share else counts

    width = min(4.0 + 0.22 * n_clients, 18.0)
    height = min(2.6 + 0.32 * n_classes, 14.0)
    fig = _figure(figsize=(width, height))
    ax_size, ax = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1, 4]})
    image = ax.imshow(values.T, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest",
                      extent=(-0.5, n_clients - 0.5, -0.5, n_classes - 0.5),
                      vmin=0, vmax=1 if share else max(int(counts.max()), 1))
    colorbar = fig.colorbar(image, ax=[ax_size, ax], pad=0.015, fraction=0.04)
    colorbar.set_label("share of the client's samples" if share else "samples")

    step = client_tick_step(n_clients)
    client_ticks = np.arange(0, n_clients, step)
    ax.set_xticks(client_ticks, [str(int(t)) for t in client_ticks])
    ax.set_yticks(np.arange(n_classes), names)
    ax.set_xlabel(f"client ({n_clients})" if step == 1 else f"client ({n_clients}; every {step}th labelled)")
    ax.set_ylabel("class")
    if n_clients <= 30 and n_classes <= 20 and not share:
        threshold = 0.6 * counts.max()
        for k in range(n_clients):
            for c in range(n_classes):
                if counts[k, c]:
                    ax.text(k, c, str(int(counts[k, c])), ha="center", va="center", fontsize=7,
                            color="black" if counts[k, c] > threshold else "white")

    if n_clients <= MAX_SIZE_BARS:
        ax_size.bar(np.arange(n_clients), sizes, width=0.8, color="tab:gray")
    else:
        # One filled outline instead of a bar (a patch) per client: matplotlib took 26 s to lay
        # out and draw 20,000 bars, longer than that run's training.
        ax_size.stairs(sizes, np.arange(n_clients + 1) - 0.5, fill=True, color="tab:gray")
    ax_size.set_ylabel("samples")
    ax_size.tick_params(labelbottom=False)
    ax_size.set_title(title or f"label distribution ({n_clients} clients, {n_classes} classes)")
    return fig


def _save(fig, path: str, **kwargs) -> None:
    """A figure written whole or not at all (a temporary file renamed over `path`): a figure drawn in
    the background of an interrupted run never leaves half a file that a resume would keep."""
    import os

    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        fig.savefig(tmp, dpi=100, format=os.path.splitext(path)[1][1:] or "png", **kwargs)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def plot_label_distribution(counts: np.ndarray, path: str, title: str = "", *, share: bool = False,
                            class_names: Sequence[str] | None = None) -> None:
    """Writes `label_distribution_figure(counts, …)` to `path` as a PNG."""
    fig = label_distribution_figure(counts, title=title, share=share, class_names=class_names)
    _save(fig, path, bbox_inches="tight")


def learning_curve_figure(runs: dict[str, list[dict]], title: str = "",
                          acc_keys: tuple[str, ...] = ("acc_mean",)):
    """Accuracy (each of `acc_keys`) and mean local training loss against rounds, for one or
    several runs (label -> per-round metric rows): a matplotlib Figure [accuracy, loss]."""
    import matplotlib

    fig = _figure(figsize=(12, 4.2))
    ax_acc, ax_loss = fig.subplots(1, 2)
    styles = ("-", ":", "--", "-.")
    palette = matplotlib.colormaps["tab10" if len(runs) <= 10 else "tab20"].colors
    for (label, rows), color in zip(runs.items(), palette * (1 + len(runs) // len(palette))):
        for key, style in zip(acc_keys, styles):
            pts = [(r["round"], r[key]) for r in rows if key in r]
            if pts:
                name = key if len(runs) == 1 else (label if len(acc_keys) == 1 else f"{label} {key}")
                # A single point (a one-round run) draws no line: mark it.
                ax_acc.plot(*zip(*pts), style, label=name, marker="o" if len(pts) == 1 else None,
                            color=None if len(runs) == 1 else color)
        losses = [np.nan if r["train_loss"] is None else r["train_loss"] for r in rows]
        ax_loss.plot([r["round"] for r in rows], losses, label=label,
                     marker="o" if len(rows) == 1 else None, color=color)
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
    return fig


def plot_learning_curves(runs: dict[str, list[dict]], path: str, title: str = "",
                         acc_keys: tuple[str, ...] = ("acc_mean",)) -> None:
    """Writes `learning_curve_figure(runs, …)` to `path` as a PNG."""
    fig = learning_curve_figure(runs, title, acc_keys)
    _save(fig, path)


def client_accuracy_figure(accuracy: np.ndarray, *, title: str = ""):
    """The distribution of one evaluation's per-client accuracies (NaN: not evaluated, left
    out): left, every client's accuracy sorted ascending (a bar each up to `MAX_SIZE_BARS`
    clients, one filled outline beyond), with the mean and the bottom decile's mean
    (the mean of the ⌈K/10⌉ lowest, acc_worst10) as lines; right, their histogram. Mean accuracy
    hides the clients a personalised method leaves behind; this shows them.

    Returns the matplotlib Figure; its axes are [sorted, histogram]."""
    import math

    import matplotlib

    acc = np.asarray(accuracy, np.float64).ravel()
    acc = np.sort(acc[~np.isnan(acc)])
    if acc.size == 0:
        raise ValueError("accuracy has no evaluated client (every entry is NaN or it is empty)")
    # (core.metrics' definitions, written out: this module sits below core in the layers.)
    spread = {"acc_mean": acc.mean(), "acc_std": acc.std(), "acc_min": acc[0],
              "acc_max": acc[-1], "acc_worst10": acc[: max(1, math.ceil(0.1 * acc.size))].mean()}
    fig = _figure(figsize=(11, 4))
    ax_sorted, ax_hist = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    ranks = np.arange(acc.size)
    if acc.size <= MAX_SIZE_BARS:
        ax_sorted.bar(ranks, acc, width=0.85, color="tab:blue")
    else:
        ax_sorted.stairs(acc, np.arange(acc.size + 1) - 0.5, fill=True, color="tab:blue")
    for value, style, name in ((spread["acc_mean"], "-", "mean"),
                               (spread["acc_worst10"], "--", "worst 10 % (acc_worst10)")):
        ax_sorted.axhline(value, linestyle=style, color="tab:red", linewidth=1,
                          label=f"{name} {value:.3f}")
    ax_sorted.set_xlim(-0.5, acc.size - 0.5)
    ax_sorted.set_ylim(0, 1)
    ax_sorted.set_xlabel(f"client, sorted by accuracy ({acc.size})")
    ax_sorted.set_ylabel("client test accuracy")
    ax_sorted.legend(fontsize=8, loc="upper left")
    ax_hist.hist(acc, bins=np.linspace(0, 1, 21), color="tab:blue", alpha=0.8)
    ax_hist.set_xlabel("client test accuracy")
    ax_hist.set_ylabel("clients")
    ax_hist.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax_hist.set_title(f"std {spread['acc_std']:.3f}, min {spread['acc_min']:.3f}, "
                      f"max {spread['acc_max']:.3f}", fontsize=9)
    fig.suptitle(title or f"per-client accuracy ({acc.size} clients)")
    fig.tight_layout()
    return fig


def plot_client_accuracy(accuracy: np.ndarray, path: str, title: str = "") -> None:
    """Writes `client_accuracy_figure(accuracy, …)` to `path` as a PNG (atomically, `_save`)."""
    _save(client_accuracy_figure(accuracy, title=title), path)


def client_sizes_figure(train_counts: np.ndarray, test_counts: np.ndarray | None = None, *,
                        title: str = ""):
    """A histogram of samples per client (training, and held-out when given) of a natural-client
    dataset. Bins are logarithmic when the sizes span more than two decades (Stack Overflow's
    heavy tail), linear otherwise. Returns the matplotlib Figure."""
    import matplotlib

    train_counts = np.asarray(train_counts)
    series = [("train", train_counts)] + ([("test", np.asarray(test_counts))] if test_counts is not None else [])
    positive = np.concatenate([s[s > 0] for _, s in series]) if train_counts.size else np.zeros(0)
    hi = max(int(positive.max()) if positive.size else 1, 1)
    lo = max(int(positive.min()) if positive.size else 1, 1)
    log = hi / lo > 100
    # Log bins at integer edges: a bin narrower than 1 would hold no integer and draw a gap.
    bins = (np.unique(np.round(np.geomspace(lo, hi + 1, 40))) if log
            else np.linspace(0, hi + 1, min(hi + 2, 41)))
    fig = _figure(figsize=(7, 4))
    ax = fig.subplots()
    for name, counts in series:
        ax.hist(counts[counts > 0] if log else counts, bins=bins, alpha=0.6,
                label=f"{name} (median {np.median(counts):g}, {int((counts == 0).sum())} clients with none)")
    if log:
        ax.set_xscale("log")
    ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("samples per client")
    ax.set_ylabel("clients")
    ax.legend(fontsize=8)
    ax.set_title(title or f"client sizes ({train_counts.size} clients)")
    fig.tight_layout()
    return fig


def counts_figure(counts: np.ndarray, *, xlabel: str, title: str = "",
                  names: Sequence[str] | None = None, top: int = 60):
    """A bar chart of counts[v] against v: a label distribution (v = class, `names` its labels;
    more than `top` classes show only the `top` most frequent, sorted) or a length histogram
    (v = tokens per sample). Returns the matplotlib Figure."""

    counts = np.asarray(counts)
    keys = np.arange(counts.size)
    shown = f"{counts.size}"
    if names is not None and counts.size > top:
        keys = np.argsort(-counts, kind="stable")[:top]
        shown = f"the {top} most frequent of {counts.size}"
    fig = _figure(figsize=(min(4 + 0.15 * keys.size, 18), 4))
    ax = fig.subplots()
    ax.bar(np.arange(keys.size), counts[keys], width=0.9)
    if names is not None:
        labels = [str(names[k]) if k < len(names) else str(k) for k in keys]
        ax.set_xticks(np.arange(keys.size), labels, rotation=90, fontsize=7)
    else:
        step = client_tick_step(keys.size)
        ax.set_xticks(np.arange(0, keys.size, step), [str(int(keys[i])) for i in range(0, keys.size, step)])
    ax.set_xlabel(f"{xlabel} ({shown})")
    ax.set_ylabel("samples")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def save_figure(fig, path: str) -> None:
    """Writes a Figure to `path` as a PNG."""
    _save(fig, path, bbox_inches="tight")


def _figure(**kwargs):
    """A Figure of its own, outside pyplot: drawing a run's figures neither switches the
    caller's backend (a notebook's inline one) nor leaves figures open in pyplot's registry."""
    from matplotlib.figure import Figure

    return Figure(**kwargs)
