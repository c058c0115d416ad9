"""FederatedData: every client's data on device once, stored client by client.

All inputs and labels are transferred to the device a single time, reordered so that each
client's training samples are one contiguous block of rows, followed by all clients' test blocks.
A client is then just (start, count) per split: memory is the total number of samples, whatever
the spread of client sizes (no table padded to the largest client). No host→device copy happens
per round. uint8 images stay uint8 on device (4× less memory than float32) and are normalised
inside the jitted step by `FederatedData.inputs`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ClientSplits:
    """Where each client's samples are. Every leaf has leading axis N (or M after `core.gather`).

    Client i's training samples are rows train_start[i] … train_start[i] + train_count[i] − 1 of
    FederatedData.x (and .y); its test samples likewise.
    """

    train_start: jax.Array  # [N] int32
    train_count: jax.Array  # [N] int32
    test_start: jax.Array   # [N] int32
    test_count: jax.Array   # [N] int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FederatedData:
    """A federated dataset on device.

    Attributes:
      x: [n, ...] all inputs, client by client (uint8 images in NHWC, or float32 features).
      y: [n] int32 labels.
      clients: per-client (start, count) of the train and test splits (`ClientSplits`).
      num_classes, input_scale, input_shift, name: static metadata (part of the jit cache key).
        The model sees x · input_scale + input_shift in float32.
      real_clients: static; clients 0 … real_clients − 1 are real. Rows beyond are empty padding
        clients (no data) that make N divisible by the device count when client state is sharded
        (`pad_clients`), or hold the unused slots of a Poisson-sampled round
        (`core.sample_poisson`); they never take part and have no test data.
      max_train, max_test: static; the largest client's train / test sample count (sizes of
        evaluation batches and memory plans).
      task: static; what is predicted from what (`data.natural.Task`: token inputs, per-token or
        multi-label targets). None: image or feature classification with y [n] labels.
    """

    x: jax.Array
    y: jax.Array
    clients: ClientSplits
    num_classes: int = dataclasses.field(metadata=dict(static=True), default=10)
    input_scale: float = dataclasses.field(metadata=dict(static=True), default=1.0)
    input_shift: float = dataclasses.field(metadata=dict(static=True), default=0.0)
    name: str = dataclasses.field(metadata=dict(static=True), default="")
    real_clients: int | None = dataclasses.field(metadata=dict(static=True), default=None)
    max_train: int = dataclasses.field(metadata=dict(static=True), default=0)
    max_test: int = dataclasses.field(metadata=dict(static=True), default=0)
    task: Any = dataclasses.field(metadata=dict(static=True), default=None)

    @property
    def num_clients(self) -> int:
        """N, the rows of every per-client array (padding clients included); static."""
        return self.clients.train_count.shape[0]

    @property
    def num_real_clients(self) -> int:
        """The clients that exist (sampling draws from these); static."""
        return self.num_clients if self.real_clients is None else self.real_clients

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    @property
    def token_inputs(self) -> bool:
        """Whether x holds int32 token ids that the model embeds itself (no normalisation)."""
        return self.task is not None and self.task.inputs == "tokens"

    def inputs(self, rows: jax.Array) -> jax.Array:
        """Normalised float inputs (float32; float64 under x64) for rows `rows` (any int shape);
        token ids as they are (int32) for a dataset of token inputs."""
        if self.token_inputs:
            return self.x[rows]
        x = self.x[rows].astype(jax.dtypes.canonicalize_dtype(jnp.float64))
        if self.input_scale != 1.0:
            x = x * self.input_scale
        if self.input_shift != 0.0:
            x = x + self.input_shift
        return x

    def labels(self, rows: jax.Array) -> jax.Array:
        return self.y[rows]

    def pad_clients(self, multiple: int, minimum: int = 0) -> "FederatedData":
        """This dataset with empty clients appended until N is a multiple of `multiple` and at
        least `minimum` of them are padding (Poisson sampling fills its unused slots with one)."""
        n = self.num_clients
        extra = -n % multiple
        while (n + extra) - self.num_real_clients < minimum:
            extra += multiple
        if extra == 0:
            return self
        pad = lambda a: jnp.concatenate([a, jnp.zeros(extra, a.dtype)])
        clients = jax.tree.map(pad, self.clients)
        return dataclasses.replace(self, clients=clients, real_clients=self.num_real_clients)

    @classmethod
    def from_arrays(
        cls,
        x: np.ndarray,
        y: np.ndarray,
        train_indices: Sequence[np.ndarray],
        test_indices: Sequence[np.ndarray],
        *,
        num_classes: int,
        input_scale: float = 1.0,
        input_shift: float = 0.0,
        name: str = "",
        task: Any = None,
        device: bool = True,
        keep: np.ndarray | None = None,
    ) -> "FederatedData":
        """Lays the samples out client by client (train blocks, then test blocks) and moves them
        to device. `train_indices[i]` / `test_indices[i]` are client i's rows of `x`, in order.
        `device=False` keeps x and y as host NumPy arrays (for `--data-placement host`).

        `keep` (bool per client, host arrays only): only those clients' samples are copied; the
        others' rows of x stay zero pages that were never written, so they cost no memory (a
        process of a multi-process run with `--data-placement sharded` holds its own devices'
        clients, `core.sharded.clients_held_here`). y is whole (labels are small)."""
        if len(train_indices) != len(test_indices):
            raise ValueError(
                f"{len(train_indices)} train index lists but {len(test_indices)} test index lists"
            )
        if len(train_indices) == 0:
            raise ValueError("a federated dataset needs at least one client")
        x = np.asarray(x)
        y = np.asarray(y)
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"x has {x.shape[0]} rows but y has {y.shape[0]}")
        blocks = [np.asarray(ix, dtype=np.int64).reshape(-1)
                  for ix in (*train_indices, *test_indices)]
        for i, ix in enumerate(blocks):
            if ix.size and (ix.min() < 0 or ix.max() >= x.shape[0]):
                client = i % len(train_indices)
                raise ValueError(f"client {client} has row indices outside [0, {x.shape[0]})")
        counts = np.array([b.size for b in blocks], dtype=np.int64)
        order = np.concatenate(blocks) if counts.sum() else np.zeros(0, np.int64)
        n = len(train_indices)
        if keep is None:
            laid = x[order]
        else:
            keep = np.asarray(keep, bool)
            if device or keep.shape != (n,):
                raise ValueError(f"keep must be a bool per client ({n}) of a host dataset, got "
                                 f"shape {keep.shape}" + (" with device=True" if device else ""))
            laid = np.zeros((order.size,) + x.shape[1:], x.dtype)   # (untouched pages: free)
            kept = np.repeat(np.concatenate([keep, keep]), counts)
            laid[kept] = x[order[kept]]
        return cls.from_blocks(laid, y[order], counts[:n], counts[n:], num_classes=num_classes,
                               input_scale=input_scale, input_shift=input_shift, name=name,
                               task=task, device=device)

    @classmethod
    def from_blocks(
        cls,
        x: np.ndarray,
        y: np.ndarray,
        train_counts: np.ndarray,
        test_counts: np.ndarray,
        *,
        num_classes: int,
        input_scale: float = 1.0,
        input_shift: float = 0.0,
        name: str = "",
        task: Any = None,
        device: bool = True,
    ) -> "FederatedData":
        """Moves samples already laid out client by client to device: client 0's training
        samples, client 1's, …, then client 0's test samples, … (`train_counts[i]` and
        `test_counts[i]` rows each). `device=False` keeps x and y on the host as they are (NumPy
        or memory-mapped arrays: `core.Program` places them)."""
        counts = np.concatenate([np.asarray(train_counts, np.int64), np.asarray(test_counts, np.int64)])
        n = len(train_counts)
        if len(test_counts) != n or n == 0:
            raise ValueError(f"{n} train counts and {len(test_counts)} test counts (need ≥ 1 client each)")
        if counts.sum() != x.shape[0] or x.shape[0] != y.shape[0]:
            raise ValueError(f"the counts sum to {counts.sum()} rows, x has {x.shape[0]}, y {y.shape[0]}")
        if counts.sum() >= 2**31:
            raise ValueError(f"{counts.sum()} samples exceed the int32 row index range")
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        as_i32 = lambda a: jnp.asarray(a.astype(np.int32))
        splits = ClientSplits(train_start=as_i32(starts[:n]), train_count=as_i32(counts[:n]),
                              test_start=as_i32(starts[n:]), test_count=as_i32(counts[n:]))
        y = np.asarray(y)
        check_labels(y, int(num_classes), task)
        y = y if y.dtype == np.int32 else y.astype(np.int32)
        return cls(
            x=jnp.asarray(x) if device else x,
            y=jnp.asarray(y) if device else y,
            clients=splits,
            num_classes=int(num_classes),
            input_scale=float(input_scale),
            input_shift=float(input_shift),
            name=name,
            max_train=int(counts[:n].max()),
            max_test=int(counts[n:].max()),
            task=task,
        )

    def client_rows(self, client: int, split: str = "train") -> np.ndarray:
        """Host-side: the rows of x holding client `client`'s `split` samples."""
        c = self.clients
        start, count = (c.train_start, c.train_count) if split == "train" else (c.test_start, c.test_count)
        s = int(start[client])
        return np.arange(s, s + int(count[client]))


