"""Partitioners: disjointness, coverage, the papers' setups, determinism and clear failures."""

import re

import numpy as np
import pytest

from fedjax_pfl.data import partition as P
from fedjax_pfl.data.build import PartitionConfig, build_federated
from fedjax_pfl.data.federated import label_counts
from fedjax_pfl.data.sources import load_raw

LABELS = np.repeat(np.arange(10), 600)  # 6,000 samples, 600 per class


def _check_disjoint(parts, n):
    flat = np.concatenate(parts)
    assert len(flat) == len(set(flat.tolist()))
    assert flat.min() >= 0 and flat.max() < n


def test_iid_covers_everything_in_near_equal_parts():
    parts = P.iid(103, 10, seed=0)
    _check_disjoint(parts, 103)
    assert sorted(len(p) for p in parts) == [10] * 7 + [11] * 3
    assert P.unassigned_count(parts, 103) == 0


def test_dirichlet_properties():
    parts = P.dirichlet(LABELS, 20, alpha=0.3, seed=1, min_size=40)
    _check_disjoint(parts, LABELS.size)
    assert P.unassigned_count(parts, LABELS.size) == 0          # every sample goes to a client
    assert min(len(p) for p in parts) >= 40
    again = P.dirichlet(LABELS, 20, alpha=0.3, seed=1, min_size=40)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))  # same seed, same partition


def _mean_label_entropy(parts):
    ent = []
    for p in parts:
        q = np.bincount(LABELS[p], minlength=10) / len(p)
        q = q[q > 0]
        ent.append(-(q * np.log(q)).sum())
    return np.mean(ent)


def test_smaller_alpha_means_more_label_skew():
    skewed = P.dirichlet(LABELS, 20, alpha=0.1, seed=0, min_size=1)
    mild = P.dirichlet(LABELS, 20, alpha=10.0, seed=0, min_size=1)
    assert _mean_label_entropy(skewed) < _mean_label_entropy(mild) - 0.5


def test_dirichlet_gives_up_with_a_clear_error():
    with pytest.raises(P.PartitionError, match=r"in 5 draws.*min_size 290") as exc:
        P.dirichlet(LABELS, 20, alpha=0.05, seed=0, min_size=290, max_tries=5)
    assert "dirichlet_client" in str(exc.value)
    # The message's feasible min_size really works with the same seed and draws.
    feasible = int(re.search(r"min_size (\d+) works", str(exc.value)).group(1))
    assert 0 < feasible < 290
    parts = P.dirichlet(LABELS, 20, alpha=0.05, seed=0, min_size=feasible, max_tries=5)
    assert min(map(len, parts)) >= feasible
    with pytest.raises(P.PartitionError, match=r"use at most num_clients 1\b") as exc:
        P.dirichlet(LABELS, 20, alpha=0.5, seed=0, min_size=LABELS.size)
    assert "dirichlet_client" in str(exc.value)
    # The names are PartitionConfig's (the command line says its flags, --clients, --min-size).
    assert exc.value.arguments[:2] == [("min_size", "partition"), ("num_clients", "partition")]
    with pytest.raises(P.PartitionError, match="^alpha must be > 0"):
        P.dirichlet(LABELS, 20, alpha=0.0, seed=0)


def test_pathological_two_labels_per_client_pfedme_assignment():
    parts = P.pathological(LABELS, 20, classes_per_client=2, seed=0)
    _check_disjoint(parts, LABELS.size)
    for k, p in enumerate(parts):
        assert set(LABELS[p].tolist()) == {k % 10, (k + 1) % 10}   # pFedMe: k mod 10, k+1 mod 10
    assert P.unassigned_count(parts, LABELS.size) == 0


def test_shards_count_reading_of_pfedsop():
    # pFedSOP CIFAR-10: 200 shards of 300 for 100 clients, b = 2 shards each
    # (docs/algorithms/pfedsop.md#a11).
    labels = np.repeat(np.arange(10), 6000)
    parts = P.shards(labels, 100, seed=0, shards_per_client=2)
    _check_disjoint(parts, labels.size)
    assert all(len(p) == 600 for p in parts)
    assert all(len(set(labels[p].tolist())) <= 2 for p in parts)       # at most b classes
    by_size = P.shards(labels, 100, seed=0, shard_size=300)
    assert all(len(p) == 600 for p in by_size)


def test_shards_leftover_is_reported():
    parts = P.shards(np.repeat(np.arange(3), 7), 4, seed=0, shards_per_client=1)  # 21 → 4×5
    assert P.unassigned_count(parts, 21) == 1
    with pytest.raises(P.PartitionError, match="exactly one"):
        P.shards(LABELS, 10, seed=0)


def test_train_test_split_sizes():
    parts = [np.arange(0, 8), np.arange(8, 11), np.arange(11, 51)]
    train, test = P.split_train_test(parts, test_fraction=0.25, seed=0)
    # n_test = ceil(0.25 n), n_train = floor(0.75 n): 8 → 6/2, 3 → 2/1, 40 → 30/10.
    assert [len(t) for t in train] == [6, 2, 30]
    assert [len(t) for t in test] == [2, 1, 10]
    for p, a, b in zip(parts, train, test):
        assert set(a.tolist()) | set(b.tolist()) == set(p.tolist())
        assert not set(a.tolist()) & set(b.tolist())
    with pytest.raises(P.PartitionError, match="client 0 has 1 samples"):
        P.split_train_test([np.array([3])], test_fraction=0.25, seed=0)


