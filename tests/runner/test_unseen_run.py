"""A run with --unseen-clients (issue 57 item 3), every figure recomputed here from what it
wrote: client_metrics.npz's `unseen` is ⌈FRAC·N⌉ clients and its `rounds_trained` the count of
each id in `sampled`; the held-out clients never in `sampled`; acc_mean_seen / acc_mean_unseen
the NumPy means of accuracy[-1] over each side and participation_gap their difference, in
summary.json and metrics.jsonl's last row; the refusals name the option."""

import math

import numpy as np
import pytest
from helpers import finished_cli_run

from fedjax_pfl import runner
from fedjax_pfl.errors import OptionError

CLIENTS, ROUNDS, FRACTION = 10, 3, 0.3


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("unseen")
    summary, rows, printed = finished_cli_run(out, [
        "--algo", "fedavg", "--rounds", str(ROUNDS), "--clients", str(CLIENTS),
        "--participation", "0.5", "--unseen-clients", str(FRACTION)])
    return np.load(out / "client_metrics.npz"), summary, rows, printed


@pytest.mark.slow
def test_the_npz_marks_the_held_out_clients_and_counts_each_clients_rounds(cli_run):
    npz, summary, _, _ = cli_run
    unseen, sampled = npz["unseen"], npz["sampled"]
    assert unseen.dtype == bool and unseen.shape == (CLIENTS,)
    assert unseen.sum() == math.ceil(FRACTION * CLIENTS) == 3
    assert sampled.shape == (ROUNDS, 5)                        # M = ⌊10·0.5⌋ of all N
    assert not np.isin(sampled, np.flatnonzero(unseen)).any()
    counts = np.zeros(CLIENTS, int)
    for row in sampled:
        for i in row:
            counts[i] += 1
    np.testing.assert_array_equal(npz["rounds_trained"], counts)
    assert np.all(npz["rounds_trained"][unseen] == 0)
    assert summary["unseen"]["ids"] == np.flatnonzero(unseen).tolist()
    assert summary["unseen"]["rule"] == "the global model"


@pytest.mark.slow
def test_seen_and_unseen_accuracy_and_the_gap_from_the_npz(cli_run):
    npz, summary, rows, printed = cli_run
    acc, unseen = npz["accuracy"][-1], npz["unseen"]
    seen_mean = float(np.mean(acc[~unseen][~np.isnan(acc[~unseen])]))
    unseen_mean = float(np.mean(acc[unseen][~np.isnan(acc[unseen])]))
    record = summary["unseen"]
    assert record["round"] == ROUNDS and record["clients"] == 3
    assert record["acc_mean_seen"] == pytest.approx(seen_mean, rel=1e-12)
    assert record["acc_mean_unseen"] == pytest.approx(unseen_mean, rel=1e-12)
    assert record["participation_gap"] == pytest.approx(seen_mean - unseen_mean, abs=1e-12)
    last = rows[-1]
    for key in ("acc_mean_seen", "acc_mean_unseen", "participation_gap"):
        assert last[key] == pytest.approx(record[key], abs=1e-12)
    # The two sides' clients make the whole: acc_mean is their client-weighted mean.
    assert last["acc_mean"] == pytest.approx((7 * seen_mean + 3 * unseen_mean) / 10, rel=1e-12)
    assert f"gap {record['participation_gap']:.4f}" in printed


def test_refusals_name_the_option():
    with pytest.raises(OptionError, match=r"unseen_clients must be in \[0, 1\)"):
        runner.RunConfig.from_options(unseen_clients=1.0, quiet=True).validate()
    with pytest.raises(OptionError, match="unseen_clients does not apply: algo pfedme"):
        runner.RunConfig.from_options(algo="pfedme", unseen_clients=0.2)
    # ⌈0.6·10⌉ = 6 held out leaves 4 < M = ⌊10·0.5⌋ = 5
    cfg = runner.RunConfig.from_options(clients=10, unseen_clients=0.6, participation=0.5,
                                        rounds=1, out=None, quiet=True)
    with pytest.raises(OptionError, match="leaving 4: fewer than the 5 a round samples"):
        runner.prepare(cfg)