def check_labels(y: np.ndarray, num_classes: int, task: Any = None) -> None:
    """ValueError naming the offending label unless every label is a class of the task: 0 …
    num_classes − 1 (a multi-label task's −1 pads a sample's tags). A label past the model's
    outputs would train on a loss that reads past its logits, without an error. Memory-mapped
    labels (a natural dataset's converted cache, checked when it was written) are not read
    here."""
    if isinstance(y, np.memmap) or y.size == 0:
        return
    if not np.issubdtype(y.dtype, np.integer):
        if not np.issubdtype(y.dtype, np.floating) or not np.all(np.mod(y, 1) == 0):
            raise ValueError(f"labels must be integer class ids, got {y.dtype} values")
    low = -1 if task is not None and task.kind == "multilabel" else 0
    # Shifted labels (`Task.label_offset` k): class y − k, so y runs up to num_classes − 1 + k.
    top = num_classes - 1 + (int(getattr(task, "label_offset", 0)) if task is not None else 0)
    lo, hi = int(np.min(y)), int(np.max(y))
    if lo < low or hi > top:
        bad = lo if lo < low else hi
        raise ValueError(f"label {bad} is outside the {num_classes} classes of this dataset "
                         f"(labels must be {low} … {top}): pass the right "
                         "num_classes, or relabel")