def test_too_many_clients():
    with pytest.raises(P.PartitionError, match="num_clients 11 is more than the 10 samples"):
        P.iid(10, 11, seed=0)


def test_build_federated_on_digits():
    raw = load_raw("digits")
    data, info = build_federated(raw, PartitionConfig("dirichlet", 10, alpha=0.5, seed=3))
    counts = label_counts(data, "all")
    assert counts.sum() == raw.y.size == info["num_samples"]
    assert info["train_size"]["total"] + info["test_size"]["total"] == raw.y.size
    np.testing.assert_array_equal(counts.sum(0), np.bincount(raw.y, minlength=10))
    assert data.num_clients == 10 and data.x.dtype == np.uint8


def test_dirichlet_client_equal_sizes_and_skew():
    parts = P.dirichlet_client(LABELS, 30, alpha=0.07, seed=0)
    _check_disjoint(parts, LABELS.size)
    assert P.unassigned_count(parts, LABELS.size) == 0
    assert sorted({len(p) for p in parts}) == [200]               # 6000 / 30
    again = P.dirichlet_client(LABELS, 30, alpha=0.07, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    mild = P.dirichlet_client(LABELS, 30, alpha=10.0, seed=0)
    assert _mean_label_entropy(parts) < _mean_label_entropy(mild) - 1.0
    # Feasible where the class-wise recipe cannot give every client a sample.
    tiny = P.dirichlet_client(np.repeat(np.arange(10), 18), 100, alpha=0.07, seed=1)
    assert min(len(p) for p in tiny) >= 1


def test_clustered_groups_have_disjoint_label_sets_and_share_them_inside():
    # 10 classes, G = 3: label sets {0,1,2,3}, {4,5,6}, {7,8,9}; 20 clients in blocks 7, 7, 6.
    parts = P.clustered(LABELS, 20, clusters=3, seed=0)
    _check_disjoint(parts, LABELS.size)
    assert P.unassigned_count(parts, LABELS.size) == 0
    groups = P.cluster_of_clients(20, 3)
    np.testing.assert_array_equal(groups, [0] * 7 + [1] * 7 + [2] * 6)
    label_sets = [{0, 1, 2, 3}, {4, 5, 6}, {7, 8, 9}]
    for k, p in enumerate(parts):
        assert set(LABELS[p].tolist()) == label_sets[groups[k]]
    # Each label's 600 samples are dealt in near-equal parts among its group's clients.
    assert sorted({int((LABELS[p] == 0).sum()) for p in parts[:7]}) == [85, 86]
    assert [len(p) for p in parts[14:]] == [300] * 6                  # 3 labels × 600 / 6
    again = P.clustered(LABELS, 20, clusters=3, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = P.clustered(LABELS, 20, clusters=3, seed=1)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))


def test_clustered_limits_and_build_info():
    with pytest.raises(P.PartitionError, match="^clusters must be in"):
        P.clustered(LABELS, 20, clusters=11, seed=0)
    with pytest.raises(P.PartitionError, match="^clusters must be in"):
        P.clustered(LABELS, 5, clusters=6, seed=0)
    with pytest.raises(ValueError, match=r"^clusters must be in \[1, num_clients 4\]"):
        PartitionConfig("clustered", 4, clusters=0).validate()
    one = P.clustered(LABELS, 4, clusters=1, seed=0)       # one group: every client all labels
    assert all(set(LABELS[p].tolist()) == set(range(10)) for p in one)
    data, info = build_federated(load_raw("digits"), PartitionConfig("clustered", 12, clusters=4))
    assert info["clusters"] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    present = label_counts(data, "all") > 0
    for k in range(12):
        expected = np.zeros(10, bool)
        expected[np.array_split(np.arange(10), 4)[info["clusters"][k]]] = True
        np.testing.assert_array_equal(present[k], expected)


def test_natural_clients_hold_exactly_the_samples_with_their_id():
    """Client k holds the indices i with client_ids[i] == k, ascending (checked against that
    definition, sample by sample); an id with no samples gives an empty client, negative ids
    none; a client count (num_clients) other than the dataset's is refused."""
    rng = np.random.default_rng(0)
    ids = rng.integers(-1, 9, size=500)
    ids[ids == 4] = 5                                       # client 4: no samples
    parts = P.natural(ids)
    assert len(parts) == 9 and parts[4].size == 0
    for k, part in enumerate(parts):
        assert part.tolist() == [i for i in range(500) if ids[i] == k], k
    assert sum(p.size for p in parts) == int((ids >= 0).sum())
    with pytest.raises(P.PartitionError, match="9 natural clients; num_clients 8 does not match "
                       r"\(for synthetic data set synthetic_clients instead\)"):
        P.natural(ids, 8)
