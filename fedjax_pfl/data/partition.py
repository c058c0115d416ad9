"""Seeded, deterministic partitioners: which samples each client holds (host-side numpy).

Each partitioner returns a list of N int64 arrays of sample indices (disjoint). The per-client
train/test split is separate (`split_train_test`). The setups of our source papers map to:

  PGFed (CIFAR, Dir(0.3), min 40 samples)      dirichlet(alpha=0.3, min_size=40)
  pFedSOP Dir(0.07)                            dirichlet(alpha=0.07)  (class-wise, pfedsop.md#a10)
  the same skew with equal client sizes        dirichlet_client(alpha=0.07)  (Hsu et al. 2019)
  pFedSOP pathological (shard-COUNT reading)   shards(shards_per_client=2)   # 200 shards, 100 clients
  pFedMe / TDPFed two labels per client        pathological(classes_per_client=2)
  clients in G groups with disjoint label sets clustered(clusters=G)   (FedPC's planted graph)
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from fedjax_pfl.errors import OptionError, arg

PARTITIONS: tuple[str, ...] = ("iid", "dirichlet", "dirichlet_client", "pathological", "shards",
                               "clustered", "natural")


class PartitionError(OptionError):
    """A partition that cannot be built with the requested settings: the message names them as
    `build.PartitionConfig`'s fields (`errors.arg(name, "partition")`; the functions here take the
    same names)."""


def _p(name: str) -> str:
    """A PartitionConfig field, marked in a message."""
    return arg(name, "partition")


def iid(num_samples: int, num_clients: int, *, seed: int) -> list[np.ndarray]:
    """A uniformly random split into N near-equal parts (sizes differ by at most one)."""
    _check_clients(num_samples, num_clients)
    perm = np.random.default_rng(seed).permutation(num_samples)
    return [np.sort(part) for part in np.array_split(perm, num_clients)]


def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    *,
    alpha: float,
    seed: int,
    min_size: int = 10,
    max_tries: int = 100,
) -> list[np.ndarray]:
    """Label-skew partition: for each class, proportions p ~ Dir(α·1_N) split its samples.

    The recipe of the PGFed reference code (after IBM's PFNM): classes are processed in order; for
    each, clients that already hold ≥ n/N samples get proportion 0 (the rest renormalised), which
    keeps client sizes from running away; the shuffled class is cut at ⌊cumsum(p)·n_c⌋. The whole
    draw is repeated until every client has at least `min_size` samples, at most `max_tries`
    times; then a PartitionError says what to change (PFLlib loops forever here).
    """
    labels = np.asarray(labels)
    _check_clients(labels.size, num_clients)
    if not alpha > 0:
        raise PartitionError(f"{_p('alpha')} must be > 0, got {alpha}")
    if min_size * num_clients > labels.size:
        raise PartitionError(
            f"{_p('min_size')} {min_size} × {_p('num_clients')} {num_clients} exceeds the "
            f"{labels.size} samples: use at most {_p('num_clients')} "
            f"{labels.size // max(min_size, 1)}, or {_p('min_size')} at most "
            f"{labels.size // num_clients} (the mean client size; dirichlet rarely reaches it), or "
            f"{_p('scheme')} dirichlet_client (equal client sizes, any {_p('alpha')})"
        )
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    cap = labels.size / num_clients
    smallest = best = 0
    for _ in range(max_tries):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for c in classes:
            members = np.flatnonzero(labels == c)
            rng.shuffle(members)
            p = rng.dirichlet(np.full(num_clients, alpha))
            sizes = np.array([len(q) for q in parts])
            p = np.where(sizes < cap, p, 0.0)
            total = p.sum()
            p = p / total if total > 0 else np.full(num_clients, 1.0 / num_clients)
            cuts = (np.cumsum(p) * members.size).astype(int)[:-1]
            for client, piece in enumerate(np.split(members, cuts)):
                parts[client].extend(piece.tolist())
        smallest = min(len(q) for q in parts)
        best = max(best, smallest)
        if smallest >= min_size:
            return [np.sort(np.asarray(q, dtype=np.int64)) for q in parts]
    # The draws do not depend on min_size: with the same seed, min_size `best` succeeds.
    feasible = (f"{_p('min_size')} {best} works with this seed" if best > 0 else
                "no draw gave every client a sample")
    raise PartitionError(
        f"dirichlet partition: in {max_tries} draws the smallest client never reached "
        f"{_p('min_size')} {min_size} (alpha={alpha}, {num_clients} clients, {labels.size} "
        f"samples); {feasible}; or raise {_p('alpha')} (less skew), use fewer "
        f"{_p('num_clients')}, or {_p('scheme')} dirichlet_client (equal client sizes, feasible "
        f"for any {_p('alpha')})"
    )


def dirichlet_client(labels: np.ndarray, num_clients: int, *, alpha: float, seed: int) -> list[np.ndarray]:
    """Label skew with equal client sizes: client k's label proportions are q_k ~ Dir(α·1_C).

    The per-client reading of Dirichlet label skew (Hsu, Qi & Brown 2019). Every client gets
    ⌊n/N⌋ or ⌈n/N⌉ samples, drawn class by class from q_k among the classes that still have
    samples (renormalised when one runs out, so the last clients' labels drift toward what is
    left). Unlike the class-wise `dirichlet`, it cannot leave a client empty, so it is feasible
    for any α, e.g. Dir(0.07) over 100 clients of a 10-class dataset.
    """
    labels = np.asarray(labels)
    _check_clients(labels.size, num_clients)
    if not alpha > 0:
        raise PartitionError(f"{_p('alpha')} must be > 0, got {alpha}")
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    pools = [list(rng.permutation(np.flatnonzero(labels == c))) for c in classes]
    sizes = [len(part) for part in np.array_split(np.arange(labels.size), num_clients)]
    parts = []
    for size in sizes:
        q = rng.dirichlet(np.full(classes.size, alpha))
        taken: list[int] = []
        while len(taken) < size:
            left = np.array([len(pool) for pool in pools], float)
            weights = np.where(left > 0, q, 0.0)
            weights = weights / weights.sum() if weights.sum() > 0 else left / left.sum()
            counts = np.minimum(rng.multinomial(size - len(taken), weights), left.astype(int))
            for c, k in enumerate(counts):
                taken += pools[c][:k]
                del pools[c][:k]
        parts.append(np.sort(np.asarray(taken, dtype=np.int64)))
    return parts


def pathological(
    labels: np.ndarray, num_clients: int, *, classes_per_client: int, seed: int
) -> list[np.ndarray]:
    """Each client holds `classes_per_client` labels: client k gets {(k + j) mod C : j < c}.

    This is the label assignment of the pFedMe generator that TDPFed follows (k mod 10 and
    (k+1) mod 10 for two labels). Each class's shuffled samples are split equally among the
    clients that hold it. Samples of a class no client holds (possible when N·c < C) are unused.
    """
    labels = np.asarray(labels)
    _check_clients(labels.size, num_clients)
    classes = np.unique(labels)
    if not 1 <= classes_per_client <= classes.size:
        raise PartitionError(
            f"{_p('classes_per_client')} must be in [1, {classes.size}], got {classes_per_client}"
        )
    rng = np.random.default_rng(seed)
    holders: dict[int, list[int]] = {int(c): [] for c in classes}
    for k in range(num_clients):
        for j in range(classes_per_client):
            holders[int(classes[(k + j) % classes.size])].append(k)
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for c in classes:
        members = np.flatnonzero(labels == c)
        rng.shuffle(members)
        owners = holders[int(c)]
        if not owners:
            continue
        for owner, piece in zip(owners, np.array_split(members, len(owners))):
            parts[owner].extend(piece.tolist())
    return [np.sort(np.asarray(q, dtype=np.int64)) for q in parts]


def cluster_of_clients(num_clients: int, clusters: int) -> np.ndarray:
    """[N] planted cluster of each client under `clustered`: contiguous near-equal blocks of ids,
    client k in group g for the g-th block of np.array_split(range(N), G)."""
    groups = np.zeros(num_clients, np.int64)
    for g, block in enumerate(np.array_split(np.arange(num_clients), clusters)):
        groups[block] = g
    return groups


def clustered(labels: np.ndarray, num_clients: int, *, clusters: int, seed: int) -> list[np.ndarray]:
    """Clustered label skew: G groups of clients, each group with its own disjoint label set.

    The classes (sorted) are cut into G near-equal contiguous sets (np.array_split), the clients
    into G near-equal contiguous blocks of ids (`cluster_of_clients`); group g's clients hold
    exactly the labels of set g, and each of those labels' shuffled samples is dealt in near-equal
    parts among the group's clients. Every sample is assigned, clients of one group share their
    label set and clients of different groups share none: a similarity graph has G clusters to
    find (docs/algorithms/fedpc.md#graph), and `cluster_of_clients` gives the planted truth.
    """
    labels = np.asarray(labels)
    _check_clients(labels.size, num_clients)
    classes = np.unique(labels)
    if not 1 <= clusters <= min(classes.size, num_clients):
        raise PartitionError(
            f"{_p('clusters')} must be in [1, min(classes, clients)] = "
            f"[1, {min(classes.size, num_clients)}], got {clusters}")
    rng = np.random.default_rng(seed)
    groups = cluster_of_clients(num_clients, clusters)
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for g, label_set in enumerate(np.array_split(classes, clusters)):
        owners = np.flatnonzero(groups == g)
        for c in label_set:
            members = np.flatnonzero(labels == c)
            rng.shuffle(members)
            for owner, piece in zip(owners, np.array_split(members, owners.size)):
                parts[owner].extend(piece.tolist())
    return [np.sort(np.asarray(q, dtype=np.int64)) for q in parts]


def shards(
    labels: np.ndarray,
    num_clients: int,
    *,
    seed: int,
    shards_per_client: int | None = None,
    shard_size: int | None = None,
) -> list[np.ndarray]:
    """McMahan-style shards: sort by label, cut into equal contiguous shards, deal them out.

    Give exactly one of `shards_per_client` (b: N·b shards of size ⌊n/(N·b)⌋) or `shard_size`
    (z: ⌊n/z⌋ shards, ⌊#shards/N⌋ per client). Each client receives its shards at random without
    replacement, so "b classes" means AT MOST b classes (two shards may share a label). pFedSOP's
    CIFAR-10 setting is the shard-count reading: 200 shards of 300, b = 2
    (docs/algorithms/pfedsop.md#a11). The
    remainder that does not fill a whole shard is left unassigned; `unassigned_count` reports it.
    """
    labels = np.asarray(labels)
    _check_clients(labels.size, num_clients)
    if (shards_per_client is None) == (shard_size is None):
        raise PartitionError(f"shards: give exactly one of {_p('shards_per_client')} or "
                             f"{_p('shard_size')}")
    n = labels.size
    if shards_per_client is not None:
        if shards_per_client < 1:
            raise PartitionError(f"{_p('shards_per_client')} must be >= 1, got {shards_per_client}")
        num_shards = num_clients * shards_per_client
        size = n // num_shards
        if size < 1:
            raise PartitionError(
                f"{num_shards} shards ({num_clients} clients × {shards_per_client}) exceed {n} samples"
            )
    else:
        if shard_size < 1:
            raise PartitionError(f"{_p('shard_size')} must be >= 1, got {shard_size}")
        size = shard_size
        shards_per_client = (n // size) // num_clients
        if shards_per_client < 1:
            raise PartitionError(
                f"{_p('shard_size')} {size} gives {n // size} shards, fewer than {num_clients} "
                "clients"
            )
        num_shards = num_clients * shards_per_client
    rng = np.random.default_rng(seed)
    # Shuffle first so the order inside a label (and so which samples fall in the remainder) is random.
    perm = rng.permutation(n)
    by_label = perm[np.argsort(labels[perm], kind="stable")]
    cut = by_label[: num_shards * size].reshape(num_shards, size)
    deal = rng.permutation(num_shards).reshape(num_clients, shards_per_client)
    return [np.sort(cut[row].ravel()) for row in deal]


def natural(client_ids: np.ndarray, num_clients: int | None = None) -> list[np.ndarray]:
    """The dataset's own clients (e.g. Synthetic(α, β)): client k holds the samples with id k."""
    client_ids = np.asarray(client_ids)
    count = int(client_ids.max()) + 1
    if num_clients is not None and num_clients != count:
        raise PartitionError(
            f"this dataset has {count} natural clients; {_p('num_clients')} {num_clients} does "
            f"not match (for synthetic data set {arg('synthetic_clients', 'data')} instead)"
        )
    # One stable sort instead of a scan of every sample per client (20,000 clients of 4.75
    # million samples took 25 s that way): each client's sample indices, ascending.
    ids = client_ids[client_ids >= 0]
    order = np.flatnonzero(client_ids >= 0)[np.argsort(ids, kind="stable")]
    return np.split(order, np.cumsum(np.bincount(ids, minlength=count))[:-1])


def split_train_test(
    parts: Sequence[np.ndarray], *, test_fraction: float, seed: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per-client random split: ⌈f·n_i⌉ samples to test, the rest (⌊(1−f)·n_i⌋) to train.

    Unstratified, as in the reference codes, so train and test share the client's label
    distribution in expectation. Raises if a client would be left with no training sample.
    """
    if not 0.0 < test_fraction < 1.0:
        raise PartitionError(f"{_p('test_fraction')} must be in (0, 1), got {test_fraction}")
    rng = np.random.default_rng(seed)
    train, test = [], []
    for k, part in enumerate(parts):
        part = rng.permutation(np.asarray(part))
        n_test = test_size(part.size, test_fraction)
        if part.size - n_test < 1:
            raise PartitionError(
                f"client {k} has {part.size} samples: none left for training after the "
                f"{test_fraction} test split; use fewer {_p('num_clients')} or a larger "
                f"{_p('min_size')}"
            )
        test.append(np.sort(part[:n_test]))
        train.append(np.sort(part[n_test:]))
    return train, test


def test_size(n: int, test_fraction: float) -> int:
    """⌈f·n⌉: how many of a client's n samples `split_train_test` gives to test (a tolerance of
    1e-9 keeps f·n that is an integer in exact arithmetic from rounding up)."""
    return int(math.ceil(test_fraction * n - 1e-9))


def split_sizes(counts: np.ndarray, *, test_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) sample counts per client that `split_train_test` gives clients of `counts`
    samples, known before any sample exists (e.g. to pick the clients a process generates)."""
    counts = np.asarray(counts, np.int64)
    test = np.array([test_size(int(n), test_fraction) for n in counts], np.int64)
    return counts - test, test


def unassigned_count(parts: Sequence[np.ndarray], num_samples: int) -> int:
    """How many of the dataset's samples no client received."""
    return num_samples - int(sum(len(p) for p in parts))


def _check_clients(num_samples: int, num_clients: int) -> None:
    if num_clients < 1:
        raise PartitionError(f"{_p('num_clients')} must be >= 1, got {num_clients}")
    if num_clients > num_samples:
        raise PartitionError(
            f"{_p('num_clients')} {num_clients} is more than the {num_samples} samples in the "
            "dataset"
        )
