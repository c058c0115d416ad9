"""Dataset statistics (data/stats.py) against hand-computed values and brute-force references."""

import json

import numpy as np
import pytest

from fedjax_pfl.data import stats
from fedjax_pfl.data.natural import NaturalClients, SourceInfo, Task


def clients(task, train, test, vocab=(), labels=()):
    """A NaturalClients from per-client (x, y) lists, built here with plain concatenation."""
    def cat(blocks, i):
        return np.concatenate([b[i] for b in blocks])

    def offsets(blocks):
        return np.array([0] + list(np.cumsum([len(b[1]) for b in blocks])), np.int64)

    return NaturalClients(task=task, source=SourceInfo(name="toy", format="leaf", files=(), vocab=vocab,
                                                       labels=labels),
                          client_ids=np.array([f"c{i}" for i in range(len(train))]),
                          train_x=cat(train, 0), train_y=cat(train, 1), train_offsets=offsets(train),
                          test_x=cat(test, 0), test_y=cat(test, 1), test_offsets=offsets(test))


def image_clients(train_counts, test_counts, labels_of=lambda n: np.zeros(n, np.int32)):
    task = Task(kind="classify", num_classes=4, inputs="image")
    mk = lambda n: (np.zeros((n, 2, 2, 1), np.uint8), labels_of(n))  # noqa: E731
    return clients(task, [mk(n) for n in train_counts], [mk(n) for n in test_counts])


def test_samples_per_client_quantiles_by_hand():
    # 11 clients: sorted train sizes 1..11, so h = 10q lands on integers: p10 = v1, median = v5, p90 = v9.
    train = [7, 3, 11, 1, 5, 9, 2, 10, 4, 8, 6]
    test = [2, 0, 1, 20, 3, 1, 0, 2, 3, 1, 2]          # sorted 0 0 1 1 1 2 2 2 3 3 20
    s = stats.describe(image_clients(train, test))
    assert s["clients"] == 11
    assert s["train_per_client"] == {"min": 1, "p10": 2, "median": 6, "p90": 10, "max": 11,
                                     "mean": 6.0, "total": 66}
    assert s["test_per_client"] == {"min": 0, "p10": 0, "median": 2, "p90": 3, "max": 20,
                                    "mean": 35 / 11, "total": 35}
    assert s["clients_without_test"] == 2 and s["clients_without_train"] == 0
    json.dumps(s)                                       # JSON-ready


def test_interpolated_quantiles_by_hand():
    # Sizes 1, 2, 3, 10: h = 3q; p10 = 1 + 0.3·1, median = 2 + 0.5·1, p90 = 3 + 0.7·7.
    s = stats.describe(image_clients([10, 1, 3, 2], [0, 0, 0, 0]))
    q = s["train_per_client"]
    assert (q["min"], q["max"]) == (1, 10)
    assert q["p10"] == pytest.approx(1.3) and q["median"] == pytest.approx(2.5) and q["p90"] == pytest.approx(7.9)
    assert s["clients_without_test"] == 4 and s["test_per_client"]["total"] == 0


def test_histogram_quantiles_match_the_expanded_values():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        values = rng.integers(0, 30, n)
        hist = np.bincount(values, minlength=35)
        got = stats.histogram_quantiles(hist)
        want = np.quantile(values.astype(np.float64), [0, 0.1, 0.5, 0.9, 1])
        np.testing.assert_allclose([got[k] for k in ("min", "p10", "median", "p90", "max")], want)
        assert got["total"] == values.sum() and got["mean"] == pytest.approx(values.mean())


def test_label_counts():
    lab = {3: np.array([0, 2, 2], np.int32), 2: np.array([3, 2], np.int32), 1: np.array([2], np.int32)}
    s = stats.describe(image_clients([3, 2], [1, 2], labels_of=lambda n: lab[n]))
    assert s["train"]["label_counts"] == [1, 0, 3, 1] and s["train"]["classes_present"] == 3
    assert s["test"]["label_counts"] == [0, 0, 2, 1]          # [2] and [3, 2]


VOCAB = ("<pad>", "<oov>", "a", "b", "c")


def token_clients(vocab=VOCAB):
    task = Task(kind="sequence", num_classes=5, inputs="tokens", vocab_size=5)
    x1 = np.array([[2, 1, 3, 0], [1, 1, 0, 0]], np.int32)     # 3 + 2 real tokens, 1 + 2 OOV
    x2 = np.array([[2, 2, 3, 2]], np.int32)                   # 4 real tokens, none OOV
    xt = np.array([[4, 1, 0, 0]], np.int32)                   # test: 2 real, 1 OOV
    return clients(task, [(x1, x1), (x2, x2)], [(xt, xt), (xt[:0], xt[:0])], vocab=vocab)


def test_token_lengths_and_vocabulary_coverage_by_hand():
    s = stats.describe(token_clients())
    tr, te = s["train"], s["test"]
    assert tr["tokens"] == 9 and tr["oov_tokens"] == 3 and tr["oov_fraction"] == pytest.approx(1 / 3)
    # Distinct non-PAD ids used {1, 2, 3} of the 4 non-PAD ids.
    assert tr["distinct_ids"] == 3 and tr["distinct_fraction"] == pytest.approx(0.75)
    # Lengths 3, 2, 4: sorted 2 3 4, h = 2q: p10 = 2 + 0.2, median 3, p90 = 3 + 0.8.
    assert tr["length"]["min"] == 2 and tr["length"]["max"] == 4 and tr["length"]["median"] == 3
    assert tr["length"]["p10"] == pytest.approx(2.2) and tr["length"]["p90"] == pytest.approx(3.8)
    assert tr["length_histogram"] == [0, 0, 1, 1, 1]
    assert te["tokens"] == 2 and te["oov_fraction"] == pytest.approx(0.5) and te["distinct_ids"] == 2
    assert s["clients_without_test"] == 1 and tr["ids_outside_vocab"] == 0
    assert "33.33%" in stats.format_table(s)


def test_no_oov_entry_means_no_oov_fraction():
    s = stats.describe(token_clients(vocab=("<pad>", "x", "a", "b", "c")))
    assert s["train"]["oov_fraction"] is None and s["train"]["oov_tokens"] is None
    assert "no <oov> id" in stats.format_table(s)


def test_tags_per_sample():
    task = Task(kind="multilabel", num_classes=6, inputs="features")
    y1 = np.array([[0, 5, -1], [2, -1, -1], [-1, -1, -1]], np.int32)
    y2 = np.array([[5, 1, 2]], np.int32)
    x = lambda n: np.zeros((n, 3), np.float32)  # noqa: E731
    s = stats.describe(clients(task, [(x(3), y1), (x(1), y2)], [(x(0), y1[:0]), (x(1), y2)]))
    tr = s["train"]
    # Tags per sample 2, 1, 0, 3: sorted 0 1 2 3, h = 3q: median 1.5, p10 0.3, p90 2.7.
    assert tr["tags_per_sample_histogram"] == [1, 1, 1, 1]
    assert tr["tags_per_sample"]["median"] == pytest.approx(1.5)
    assert tr["tags_per_sample"]["p10"] == pytest.approx(0.3) and tr["tags_per_sample"]["p90"] == pytest.approx(2.7)
    assert tr["tag_counts"] == [1, 1, 2, 0, 0, 2]
    assert "length" not in tr and "label_counts" not in tr
    assert "tags / sample" in stats.format_table(s)
