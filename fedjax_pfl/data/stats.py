"""Statistics of a natural-client dataset (what `experiments/prepare.py` prints and plots).

    describe(nc) -> dict      JSON-ready: clients, samples per client, labels / lengths / tags,
                              vocabulary coverage
    format_table(stats) -> str  the same as a readable table

Quantiles are NumPy's default (linear interpolation between order statistics, Hyndman & Fan's
type 7): for n sorted values v₀ ≤ … ≤ vₙ₋₁ the q-quantile is v_⌊h⌋ + (h − ⌊h⌋)(v_⌊h⌋₊₁ − v_⌊h⌋)
with h = (n − 1)q. Arrays are read in chunks, so a memory-mapped Stack Overflow cache is never
in memory at once.

Conventions:
* A sequence's length is its number of real input tokens: positions with x ≠ PAD (0).
* Tags per sample (multilabel) count the label ids ≥ 0 (−1 pads).
* Out-of-vocabulary: the id of the string `OOV_TOKEN` ("<oov>") in `SourceInfo.vocab`, if the
  reader lists it; the OOV fraction is that id's share of the real (non-PAD) input tokens, and
  is None when the vocabulary has no such entry.
"""

from __future__ import annotations

import numpy as np

from fedjax_pfl.data.natural import PAD, NaturalClients

__all__ = ["OOV_TOKEN", "QUANTILES", "describe", "quantile_summary", "histogram_quantiles", "format_table"]

OOV_TOKEN = "<oov>"
QUANTILES = (("min", 0.0), ("p10", 0.1), ("median", 0.5), ("p90", 0.9), ("max", 1.0))
_CHUNK_ROWS = 1 << 16


def quantile_summary(values: np.ndarray) -> dict:
    """min / p10 / median / p90 / max (type 7, module docstring), total and mean of `values`;
    all None but total = 0 for no values."""
    values = np.asarray(values, np.float64)
    if values.size == 0:
        return {**{k: None for k, _ in QUANTILES}, "mean": None, "total": 0}
    qs = np.quantile(values, [q for _, q in QUANTILES])
    out = {k: _num(v) for (k, _), v in zip(QUANTILES, qs)}
    out["mean"] = float(values.mean())
    out["total"] = _num(values.sum())
    return out


def histogram_quantiles(hist: np.ndarray) -> dict:
    """`quantile_summary` of the values a histogram counts (hist[v] = how many values equal v),
    without expanding it: the k-th smallest value (0-based) is the least v with
    hist[0] + … + hist[v] > k."""
    hist = np.asarray(hist, np.int64)
    n = int(hist.sum())
    if n == 0:
        return {**{k: None for k, _ in QUANTILES}, "mean": None, "total": 0}
    cum = np.cumsum(hist)

    def order_stat(k: int) -> int:
        return int(np.searchsorted(cum, k, side="right"))

    out = {}
    for name, q in QUANTILES:
        h = (n - 1) * q
        lo = int(np.floor(h))
        v_lo = order_stat(lo)
        v_hi = order_stat(min(lo + 1, n - 1))
        out[name] = _num(v_lo + (h - lo) * (v_hi - v_lo))
    values = np.arange(hist.size)
    out["mean"] = float((values * hist).sum() / n)
    out["total"] = int((values * hist).sum())
    return out


def _num(v) -> int | float:
    v = float(v)
    return int(v) if v.is_integer() else v


def _chunks(arr: np.ndarray):
    for start in range(0, arr.shape[0], _CHUNK_ROWS):
        yield np.asarray(arr[start:start + _CHUNK_ROWS])


def _split_stats(nc: NaturalClients, split: str, oov_id: int | None) -> dict:
    task = nc.task
    x, y = getattr(nc, f"{split}_x"), getattr(nc, f"{split}_y")
    out: dict = {"samples": int(x.shape[0])}
    if task.kind == "classify":
        counts = np.zeros(task.num_classes, np.int64)
        for chunk in _chunks(y):
            c = chunk.astype(np.int64).ravel()
            counts += np.bincount(c[(c >= 0) & (c < task.num_classes)], minlength=task.num_classes)
        out["label_counts"] = counts.tolist()
        out["classes_present"] = int((counts > 0).sum())
    if task.kind == "multilabel":
        width = y.shape[1] if y.ndim == 2 else 1
        per_sample = np.zeros(width + 1, np.int64)
        tag_counts = np.zeros(task.num_classes, np.int64)
        for chunk in _chunks(y):
            c = chunk.reshape(chunk.shape[0], -1).astype(np.int64)
            per_sample += np.bincount((c >= 0).sum(axis=1), minlength=width + 1)
            valid = c[(c >= 0) & (c < task.num_classes)]
            tag_counts += np.bincount(valid, minlength=task.num_classes)
        out["tags_per_sample"] = histogram_quantiles(per_sample)
        out["tags_per_sample_histogram"] = per_sample.tolist()
        out["tag_counts"] = tag_counts.tolist()
    if task.inputs == "tokens":
        length = x.shape[1] if x.ndim == 2 else 1
        lengths = np.zeros(length + 1, np.int64)
        ids = np.zeros(task.vocab_size, np.int64)
        outside = 0
        for chunk in _chunks(x):
            c = chunk.reshape(chunk.shape[0], -1).astype(np.int64)
            lengths += np.bincount((c != PAD).sum(axis=1), minlength=length + 1)
            real = c[c != PAD]
            inside = (real >= 0) & (real < task.vocab_size)
            outside += int((~inside).sum())
            ids += np.bincount(real[inside], minlength=task.vocab_size)
        real_tokens = int(ids.sum()) + outside
        out["length"] = histogram_quantiles(lengths)
        out["length_histogram"] = lengths.tolist()
        out["tokens"] = real_tokens
        out["distinct_ids"] = int((ids > 0).sum())
        out["distinct_fraction"] = float((ids > 0).sum() / max(task.vocab_size - 1, 1))
        out["oov_tokens"] = int(ids[oov_id]) if oov_id is not None else None
        out["oov_fraction"] = (float(ids[oov_id] / real_tokens) if oov_id is not None and real_tokens
                               else (0.0 if oov_id is not None else None))
        out["ids_outside_vocab"] = outside
    return out


