"""Round statistics on constructed cases, worked out by hand."""

import numpy as np
import pytest

from fedjax_pfl.core.metrics import History, summarize


def test_summary_statistics_by_hand():
    # Ten clients with test sizes 10 and accuracies 0.0, 0.1, ..., 0.9, plus one without test data.
    count = np.array([10] * 10 + [0])
    correct = np.array(list(range(10)) + [0])
    loss_sum = np.array([10.0] * 10 + [0.0])  # mean loss 1.0 for every client
    s = summarize(correct, loss_sum, count)
    assert s["acc_mean"] == pytest.approx(0.45)            # (0 + ... + 0.9) / 10
    assert s["acc_weighted"] == pytest.approx(45 / 100)
    assert s["acc_min"] == 0.0
    assert s["acc_p10"] == pytest.approx(0.09)             # linear: 0.0 + 0.9·(0.1 − 0.0)
    assert s["acc_worst10"] == pytest.approx(0.0)          # ⌈0.1·10⌉ = 1 lowest client
    # population std of 0.0..0.9: sqrt(mean((k/10 − 0.45)²)) = sqrt(0.0825)
    assert s["acc_std"] == pytest.approx(np.sqrt(0.0825))
    assert s["loss"] == pytest.approx(1.0)


def test_weighted_differs_from_unweighted():
    # A big client at 1.0 (90 samples) and a small one at 0.0 (10 samples).
    s = summarize([90, 0], [0.0, 5.0], [90, 10])
    assert s["acc_mean"] == pytest.approx(0.5)
    assert s["acc_weighted"] == pytest.approx(0.9)
    assert s["loss"] == pytest.approx((0.0 + 0.5) / 2)
    assert s["loss_weighted"] == pytest.approx(5.0 / 100)
    # 20 clients: the worst 10 % are the 2 lowest.
    acc = np.arange(20) / 20
    assert summarize(acc * 20, np.zeros(20), np.full(20, 20))["acc_worst10"] == pytest.approx(0.025)


def test_participant_best_is_max_over_rounds_taken_part_in():
    h = History(3)
    h.record_participants(np.array([0.5, 0.9, 0.1]), np.array([0]))      # only client 0 counts
    m = h.record_participants(np.array([0.4, 0.2, 0.3]), np.array([0, 2]))
    # client 0: max(0.5, 0.4) = 0.5; client 2: 0.3; client 1 never sampled: excluded.
    assert m["participant_best_mean"] == pytest.approx(0.4)
    assert m["participant_best_clients"] == 2
    assert m["acc_participants"] == pytest.approx(0.35)


def test_best_and_last():
    h = History(1)
    h.append({"round": 1, "acc_mean": 0.5, "train_loss": 2.0})
    h.append({"round": 2, "acc_mean": 0.7, "train_loss": 1.0})
    h.append({"round": 3, "acc_mean": 0.6, "train_loss": 1.5})
    out = h.best_and_last()
    assert out["best"] == {"acc_mean": 0.7, "train_loss": 1.0}
    assert out["last"] == {"acc_mean": 0.6, "train_loss": 1.5}
