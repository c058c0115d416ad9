"""Natural-client datasets: the common shape every file reader produces.

A natural-client dataset (LEAF, TensorFlow Federated, FedJAX files) already says which samples
belong to which client and which of them are held out. The readers (`data/leaf.py`,
`data/tff.py`, `data/fedjax_sqlite.py`) each turn their files into a stream of `ClientBlock`s in a
fixed client order, plus one `Task` and a `SourceInfo`; `data/cache.py` writes that stream once
into a client-sorted, memory-mappable cache and opens it again as `NaturalClients`.

Array conventions (host side, NumPy; what the model sees on device):

* ``inputs="image"``: x [n, H, W, C] uint8; the model sees x · input_scale + input_shift (float32).
* ``inputs="tokens"``: x [n, L] int32 token ids, 0 = padding; the model embeds them itself.
* ``inputs="features"``: x [n, F] float32.
* ``kind="classify"``: y [n] int32 in [0, num_classes).
* ``kind="sequence"``: y [n, T] int32, one target per position; label 0 (`PAD`) is padding and
  never counts in the loss, the gradient or any metric; `Task.metric_excluded` lists further
  labels left out of accuracy only (e.g. out-of-vocabulary, end of sentence).
* ``kind="multilabel"``: y [n, K] int32 label ids, padded with −1 (a sample has ≤ K labels);
  the metric is recall@`topk` over the true labels (micro-averaged, as TFF reports it).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, NamedTuple, Protocol

import numpy as np

# What is predicted from what is the models' business (`models.tasks`); the readers build it.
from fedjax_pfl.models.tasks import INPUTS, KINDS, PAD, Task

__all__ = ["PAD", "KINDS", "INPUTS", "Task", "ClientBlock", "SourceInfo", "NaturalReader",
           "NaturalClients", "DataFormatError"]


class ClientBlock(NamedTuple):
    """One client's samples as a reader yields them (host NumPy, in the Task's conventions)."""

    client_id: str
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray


@dataclasses.dataclass(frozen=True)
class SourceInfo:
    """Where a dataset was read from: the files (for the cache's staleness check) and the rest of
    what the cache records."""

    name: str                       # dataset name, e.g. "femnist"
    format: str                     # "leaf" | "tff" | "fedjax"
    files: tuple[str, ...]          # every source file read (absolute paths)
    input_scale: float = 1.0
    input_shift: float = 0.0
    vocab: tuple[str, ...] = ()     # token strings by id (tokens inputs), for statistics
    labels: tuple[str, ...] = ()    # label strings by id (tags, characters), for statistics
    options: tuple[tuple[str, str], ...] = ()   # reader options that change the arrays (cache key)


class NaturalReader(Protocol):
    """What every format reader module provides for one dataset in one directory."""

    def task(self) -> Task: ...

    def source(self) -> SourceInfo: ...

    def clients(self) -> Iterator[ClientBlock]:
        """Every client once, in a fixed order; raises DataFormatError on a bad file or client."""
        ...


class DataFormatError(ValueError):
    """A source file is corrupt, truncated or not in the expected layout. The message is one line
    naming the file and, where known, the client."""

    def __init__(self, path: str, what: str, client: str | None = None):
        where = f"{path}" + (f", client {client!r}" if client is not None else "")
        super().__init__(f"{where}: {what}")
        self.path, self.client, self.what = path, client, what


@dataclasses.dataclass(frozen=True)
class NaturalClients:
    """A natural-client dataset on the host, client-sorted (arrays may be memory-mapped).

    Client i's training samples are train_x[train_offsets[i]:train_offsets[i + 1]] (and
    train_y); its held-out samples likewise in the test arrays. `all_x` / `all_y`, where set (an
    opened cache), are train_x followed by test_x in one (mapped) array, `FederatedData`'s layout.
    """

    task: Task
    source: SourceInfo
    client_ids: np.ndarray          # [N] str
    train_x: np.ndarray
    train_y: np.ndarray
    train_offsets: np.ndarray       # [N + 1] int64
    test_x: np.ndarray
    test_y: np.ndarray
    test_offsets: np.ndarray        # [N + 1] int64
    all_x: np.ndarray | None = None
    all_y: np.ndarray | None = None

    @property
    def num_clients(self) -> int:
        return int(self.client_ids.shape[0])

    def train_counts(self) -> np.ndarray:
        return np.diff(self.train_offsets)

    def test_counts(self) -> np.ndarray:
        return np.diff(self.test_offsets)