def describe(nc: NaturalClients) -> dict:
    """Statistics of a natural-client dataset, JSON-ready.

    Keys:
      dataset, format, task (its fields), clients (N);
      train_per_client / test_per_client: quantile_summary of the per-client sample counts
        (min, p10, median, p90, max, mean, total);
      clients_without_test / clients_without_train: how many clients have none;
      train / test: per split, `samples` and by task —
        classify: label_counts [num_classes], classes_present;
        multilabel: tags_per_sample (quantiles), tags_per_sample_histogram, tag_counts;
        token inputs: length (quantiles of real tokens per sample), length_histogram [L + 1],
          tokens (real), distinct_ids (ids ≠ PAD used), distinct_fraction (of the vocab_size − 1
          non-PAD ids), oov_tokens / oov_fraction (None without an "<oov>" entry in the
          vocabulary), ids_outside_vocab (ids ≥ vocab_size or < 0: a reader bug if not 0);
      rounded_values: source values the reader stored at their nearest level because the stored
        dtype cannot hold them exactly (`natural.Quantiser`, ``quantise="round"``).
    """
    vocab = list(nc.source.vocab)
    oov_id = vocab.index(OOV_TOKEN) if OOV_TOKEN in vocab else None
    if oov_id is not None and oov_id >= nc.task.vocab_size:
        oov_id = None
    train_counts, test_counts = nc.train_counts(), nc.test_counts()
    return {
        "dataset": nc.source.name,
        "format": nc.source.format,
        "task": {"kind": nc.task.kind, "inputs": nc.task.inputs, "num_classes": nc.task.num_classes,
                 "vocab_size": nc.task.vocab_size},
        "clients": nc.num_clients,
        "train_per_client": quantile_summary(train_counts),
        "test_per_client": quantile_summary(test_counts),
        "clients_without_train": int((train_counts == 0).sum()),
        "clients_without_test": int((test_counts == 0).sum()),
        "input_shape": list(nc.train_x.shape[1:]),
        "input_dtype": str(nc.train_x.dtype),
        "rounded_values": int(nc.source.rounded),
        "train": _split_stats(nc, "train", oov_id),
        "test": _split_stats(nc, "test", oov_id),
    }


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def format_table(stats: dict) -> str:
    """The statistics of `describe` as a plain-text table."""
    lines = [f"dataset {stats['dataset']} ({stats['format']}): {stats['clients']:,} clients, "
             f"task {stats['task']['kind']} on {stats['task']['inputs']} "
             f"{stats['input_dtype']}{stats['input_shape']}, {stats['task']['num_classes']} outputs"
             + (f", vocabulary {stats['task']['vocab_size']}" if stats['task']['vocab_size'] else "")]
    cols = [k for k, _ in QUANTILES] + ["mean", "total"]
    rows = [("train samples / client", stats["train_per_client"]),
            ("test samples / client", stats["test_per_client"])]
    for split in ("train", "test"):
        s = stats[split]
        if "length" in s:
            rows.append((f"{split} tokens / sample", s["length"]))
        if "tags_per_sample" in s:
            rows.append((f"{split} tags / sample", s["tags_per_sample"]))
    width = max(len(r[0]) for r in rows)
    lines.append(" " * width + "".join(f"{c:>12}" for c in cols))
    for name, q in rows:
        lines.append(f"{name:<{width}}" + "".join(f"{_fmt(q[c]):>12}" for c in cols))
    if stats.get("rounded_values"):
        lines.append(f"values rounded to the nearest level the cache stores ({stats['input_dtype']}): "
                     f"{stats['rounded_values']:,}")
    lines.append(f"clients without test data: {stats['clients_without_test']:,}; "
                 f"without training data: {stats['clients_without_train']:,}")
    for split in ("train", "test"):
        s = stats[split]
        if "label_counts" in s:
            lines.append(f"{split}: {s['classes_present']} of {len(s['label_counts'])} classes present")
        if "tokens" in s:
            oov = "no <oov> id in the vocabulary" if s["oov_fraction"] is None else \
                f"out-of-vocabulary {s['oov_fraction']:.2%} of real tokens"
            lines.append(f"{split}: {s['tokens']:,} real tokens, {s['distinct_ids']:,} distinct ids "
                         f"({s['distinct_fraction']:.1%} of the vocabulary), {oov}")
            if s["ids_outside_vocab"]:
                lines.append(f"{split}: WARNING {s['ids_outside_vocab']:,} token ids outside [0, vocab_size)")
    return "\n".join(lines)
