"""Guards for what a run reports (issue 30, item 10), through the public runner API
(`fedjax_pfl.runner.prepare/run/RunConfig`) on tiny custom data:

  * the round's mean training loss (metrics.jsonl "train_loss") divides by the right counts;
  * a resumed run's step counters (summary.json's client_steps_per_s · train_time_s, the per-round
    client_steps, the communication totals) equal an uninterrupted run's, and those counts equal
    their closed forms: Σ_rounds Σ_{sampled i} E·⌈n_i/B⌉ steps.

Expected values are computed here: the loss by a float64 NumPy softmax regression, the counts
from the client sizes and the sampled ids the run recorded."""

import json
import math

import numpy as np
import pytest

from fedjax_pfl import checkpoint, runner
from fedjax_pfl.data.federated import FederatedData

FEATURES, CLASSES = 4, 3
SIZES = [3, 7, 12, 5]
BATCH, EPOCHS, LR = 4, 2, 0.3


def _quiet(*_):
    pass


def _identical_samples_data(seed=0):
    """Client i's training samples are all one and the same (x_i, y_i), so every minibatch's
    masked mean loss is ℓ(θ; x_i, y_i) and its gradient ∇ℓ(θ; x_i, y_i) whatever the batch
    order, and local training is the deterministic gradient descent θ ← θ − η∇ℓ(θ; x_i, y_i)."""
    rng = np.random.default_rng(seed)
    rows_x, rows_y, train, test, start = [], [], [], [], 0
    points = []
    for n in SIZES:
        x_i, y_i = rng.normal(size=FEATURES).astype(np.float32), int(rng.integers(CLASSES))
        points.append((x_i.astype(np.float64), y_i))
        rows_x += [x_i] * n + list(rng.normal(size=(2, FEATURES)).astype(np.float32))
        rows_y += [y_i] * n + list(rng.integers(0, CLASSES, 2))
        train.append(np.arange(start, start + n))
        test.append(np.arange(start + n, start + n + 2))
        start += n + 2
    data = FederatedData.from_arrays(np.stack(rows_x), np.asarray(rows_y), train, test,
                                     num_classes=CLASSES, name="identical")
    return data, points


def _config(out, rounds, **kw):
    hparams = dict(lr=LR, batch_size=BATCH, local_epochs=EPOCHS, participation=1.0)
    hparams.update(kw.pop("hparams", {}))
    return runner.RunConfig(algo="fedavg", model="logreg", rounds=rounds, out=str(out),
                            progress=False, hparams=hparams, **kw)


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _logreg_params(path):
    """(kernel [F, C], bias [C]) of the global model in a FedAvg checkpoint, float64."""
    arrays = checkpoint.load_numpy(path)
    kernel = next(v for k, v in arrays.items() if k.endswith("['kernel']"))
    bias = next(v for k, v in arrays.items() if k.endswith("['bias']"))
    return np.asarray(kernel, np.float64), np.asarray(bias, np.float64)


def _loss_and_grad(w, b, x, y):
    logits = x @ w + b
    shift = logits.max()
    log_probs = logits - shift - np.log(np.exp(logits - shift).sum())
    err = np.exp(log_probs) - np.eye(CLASSES)[y]
    return -log_probs[y], np.outer(x, err), err


@pytest.mark.slow
def test_the_reported_training_loss_is_the_mean_over_each_clients_steps(tmp_path):
    """metrics.jsonl's train_loss of a round = the unweighted mean over the sampled clients of
    each client's mean minibatch loss over its E·⌈n_i/B⌉ local steps (n = 3, 7, 12, 5 with
    B = 4, E = 2: 2, 4, 6, 4 steps), each minibatch loss the mean over its real samples. Round 2
    starts from the global model of round 1's checkpoint; its loss is recomputed in NumPy."""
    data, points = _identical_samples_data()
    prep = runner.prepare(_config(tmp_path / "a", 1, checkpoint_every=1), data)
    runner.run(_config(tmp_path / "a", 1, checkpoint_every=1), prepared=prep, log=_quiet)
    runner.run(_config(tmp_path / "b", 2, checkpoint_every=2), prepared=prep, log=_quiet)
    w0, b0 = _logreg_params(runner.latest_checkpoint(str(tmp_path / "a")))
    per_client = []
    for n, (x, y) in zip(SIZES, points):
        w, b, losses = w0, b0, []
        for _ in range(EPOCHS * math.ceil(n / BATCH)):
            loss, gw, gb = _loss_and_grad(w, b, x, y)
            losses.append(loss)
            w, b = w - LR * gw, b - LR * gb
        per_client.append(np.mean(losses))
    row = _rows(tmp_path / "b")[1]
    assert row["round"] == 2
    np.testing.assert_allclose(row["train_loss"], np.mean(per_client), rtol=2e-5)
    assert row["client_steps"] == sum(EPOCHS * math.ceil(n / BATCH) for n in SIZES)   # 16
    # The loss falls along each client's steps, so a wrong divisor (S_i instead of E·S_i, n_i,
    # the longest client's step count) or a sample-weighted mean cannot hit the same value.
    assert abs(np.mean(per_client) - np.average(per_client, weights=SIZES)) > 1e-3


