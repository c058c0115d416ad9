"""A run's output directory: its gatekeeper (`check_out`), a fresh start (`clear_out`) and
atomic writes of its files.

Output directory:
  config.json             the resolved configuration (data, algorithm hyperparameters, versions)
  metrics.jsonl           one JSON object per round
  summary.json            best-over-rounds (accuracies, with the round) and last metrics,
                          wall/compile/round times, throughput; "interrupted" and the last
                          completed round when the run was stopped
  client_metrics.npz      per-round sampled ids and per-client accuracy (to recompute any statistic)
  learning_curve.png      accuracy and loss against rounds
  label_distribution.png  clients × classes sample counts
  client_accuracy.png     the last evaluation's per-client accuracies, sorted, and their histogram
  checkpoints/round_RRRRRR/  the full state after round R (`runner.checkpoints`; the last two)
  tensorboard/, mlflow.db, wandb/, …  what the metric sinks of --log write (`fedjax_pfl.sinks`)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Callable

import numpy as np

from fedjax_pfl import sinks
from fedjax_pfl.errors import OptionError, arg

# Files a run writes into its output directory (and removes from it when it starts afresh).
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "client_metrics.npz",
             "learning_curve.png", "label_distribution.png", "checkpoints",
             *sinks.RUN_FILES,       # what the metric sinks of --log write
             "client_accuracy.png",
             "final")                 # --export's models (fedjax_pfl.export.FINAL_DIR)


def check_out(out: str, *, overwrite: bool = False, resume: bool = False) -> None:
    """Refuses an output directory before any computation (OptionError naming `out`): an
    existing file, a path that cannot be created or written, or a directory that holds another
    run's files (unless `overwrite`, which replaces them, or `resume`, which continues that run)."""
    path = os.path.abspath(out)
    if os.path.exists(path) and not os.path.isdir(path):
        raise OptionError(f"{arg('out')} {out} is an existing file, not a directory")
    ancestor = path
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise OptionError(f"{arg('out')} {out} cannot be created: {ancestor} is a file")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OptionError(f"{arg('out')} {out} is not writable ({ancestor} does not allow "
                          "writing)")
    # The permission bits do not tell for root, a read-only mount or /proc: a file made and
    # removed at once does (before the data load, not at the first write after it).
    try:
        fd, probe = tempfile.mkstemp(prefix=".fedjax_pfl-write-probe-", dir=ancestor)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise OptionError(f"{arg('out')} {out} is not writable (no file can be made in "
                          f"{ancestor}: {e.strerror or e})") from None
    if resume:
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise OptionError(f"{arg('resume')}: {out} holds no run to resume (no config.json)")
        return
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        found = sorted(os.listdir(path))
        shown = ", ".join(found[:4]) + (", …" if len(found) > 4 else "")
        raise OptionError(f"{arg('out')} {out} already holds files ({shown}); pass "
                          f"{arg('overwrite')} to replace that run's files or {arg('resume')} to "
                          "continue it")


def clear_out(out: str) -> None:
    """Removes a previous run's files from `out` (RUN_FILES and per-seed run directories), so
    that a new run never leaves its files mixed with stale ones."""
    if not os.path.isdir(out):
        return
    for name in os.listdir(out):
        path = os.path.join(out, name)
        if name in RUN_FILES or name.startswith("seed_") or name.startswith(".checkpoints"):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)


def write_json(path: str, obj: Any) -> None:
    """Writes JSON atomically (a temporary file renamed over `path`)."""
    def write(f):
        f.write((json.dumps(obj, indent=2, default=json_default) + "\n").encode())
    atomic(path, write)


def atomic(path: str, write: Callable) -> None:
    """Calls `write(binary file)` on a temporary beside `path`, then renames it to `path`: a
    reader never sees a half-written file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)
