"""What a user reads under attack: the attack success rate of a backdoor counted by hand on a
model whose predictions are known, the benign clients' accuracy and ASR pooled as documented,
and a run's summary.json "attack", metrics rows and client_metrics.npz `malicious` (re-drawn sets
against the rounds' observed uploads), and an attacked run resumed from its checkpoint."""

from __future__ import annotations

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import run as cli  # experiments/run.py (on the tests' pythonpath)
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


@pytest.mark.slow
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


def _redraw_flags(*extra):
    return ["--algo", "fedavg", "--dataset", "digits", "--clients", "10", "--attack-fraction", "0.3",
            "--attack-redraw", "--quiet", *extra]


@pytest.mark.slow
def test_redrawn_masks_in_client_metrics_are_the_sets_the_rounds_attacked(tmp_path):
    """--attack-redraw: client_metrics.npz's [R, N] `malicious` against what each round did. One
    client a round, a learning rate of 1e-30 (a benign upload moves no float32 weight: x + Δ = x)
    and pure Gaussian uploads (σ = 1): the server model moves in round r exactly when its one
    client was malicious in round r, by ‖ξ‖² ≈ d. The sets themselves are not recomputed here."""
    from fedjax_pfl import runner
    from fedjax_pfl.callbacks import Callback

    rounds = 30
    cfg = cli.config_from_args(cli.parse(_redraw_flags(
        "--participation", "0.1", "--lr", "1e-30", "--attack", "gaussian", "--attack-std", "1",
        "--rounds", str(rounds), "--eval-every", str(rounds), "--checkpoint-every", "0",
        "--out", str(tmp_path))))
    prep = runner.prepare(cfg)
    models = [[np.asarray(x) for x in
               jax.tree.leaves(prep.program.init(jax.random.fold_in(prep.root, 0)).params)]]

    class KeepServerModel(Callback):
        def on_round_end(self, event):
            models.append([np.array(x) for x in jax.tree.leaves(event.state.params)])

    runner.run(cfg, prepared=prep, log=lambda *_: None, callbacks=[KeepServerModel()])
    npz = np.load(tmp_path / "client_metrics.npz")
    mask, sampled = npz["malicious"], npz["sampled"]
    assert mask.shape == (rounds, 10) and sampled.shape == (rounds, 1)
    d = sum(x.size for x in models[0])
    moved = []
    for before, after in zip(models, models[1:]):
        sq = sum(float(np.sum((a.astype(np.float64) - b) ** 2)) for a, b in zip(after, before))
        assert sq == 0.0 or 0.5 * d < sq < 2 * d, sq            # nothing, or one N(0, I) upload
        moved.append(sq > 0)
    attacked = mask[np.arange(rounds), sampled[:, 0]]
    np.testing.assert_array_equal(attacked, moved)
    assert 0 < sum(moved) < rounds                                # both kinds of round happened
    # The documented draw: K = ⌈0.3·10⌉ = 3 clients every round, a set that changes.
    np.testing.assert_array_equal(mask.sum(axis=1), 3)
    assert len({tuple(row) for row in mask}) > 1


@pytest.mark.slow
@pytest.mark.parametrize("attack", [["--attack", "sign_flip", "--attack-scale", "4", "--attack-redraw"],
                                    ["--attack", "backdoor", "--aggregator", "median"]],
                         ids=["sign_flip_redrawn", "backdoor_median"])
def test_a_resumed_attacked_run_equals_the_uninterrupted_one(tmp_path, attack):
    """Stopped at round 2 (its checkpoint) and resumed to round 4: metrics.jsonl (benign accuracy,
    ASR), summary.json's attack record, client_metrics.npz (the malicious mask included, [R, N]
    when re-drawn) and the final state are those of a run never stopped, bit for bit."""
    from fedjax_pfl import checkpoint, runner

    def config(out, rounds, *extra):
        return cli.config_from_args(cli.parse([
            "--algo", "fedavg", "--dataset", "digits", "--clients", "10", "--participation", "0.5",
            "--attack-fraction", "0.3", *attack, "--quiet", "--out", str(out), "--rounds", str(rounds),
            "--checkpoint-every", "2", *extra]))

    quiet = lambda *_: None
    prep = runner.prepare(config(tmp_path / "full", 4))
    full = runner.run(config(tmp_path / "full", 4), prepared=prep, log=quiet)
    runner.run(config(tmp_path / "resumed", 2), prepared=prep, log=quiet)
    resumed = runner.run(config(tmp_path / "resumed", 4, "--resume"), prepared=prep, log=quiet)

    rows = helpers.metric_rows(tmp_path / "resumed")
    assert rows == helpers.metric_rows(tmp_path / "full") and len(rows) == 4
    assert ("acc_mean_benign" in rows[-1]) == ("--attack-redraw" not in attack)
    assert ("asr" in rows[-1]) == ("backdoor" in attack)
    assert resumed["attack"] == full["attack"]
    a, b = (np.load(tmp_path / run / "client_metrics.npz") for run in ("full", "resumed"))
    assert sorted(a.files) == sorted(b.files) and "malicious" in a.files
    for key in a.files:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    assert a["malicious"].shape == ((4, 10) if "--attack-redraw" in attack else (10,))
    like = prep.program.init(jax.random.fold_in(prep.root, 0))
    final = "checkpoints/round_000004"
    for x, y in zip(jax.tree.leaves(checkpoint.restore(str(tmp_path / "full" / final), like=like)),
                    jax.tree.leaves(checkpoint.restore(str(tmp_path / "resumed" / final), like=like)),
                    strict=True):
        np.testing.assert_array_equal(helpers.host_array(x), helpers.host_array(y))