@pytest.mark.slow       # (a run resumed from its files; tests/runner/test_resume.py's quick test resumes too)
def test_a_resumed_run_keeps_its_step_counters(tmp_path):
    """4 rounds of FedAvg sampling 2 of 4 clients, against the same run stopped after round 2
    (its checkpoint) and resumed: the same per-round client_steps, and summary.json's total step
    rate client_steps_per_s = Σ_rounds Σ_{i ∈ S_r} E·⌈n_i/B⌉ (for the sampled ids the run
    recorded) over train_time_s, the sum of every recorded round's time, the first session's
    included."""
    data, _ = _identical_samples_data(seed=1)
    hp = {"participation": 0.5}
    cfg = lambda out, rounds, **kw: _config(out, rounds, checkpoint_every=2, hparams=hp, **kw)
    prep = runner.prepare(cfg(tmp_path / "full", 4), data)
    full = runner.run(cfg(tmp_path / "full", 4), prepared=prep, log=_quiet)
    first = runner.run(cfg(tmp_path / "res", 2), prepared=prep, log=_quiet)
    resumed = runner.run(cfg(tmp_path / "res", 4, resume=True), prepared=prep, log=_quiet)

    sampled = np.load(tmp_path / "full" / "client_metrics.npz")["sampled"]
    assert sampled.shape == (4, 2)
    steps = [sum(EPOCHS * math.ceil(SIZES[i] / BATCH) for i in ids) for ids in sampled]
    for out in ("full", "res"):
        np.testing.assert_array_equal(np.load(tmp_path / out / "client_metrics.npz")["sampled"], sampled)
        assert [r["client_steps"] for r in _rows(tmp_path / out)] == steps
    for summary, out in ((full, "full"), (resumed, "res")):
        # The train time is the sum of the recorded round times, the first session's included.
        round_times = [r["round_time"] for r in _rows(tmp_path / out)]
        np.testing.assert_allclose(summary["train_time_s"], sum(round_times), rtol=1e-9)
        np.testing.assert_allclose(summary["client_steps_per_s"], sum(steps) / sum(round_times),
                                   rtol=1e-9)
        assert summary["last_completed_round"] == 4
        # FedAvg sends the d = F·C + C model each way to each of the 2 sampled clients per round.
        d = FEATURES * CLASSES + CLASSES
        assert summary["communication"]["up_floats_total"] == 4 * 2 * d
    np.testing.assert_allclose(first["client_steps_per_s"] * first["train_time_s"], sum(steps[:2]),
                               rtol=1e-9)
    assert resumed["train_time_s"] > first["train_time_s"]
    # The first session's rounds are still the resumed run's rounds 1 and 2 (their times kept).
    np.testing.assert_allclose(first["train_time_s"],
                               sum(r["round_time"] for r in _rows(tmp_path / "res")[:2]), rtol=1e-9)
    # The resumed run's wall time carries the first session's, as its checkpoint recorded it
    # (not the first summary's, written later: that order is the machine's, not the code's).
    saved = checkpoint.read_metadata(str(tmp_path / "res" / "checkpoints" / "round_000002"))
    carried = saved["counters"]["wall_time"]
    later = sum(r["round_time"] for r in _rows(tmp_path / "res")[2:])    # rounds 3, 4
    assert 0 < carried <= first["wall_time_s"] and resumed["wall_time_s"] >= carried + later


@pytest.mark.parametrize("flags,flag", [
    (["--algo", "tdpfed", "--tdpfed-cr", "20"], "--tdpfed-cr"),
    (["--model", "cp_mlp", "--model-cr", "20"], "--model-cr"),
])
def test_a_compression_rate_clamped_at_rank_one_is_recorded_as_used(flags, flag):
    """digits' MLP 64-100-10 at CR 20: 6400/(20·164) = 1.95 → R = 2; 1000/(20·110) = 0.45 → 0,
    kept at rank 1. The rate used, (6400 + 1000)/(2·164 + 1·110) = 7400/438, goes into
    config.json beside the 20 given, and one warning line says so."""
    import run as cli

    from fedjax_pfl.errors import OptionWarning
    from fedjax_pfl.runner import loop

    cfg = cli.config_from_args(cli.parse(flags + ["--clients", "4", "--rounds", "1",
                                                  "--local-steps", "1", "--quiet", "--out", "o"]))
    with pytest.warns(OptionWarning) as caught:
        prep = runner.prepare(cfg)
    (w,) = [w for w in caught if isinstance(w.message, OptionWarning)]
    assert cli.message(w.message, cfg.algo) == (
        f"{flag} 20 would give 1 of 2 weight tensors rank 0 (Dense_1/kernel): they keep rank 1, "
        "so the compression used is 16.89, recorded as compression.used in config.json")
    record = loop._record(cfg, prep)["compression"]
    assert record == {"setting": flag[2:].replace("-", "_").replace("tdpfed_", ""),
                      "given": 20.0, "used": pytest.approx(7400 / 438),
                      "ranks": {"Dense_0/kernel": 2, "Dense_1/kernel": 1},
                      "clamped": ["Dense_1/kernel"]}


def test_a_compression_rate_no_rank_clamps_is_recorded_without_a_warning():
    """CR 2: 6400/328 = 19.5 → R = 20 and 1000/220 = 4.5 → 5: nothing clamped, nothing said."""
    import warnings

    import run as cli

    from fedjax_pfl.runner import loop

    cfg = cli.config_from_args(cli.parse(["--algo", "tdpfed", "--tdpfed-cr", "2", "--clients",
                                          "4", "--rounds", "1", "--local-steps", "1", "--quiet",
                                          "--out", "o"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prep = runner.prepare(cfg)
    assert loop._record(cfg, prep)["compression"]["ranks"] == {"Dense_0/kernel": 20,
                                                               "Dense_1/kernel": 5}
    assert loop._record(cfg, prep)["compression"]["clamped"] == []
