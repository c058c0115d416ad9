"""Helpers every runner imports, in every virtual environment (needs only NumPy).

A prepared job is one .npz written by `prepare.py`: every sample client by client (x uint8 NHWC,
y), the clients' train and test counts, the per-round client lists, the hyperparameters (a JSON
string) and the engine's initial parameters with its logits on a few probe images, so that the
PyTorch peers start from the same weights and can check that their network is the same function.
A runner prints one line `RESULT {json}` on stdout at the end; `harness.py` reads it.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

RESULT_TAG = "RESULT "


class Job:
    """A prepared job, read from the .npz `prepare.py` wrote."""

    def __init__(self, path: str):
        with np.load(path, allow_pickle=False) as z:
            self.x = z["x"]                              # [n, H, W, C] uint8, client by client
            self.y = z["y"].astype(np.int64)             # [n]
            self.train_counts = z["train_counts"].astype(np.int64)   # [N]
            self.test_counts = z["test_counts"].astype(np.int64)     # [N]
            self.schedule = z["schedule"].astype(np.int64)           # [R, M] client ids per round
            self.meta = json.loads(str(z["meta"]))
            self.params = {k[len("param/"):]: z[k] for k in z.files if k.startswith("param/")}
            self.probe_x = z["probe_x"]                  # [P, H, W, C] float32, normalised
            self.probe_logits = z["probe_logits"]        # [P, classes] the engine's, at init
        n = self.train_counts.size
        counts = np.concatenate([self.train_counts, self.test_counts])
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        self.train_start, self.test_start = starts[:n], starts[n:]

    @property
    def num_clients(self) -> int:
        return int(self.train_counts.size)

    def normalised_nchw(self) -> np.ndarray:
        """Every sample as the models see it (x · scale + shift), float32 NCHW for PyTorch."""
        x = self.x.astype(np.float32) * self.meta["input_scale"] + self.meta["input_shift"]
        return np.ascontiguousarray(np.transpose(x, (0, 3, 1, 2)))

    def train_rows(self, i: int) -> slice:
        return slice(int(self.train_start[i]), int(self.train_start[i] + self.train_counts[i]))

    def test_rows(self) -> slice:
        """All test samples (the clients' test blocks are contiguous after the train blocks)."""
        return slice(int(self.test_start[0]), int(self.x.shape[0]))

    def steps_per_client(self, i: int) -> int:
        """Local steps of client i in one round: E epochs of ⌈n_i / B⌉ batches (last one partial)."""
        b = self.meta["batch_size"]
        return self.meta["local_epochs"] * -(-int(self.train_counts[i]) // b)


def launch_time() -> float:
    """When the harness started this process (time.time(); $PEERS_LAUNCH_T), else now."""
    return float(os.environ.get("PEERS_LAUNCH_T", time.time()))


def loadavg() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def emit(result: dict) -> None:
    """The runner's one result line for the harness."""
    print(RESULT_TAG + json.dumps(result), flush=True)
    sys.stdout.flush()


def weighted_accuracy(correct: int, count: int) -> float:
    return correct / max(count, 1)


_TENSORS: dict = {}


def cached_tensors(path: str, device: str = "cpu"):
    """(job, x NCHW float32 tensor, y int64 tensor) on `device`, loaded once per process: a Ray
    worker keeps them across the clients it runs (this module is imported by name there, so the
    cache survives; a dict in the pickled ClientApp's own module would be shipped empty every
    call)."""
    if (path, device) not in _TENSORS:
        import torch

        job = Job(path)
        _TENSORS[path, device] = (job, torch.from_numpy(job.normalised_nchw()).to(device),
                                  torch.from_numpy(job.y).to(device))
    return _TENSORS[path, device]


class Orders:
    """A batch-order file (`orders.py`): in round r (0-based), client i visits its n_i training
    samples in epoch e in the order `of(r, i, e)` (indices into its own training rows; batch k
    = entries kB … kB + B − 1, the last batch partial)."""

    def __init__(self, path: str):
        with np.load(path, allow_pickle=False) as z:
            self.order = z["order"].astype(np.int64)
            self.offset = z["offset"].astype(np.int64)             # [R, M]
            self.schedule = z["schedule"].astype(np.int64)         # [R, M]
            self.train_counts = z["train_counts"].astype(np.int64)
            self.meta = json.loads(str(z["meta"]))
        self.path = path

    def check_job(self, job: Job, rounds: int) -> None:
        """The file was written for this job's schedule and sizes, for at least `rounds` rounds."""
        if (self.schedule.shape[0] < rounds or not np.array_equal(self.schedule[:rounds], job.schedule[:rounds])
                or not np.array_equal(self.train_counts, job.train_counts)
                or self.meta["local_epochs"] != job.meta["local_epochs"]):
            raise SystemExit(f"{self.path}: batch orders written for another job or fewer rounds")

    def of(self, r: int, client: int, epoch: int) -> np.ndarray:
        hits = np.flatnonzero(self.schedule[r] == client)
        if hits.size != 1:
            raise KeyError(f"client {client} is not scheduled in round {r}")
        n = int(self.train_counts[client])
        start = int(self.offset[r, hits[0]]) + epoch * n
        return self.order[start:start + n]

    def describe(self) -> str:
        s = self.meta.get("shuffle_seed")
        return self.meta["mode"] + ("" if s is None else f", shuffle seed {s}")


_ORDERS: dict = {}


def cached_orders(path: str) -> Orders:
    """The batch-order file, loaded once per process (a Ray worker keeps it, as the tensors)."""
    if path not in _ORDERS:
        _ORDERS[path] = Orders(path)
    return _ORDERS[path]
