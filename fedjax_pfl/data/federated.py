"""FederatedData: every client's data on device once, as index tables into one shared array.

All inputs and labels are transferred to the device a single time. Clients hold only int32 index
tables into them, padded to the largest client, plus their true counts; the engine masks the
padding. No host→device copy happens per round. uint8 images stay uint8 on device (4× less
memory than float32) and are normalised inside the jitted step by `FederatedData.inputs`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ClientSplits:
    """Per-client index tables. Every leaf has leading axis N (or M after `core.gather`)."""

    train_idx: jax.Array    # [N, max_train] int32 rows of FederatedData.x; padding rows are 0
    train_count: jax.Array  # [N] int32 number of valid entries in train_idx
    test_idx: jax.Array     # [N, max_test] int32
    test_count: jax.Array   # [N] int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FederatedData:
    """A federated dataset on device.

    Attributes:
      x: [n, ...] all inputs (uint8 images in NHWC, or float32 features).
      y: [n] int32 labels.
      clients: per-client train/test index tables (`ClientSplits`).
      num_classes, input_scale, input_shift, name: static metadata (part of the jit cache key).
        The model sees x · input_scale + input_shift in float32.
    """

    x: jax.Array
    y: jax.Array
    clients: ClientSplits
    num_classes: int = dataclasses.field(metadata=dict(static=True), default=10)
    input_scale: float = dataclasses.field(metadata=dict(static=True), default=1.0)
    input_shift: float = dataclasses.field(metadata=dict(static=True), default=0.0)
    name: str = dataclasses.field(metadata=dict(static=True), default="")

    @property
    def num_clients(self) -> int:
        """N, static (a shape)."""
        return self.clients.train_count.shape[0]

    @property
    def max_train(self) -> int:
        return self.clients.train_idx.shape[1]

    @property
    def max_test(self) -> int:
        return self.clients.test_idx.shape[1]

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    def inputs(self, rows: jax.Array) -> jax.Array:
        """Normalised float inputs (float32; float64 under x64) for rows `rows` (any int shape)."""
        x = self.x[rows].astype(jax.dtypes.canonicalize_dtype(jnp.float64))
        if self.input_scale != 1.0:
            x = x * self.input_scale
        if self.input_shift != 0.0:
            x = x + self.input_shift
        return x

    def labels(self, rows: jax.Array) -> jax.Array:
        return self.y[rows]

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
    ) -> "FederatedData":
        """Builds the padded index tables from per-client lists of row indices and moves it all to device."""
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
        train_idx, train_count = _pad(train_indices, x.shape[0])
        test_idx, test_count = _pad(test_indices, x.shape[0])
        splits = ClientSplits(
            train_idx=jnp.asarray(train_idx),
            train_count=jnp.asarray(train_count),
            test_idx=jnp.asarray(test_idx),
            test_count=jnp.asarray(test_count),
        )
        return cls(
            x=jnp.asarray(x),
            y=jnp.asarray(y.astype(np.int32)),
            clients=splits,
            num_classes=int(num_classes),
            input_scale=float(input_scale),
            input_shift=float(input_shift),
            name=name,
        )


def _pad(index_lists: Sequence[np.ndarray], num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    counts = np.array([len(ix) for ix in index_lists], dtype=np.int32)
    width = max(1, int(counts.max()))
    table = np.zeros((len(index_lists), width), dtype=np.int32)
    for i, ix in enumerate(index_lists):
        ix = np.asarray(ix, dtype=np.int64)
        if ix.size and (ix.min() < 0 or ix.max() >= num_rows):
            raise ValueError(f"client {i} has row indices outside [0, {num_rows})")
        table[i, : ix.size] = ix
    return table, counts


def label_counts(data: FederatedData, split: str = "train") -> np.ndarray:
    """[N, num_classes] counts of each label on each client's `split` ('train', 'test' or 'all')."""
    y = np.asarray(data.y)
    c = data.clients
    tables = {"train": [(c.train_idx, c.train_count)], "test": [(c.test_idx, c.test_count)]}
    tables["all"] = tables["train"] + tables["test"]
    if split not in tables:
        raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}")
    counts = np.zeros((data.num_clients, data.num_classes), dtype=np.int64)
    for idx, cnt in tables[split]:
        idx, cnt = np.asarray(idx), np.asarray(cnt)
        for i in range(data.num_clients):
            counts[i] += np.bincount(y[idx[i, : cnt[i]]], minlength=data.num_classes)
    return counts