def label_counts(data: FederatedData, split: str = "train") -> np.ndarray:
    """[N, num_classes] counts of each label on each client's `split` ('train', 'test' or 'all').
    Per-token and multi-label targets count every real token / tag (padding, label 0 of a
    sequence task and −1 of a multi-label one, is left out)."""
    if split not in ("train", "test", "all"):
        raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}")
    y = np.asarray(data.y)
    c = jax.device_get(data.clients)
    splits = {"train": [(c.train_start, c.train_count)], "test": [(c.test_start, c.test_count)]}
    splits["all"] = splits["train"] + splits["test"]
    counts = np.zeros((data.num_clients, data.num_classes), dtype=np.int64)
    for start, count in splits[split]:
        count = count.astype(np.int64)
        client_of_row = np.repeat(np.arange(data.num_clients), count)
        first = np.repeat(np.cumsum(count) - count, count)              # block start in `rows`
        rows = np.repeat(start, count) + (np.arange(count.sum()) - first)
        labels = y[rows]
        if labels.ndim > 1:                   # one label per token, or a sample's tags
            width = int(np.prod(labels.shape[1:]))
            client_of_row = np.repeat(client_of_row, width)
            labels = labels.reshape(-1)
            pad = 0 if data.task is not None and data.task.kind == "sequence" else -1
            real = labels != pad
            client_of_row, labels = client_of_row[real], labels[real]
            if data.task is not None and data.task.label_offset:   # shifted: class y − k
                labels = labels - data.task.label_offset
        np.add.at(counts, (client_of_row, labels), 1)
    return counts
