"""What a user reads under attack: the attack success rate of a backdoor counted by hand on a
model whose predictions are known, the benign clients' accuracy and ASR pooled as documented,
and a run's summary.json "attack", metrics rows and client_metrics.npz `malicious`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import finished_cli_run, linear_model, make_raw

from fedjax_pfl.algorithms import engine as engine_lib
from fedjax_pfl.core import client_mapper
from fedjax_pfl.core.evaluate import Backdoor, ClientEval, Evaluator
from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.runner.records import attack_metrics

C, F, K, TARGET = 3, 5, 2, 1


def test_asr_against_a_hand_count():
    x, y, train, test, _, _ = make_raw([6, 8, 5], num_classes=C, feature_dim=F,
                                       test_sizes=[9, 7, 11], seed=4)
    data = FederatedData.from_arrays(x, y, train, test, num_classes=C, name="toy")
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(F, C)).astype(np.float32),
              "b": rng.normal(size=C).astype(np.float32)}
    params["w"][-K:, TARGET] += 0.8        # a trigger that sometimes, not always, wins
    evaluator = Evaluator(linear_model(F, C), batch_size=4, mapper=client_mapper("chunked", 0),
                          backdoor=Backdoor(TARGET, K))
    got = evaluator.shared(data, jax.tree.map(jnp.asarray, params))
    hits, counts = [], []
    for rows in test:                      # by hand: trigger, predict, count label ≠ target
        xt = x[rows].astype(np.float64).copy()
        xt[:, -K:] = 1.0
        pred = np.argmax(xt @ params["w"] + params["b"], axis=1)
        keep = y[rows] != TARGET
        hits.append(int(np.sum(keep & (pred == TARGET))))
        counts.append(int(np.sum(keep)))
    np.testing.assert_array_equal(np.asarray(got.backdoor_hits), hits)
    np.testing.assert_array_equal(np.asarray(got.backdoor_count), counts)
    assert 0 < sum(hits) < sum(counts)
    # The clean accuracy is the plain evaluator's.
    plain = Evaluator(linear_model(F, C), batch_size=4, mapper=client_mapper("chunked", 0))
    np.testing.assert_array_equal(np.asarray(got.correct),
                                  np.asarray(plain.shared(data, params).correct))


def test_benign_accuracy_and_asr_are_pooled_over_the_benign_clients():
    ev = ClientEval(correct=np.array([3, 4, 1, 0]), loss_sum=np.zeros(4), count=np.array([4, 8, 2, 5]),
                    backdoor_hits=np.array([1, 6, 2, 0]), backdoor_count=np.array([2, 6, 2, 4]))
    malicious = np.array([False, True, False, False])
    out = attack_metrics({"client": ev, "global": ev}, None, 4, malicious)
    assert out["acc_mean_benign"] == pytest.approx((3 / 4 + 1 / 2 + 0 / 5) / 3)
    assert out["global_acc_mean_benign"] == out["acc_mean_benign"]
    assert out["asr"] == pytest.approx((1 + 2 + 0) / (2 + 2 + 4))
    assert out["clients_benign"] == 3
    # A subset evaluation (ids) reads the mask at the evaluated clients.
    sub = attack_metrics({"client": ClientEval(*(None if v is None else v[[1, 3]] for v in ev))},
                         np.array([1, 3]), 4, malicious)
    assert sub["acc_mean_benign"] == 0.0 and sub["asr"] == 0.0
    # Re-drawn every round: no benign set, the ASR over every client.
    assert attack_metrics({"client": ev}, None, 4, None) == {"asr": pytest.approx(9 / 14)}


def test_a_backdoored_run_reports_benign_accuracy_asr_and_the_malicious_set(tmp_path):
    summary, rows, printed = finished_cli_run(tmp_path, [
        "--algo", "fedavg", "--dataset", "digits", "--clients", "10", "--rounds", "2",
        "--attack", "backdoor", "--attack-fraction", "0.3", "--attack-seed", "7"])
    want = engine_lib.malicious_mask(0.3, 7, 10)
    npz = np.load(tmp_path / "client_metrics.npz")
    np.testing.assert_array_equal(npz["malicious"], want)
    record = summary["attack"]
    assert record["clients"] == 3 and record["ids"] == np.flatnonzero(want).tolist()
    acc = npz["accuracy"][-1]
    assert record["acc_mean_benign"] == pytest.approx(np.nanmean(acc[~want]))
    assert 0.0 <= record["asr"] <= 1.0 and "asr" in rows[-1]
    assert "attack backdoor" in printed and "3 of 10 malicious" in printed
