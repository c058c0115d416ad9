"""From a raw dataset to a `FederatedData` on device: partition, per-client split, statistics."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from fedjax_pfl.data import partition as partition_lib
from fedjax_pfl.data.federated import FederatedData, label_counts
from fedjax_pfl.errors import OptionError, arg


@dataclasses.dataclass(frozen=True)
class PartitionConfig:
    """How samples are dealt to clients (see data/partition.py for each scheme).

    scheme: 'iid', 'dirichlet' (class-wise), 'dirichlet_client' (per-client proportions, equal
      sizes), 'pathological', 'shards', 'clustered' (`clusters` groups of clients with disjoint
      label sets) or 'natural' (the dataset's own clients).
    """

    scheme: str = "dirichlet"
    num_clients: int = 20
    alpha: float = 0.5
    min_size: int = 10
    max_tries: int = 100
    classes_per_client: int = 2
    shards_per_client: int | None = None
    shard_size: int | None = None
    clusters: int = 4
    test_fraction: float = 0.25
    seed: int = 0

    def validate(self) -> None:
        """Config-level checks that need no data (OptionError naming the field)."""
        p = lambda name: arg(name, "partition")  # noqa: E731
        if self.scheme not in partition_lib.PARTITIONS:
            raise OptionError(f"{p('scheme')} must be one of {list(partition_lib.PARTITIONS)}, "
                              f"got {self.scheme!r}")
        if self.num_clients < 1:
            raise OptionError(f"{p('num_clients')} must be >= 1, got {self.num_clients}")
        if not self.alpha > 0:  # checked for every scheme: a bad value is a typo even where unused
            raise OptionError(f"{p('alpha')} must be > 0, got {self.alpha}")
        if self.min_size < 0:
            raise OptionError(f"{p('min_size')} must be >= 0, got {self.min_size}")
        if not 0.0 < self.test_fraction < 1.0:
            raise OptionError(f"{p('test_fraction')} must be in (0, 1), got {self.test_fraction}")
        if self.scheme == "pathological" and self.classes_per_client < 1:
            raise OptionError(f"{p('classes_per_client')} must be >= 1, got "
                              f"{self.classes_per_client}")
        if self.scheme == "shards" and (self.shards_per_client is None) == (self.shard_size is None):
            raise OptionError(f"{p('scheme')} shards needs exactly one of "
                              f"{p('shards_per_client')} or {p('shard_size')}")
        if self.scheme == "clustered" and not 1 <= self.clusters <= self.num_clients:
            raise OptionError(f"{p('clusters')} must be in [1, {p('num_clients')} "
                              f"{self.num_clients}], got {self.clusters}")


def partition_indices(raw: Any, cfg: PartitionConfig) -> list[np.ndarray]:
    """Per-client sample indices of `raw` (a RawDataset) under `cfg`."""
    cfg.validate()
    labels = np.asarray(raw.y)
    if cfg.scheme == "natural":
        if getattr(raw, "client_ids", None) is None:
            raise OptionError(f"{arg('scheme', 'partition')} natural: dataset {raw.name!r} has no "
                              "natural clients")
        return partition_lib.natural(raw.client_ids, cfg.num_clients)
    if cfg.scheme == "iid":
        return partition_lib.iid(labels.size, cfg.num_clients, seed=cfg.seed)
    if cfg.scheme == "dirichlet":
        return partition_lib.dirichlet(labels, cfg.num_clients, alpha=cfg.alpha, seed=cfg.seed,
                                       min_size=cfg.min_size, max_tries=cfg.max_tries)
    if cfg.scheme == "dirichlet_client":
        return partition_lib.dirichlet_client(labels, cfg.num_clients, alpha=cfg.alpha, seed=cfg.seed)
    if cfg.scheme == "clustered":
        return partition_lib.clustered(labels, cfg.num_clients, clusters=cfg.clusters, seed=cfg.seed)
    if cfg.scheme == "pathological":
        return partition_lib.pathological(labels, cfg.num_clients,
                                          classes_per_client=cfg.classes_per_client, seed=cfg.seed)
    return partition_lib.shards(labels, cfg.num_clients, seed=cfg.seed,
                                shards_per_client=cfg.shards_per_client, shard_size=cfg.shard_size)


def build_federated(raw: Any, cfg: PartitionConfig, *, device: bool = True,
                    keep: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None
                    ) -> tuple[FederatedData, dict[str, Any]]:
    """Partitions `raw`, splits each client into train/test and moves everything to device.

    `keep(train_counts, test_counts)` (host data only): the clients whose samples this process
    copies (`FederatedData.from_arrays`'s `keep`); the others' rows stay unwritten zeros.

    Returns the data and a JSON-ready description (sizes, unassigned samples, label counts).
    """
    parts = partition_indices(raw, cfg)
    train, test = partition_lib.split_train_test(parts, test_fraction=cfg.test_fraction,
                                                 seed=cfg.seed + 1)
    kept = None if keep is None else keep(np.array([t.size for t in train]),
                                          np.array([t.size for t in test]))
    written = getattr(raw, "written", None)
    if written is not None and not np.all(written):
        # Only some clients' features were generated: every client this process copies must be
        # one of them, or it would train on zero rows.
        if cfg.scheme != "natural" or kept is None or np.any(np.asarray(kept) & ~written):
            raise ValueError(f"{raw.name}: only {int(np.sum(written))} of {written.size} clients' "
                             "samples were generated, and this partition needs others")
    data = FederatedData.from_arrays(
        raw.x, raw.y, train, test, num_classes=raw.num_classes,
        input_scale=raw.input_scale, input_shift=raw.input_shift, name=raw.name, device=device,
        keep=kept,
    )
    train_sizes = np.array([t.size for t in train])
    test_sizes = np.array([t.size for t in test])
    info = {
        "dataset": raw.name,
        "source": getattr(raw, "source", ""),
        "num_samples": int(np.asarray(raw.y).size),
        "num_clients": len(parts),
        "unassigned_samples": partition_lib.unassigned_count(parts, int(np.asarray(raw.y).size)),
        "train_size": {"min": int(train_sizes.min()), "mean": float(train_sizes.mean()),
                       "max": int(train_sizes.max()), "total": int(train_sizes.sum())},
        "test_size": {"min": int(test_sizes.min()), "mean": float(test_sizes.mean()),
                      "max": int(test_sizes.max()), "total": int(test_sizes.sum())},
        "classes_per_client_mean": float((label_counts(data, "all") > 0).sum(axis=1).mean()),
    }
    if cfg.scheme == "clustered":  # the planted truth, e.g. to score a learned client graph
        info["clusters"] = partition_lib.cluster_of_clients(len(parts), cfg.clusters).tolist()
    return data, info


def plot_label_distribution(counts: np.ndarray, path: str, title: str = "") -> None:
    """Clients × classes heatmap of a [clients, classes] count matrix, written as a PNG.

    Kept here for existing imports; the figure lives in `fedjax_pfl.plots`."""
    from fedjax_pfl import plots

    plots.plot_label_distribution(counts, path, title)
