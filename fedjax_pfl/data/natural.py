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

Values a reader cannot store exactly (one policy for every reader, `Quantiser`): image files
that hold grey levels as floats v ∈ [0, 1] (LEAF's FEMNIST JSON, TFF's and FedJAX's EMNIST) are
stored as uint8 k = round(255 v), round to nearest (ties to even, `np.rint`). A value within
1e-3 of a level, |255 v − k| ≤ 1e-3, is that level written as a float (LEAF's float64 k/255,
TFF's float32) and is stored exactly; any other value moves to its nearest level and is
counted. ``quantise="round"`` (the default) stores it and reports the count
(`SourceInfo.rounded`, then the cache's meta.json, `stats.describe` and prepare.py's summary);
``quantise="refuse"`` raises `DataFormatError` instead, naming the file, the client and how many
values are off the grid. A value outside [0, 1] (beyond the same 1e-3 of a level) or not finite
is refused under either policy: it is another encoding, not a rounding.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, NamedTuple, Protocol

import numpy as np

from fedjax_pfl.errors import MarkedError, OptionError, arg

# What is predicted from what is the models' business (`models.tasks`); the readers build it.
from fedjax_pfl.models.tasks import INPUTS, KINDS, PAD, Task

__all__ = ["PAD", "KINDS", "INPUTS", "Task", "ClientBlock", "SourceInfo", "NaturalReader",
           "NaturalClients", "DataFormatError", "QUANTISE", "GRID_TOLERANCE", "check_quantise",
           "Quantiser"]

QUANTISE = ("round", "refuse")
# A float within this many levels of an integer level is that level as float32 or float64 wrote
# it: float32(k/255)·255 is within 255·2⁻²⁵ + 2⁻¹⁷ < 2e-5 of k, far inside.
GRID_TOLERANCE = 1e-3


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
    rounded: int = 0                # values moved to their nearest stored level (`Quantiser`),
    #                                 known once `clients()` has run to the end


class NaturalReader(Protocol):
    """What every format reader module provides for one dataset in one directory."""

    def task(self) -> Task: ...

    def source(self) -> SourceInfo: ...

    def clients(self) -> Iterator[ClientBlock]:
        """Every client once, in a fixed order; raises DataFormatError on a bad file or client."""
        ...


class DataFormatError(MarkedError, ValueError):
    """A source file is corrupt, truncated or not in the expected layout. The message is one line
    naming the file and, where known, the client (and may mark a data option, `errors.arg`)."""

    def __init__(self, path: str, what: str, client: str | None = None):
        where = f"{path}" + (f", client {client!r}" if client is not None else "")
        super().__init__(f"{where}: {what}")
        self.path, self.client, self.what = path, client, what


def check_quantise(quantise: object) -> str:
    """`quantise` if it is one of `QUANTISE`; else an OptionError naming the data option."""
    if quantise not in QUANTISE:
        raise OptionError(f"{arg('quantise', 'data')} must be one of {list(QUANTISE)}, "
                          f"got {quantise!r}")
    return str(quantise)


class Quantiser:
    """Grey levels v ∈ [0, 1] stored as uint8 k = round(levels · v) under one `quantise` policy
    (module docstring), counting in `rounded` the values that moved to their nearest level.

    A reader keeps one per dataset, calls `reset` when its `clients()` starts and reports
    `rounded` in its `SourceInfo` once the stream is read.
    """

    def __init__(self, quantise: str = "round", levels: int = 255):
        self.quantise = check_quantise(quantise)
        self.levels = int(levels)
        self.rounded = 0

    def reset(self) -> None:
        self.rounded = 0

    def levels_of(self, values: np.ndarray, what: str, path: str, client: str | None) -> np.ndarray:
        """uint8 k = rint(levels · v) of float `values` (same shape). Raises DataFormatError
        (one line naming `what`, the file and the client) for a value outside [0, 1] or not
        finite, and under "refuse" for a value off the grid; under "round" counts those."""
        v = np.asarray(values)
        # In the values' own float width and in place: about three copies of one client's values.
        scaled = v.astype(np.float32 if v.dtype == np.float32 else np.float64)
        scaled *= self.levels
        k = np.rint(scaled)
        bad = ~np.isfinite(scaled) | (scaled < -GRID_TOLERANCE) | (scaled > self.levels + GRID_TOLERANCE)
        if bad.any():
            i = tuple(int(j) for j in np.argwhere(bad)[0])
            raise DataFormatError(path, f"{what} has {int(bad.sum())} value(s) outside [0, 1] "
                                        f"(e.g. {float(v[i])!r} at {list(i)}): not grey levels "
                                        f"/ {self.levels}", client)
        np.abs(np.subtract(scaled, k, out=scaled), out=scaled)
        off = scaled > GRID_TOLERANCE
        moved = int(off.sum())
        if moved and self.quantise == "refuse":
            i = tuple(int(j) for j in np.argwhere(off)[0])
            raise DataFormatError(path, f"{what} has {moved} value(s) off the k/{self.levels} "
                                        f"grid (e.g. {float(v[i])!r} at {list(i)}), which uint8 "
                                        f"cannot store exactly ({arg('quantise', 'data')} "
                                        "refuse; round stores the nearest level)", client)
        self.rounded += moved
        return np.clip(k, 0, self.levels, out=k).astype(np.uint8)


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
