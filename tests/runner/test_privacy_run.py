"""A private run from the command line (`--dp-clip`, `--target-epsilon`, `--dp-delta`): the noise
multiplier is chosen before the run so that ε after the planned rounds meets the target (the
smallest such z: 2 % less noise misses it), every metrics row reports ε after its round, the
summary records the budget; the flags are refused where they cannot apply."""

import json
import re

import pytest

from fedjax_pfl import runner
from fedjax_pfl.privacy import accounting


def _config(out, *flags):
    import run as cli  # experiments/run.py

    return cli.config_from_args(cli.parse(["--algo", "fedavg", "--quiet", "--out", str(out),
                                           "--clients", "10", "--participation", "0.5",
                                           "--rounds", "3", *flags]))


@pytest.mark.slow
def test_a_run_at_a_target_epsilon_reports_epsilon_after_every_round(tmp_path):
    summary = runner.run(_config(tmp_path, "--dp-clip", "0.5", "--target-epsilon", "4",
                                 "--dp-delta", "1e-3"))
    privacy = summary["privacy"]
    z = privacy["noise_multiplier"]
    assert (privacy["clip"], privacy["delta"], privacy["clients"], privacy["clients_per_round"],
            privacy["sampling"], privacy["accountant"]) == (0.5, 1e-3, 10, 5, "fixed", "rdp")
    common = dict(num_clients=10, clients_per_round=5, sampling="fixed", delta=1e-3,
                  accountant="rdp")
    assert accounting.epsilon(z, rounds=3, **common) <= 4.0
    assert accounting.epsilon(0.98 * z, rounds=3, **common) > 4.0       # the least noise that fits
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    eps = [row["dp_epsilon"] for row in rows]
    assert eps == pytest.approx([accounting.epsilon(z, rounds=r, **common) for r in (1, 2, 3)])
    assert eps[0] < eps[1] < eps[2] == summary["dp_epsilon"] <= 4.0
    assert all(row["dp_clipped_fraction"] >= 0 for row in rows)
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["dp_epsilon"] == summary["dp_epsilon"]


@pytest.mark.parametrize("flags, words", [
    (["--target-epsilon", "4"], "--target-epsilon needs --dp-clip"),
    (["--dp-clip", "1", "--dp-noise-multiplier", "1", "--target-epsilon", "4"], "not both"),
    (["--dp-clip", "1", "--dp-delta", "2"], "--dp-delta must be in"),
    (["--algo", "pgfedmo", "--dp-clip", "1"], "pgfedmo does not privatise its uplink"),
    (["--sampling", "poisson"], "--sampling poisson needs --dp-clip"),
    (["--dp-clip-quantile", "0.5"], "needs --dp-clip"),
    (["--dp-clip", "1", "--dp-clip-quantile", "0.5", "--dp-noise-multiplier", "2"],
     "must exceed z/2"),
    (["--dp-clip", "1", "--dp-accountant", "pld"], "use rdp, or --sampling poisson"),
    (["--dp-clip", "1", "--sampling", "poisson", "--data-placement", "host"],
     "device placement only"),
])
def test_privacy_flags_that_cannot_apply_are_refused(tmp_path, flags, words):
    import run as cli  # experiments/run.py: the command line's words, its flags

    with pytest.raises(ValueError) as exc:     # (from the flags alone where they can tell)
        runner.prepare(_config(tmp_path, *flags))
    algo = "pgfedmo" if "pgfedmo" in flags else "fedavg"
    assert re.search(words, cli.message(exc.value, algo)), cli.message(exc.value, algo)


@pytest.mark.slow
def test_clipping_without_noise_bounds_nothing_and_the_files_stay_strict_json(tmp_path):
    """--dp-clip inf (no clipping) and no noise: ε is unbounded, written as null (JSON has no
    infinity), and the files parse as strict JSON."""
    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))

    summary = runner.run(_config(tmp_path, "--dp-clip", "inf", "--rounds", "2"))
    assert summary["dp_epsilon"] is None and summary["privacy"]["clip"] is None
    assert strict((tmp_path / "summary.json").read_text())["dp_epsilon"] is None
    rows = [strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["dp_epsilon"] for row in rows] == [None, None]


def test_a_poisson_round_row_counts_its_participants_only():
    """The row of a round with empty slots (padding client 10 of 10 real clients): the mean
    training loss of the participants, their number; without Poisson sampling every slot counts."""
    m = {"sampled": [3, 7, 10, 10], "train_loss": [1.0, 3.0, 0.0, 0.0], "client_steps": 4}
    row = runner.round_row(1, m, 0.1, n_real=10)
    assert (row["train_loss"], row["participants"]) == (2.0, 2)
    assert runner.round_row(1, m, 0.1)["train_loss"] == 1.0
    empty = runner.round_row(1, {**m, "sampled": [10, 10, 10, 10]}, 0.1, n_real=10)
    assert empty["participants"] == 0 and empty["train_loss"] is None   # strict JSON: null
    # TDPFed and pFedMe report every client's loss ("trained"), the padding client's among them.
    everyone = {**m, "trained": list(range(11)), "train_loss": [2.0] * 10 + [0.0]}
    assert runner.round_row(1, everyone, 0.1, n_real=10)["train_loss"] == 2.0
    logged = runner.round_slots(m, 10, poisson=True)
    assert logged.tolist() == [3, 7, -1, -1]
    assert runner.participants(logged).tolist() == [3, 7]


@pytest.mark.slow
def test_a_poisson_sampled_run(tmp_path):
    """--sampling poisson: every row's ε is the Poisson-subsampled Gaussian's; the logged ids are
    the participants and −1 for empty slots, as many as the row's "participants"; the summary's
    ε with --dp-accountant pld is PLD's; evaluating the participants skips the empty slots."""
    import numpy as np

    z, q = 1.0, 0.3
    summary = runner.run(_config(tmp_path, "--dp-clip", "1", "--dp-noise-multiplier", str(z),
                                 "--sampling", "poisson", "--participation", str(q),
                                 "--dp-delta", "1e-3", "--dp-accountant", "pld",
                                 "--eval-clients", "participants", "--eval-every", "1"))
    privacy = summary["privacy"]
    assert (privacy["sampling"], privacy["rate"], privacy["rows_accountant"],
            privacy["accountant"]) == ("poisson", q, "rdp", "pld")
    common = dict(num_clients=10, rate=q, sampling="poisson", delta=1e-3)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["dp_epsilon"] for row in rows] == pytest.approx(
        [accounting.epsilon(z, rounds=r, accountant="rdp", **common) for r in (1, 2, 3)])
    assert summary["dp_epsilon"] == pytest.approx(
        accounting.epsilon(z, rounds=3, accountant="pld", **common))
    logged = np.load(tmp_path / "client_metrics.npz")["sampled"]
    assert logged.shape == (3, privacy["slots"])
    assert np.all((logged == -1) | ((logged >= 0) & (logged < 10)))
    assert [int((r >= 0).sum()) for r in logged] == [row["participants"] for row in rows]
    for row in rows:
        assert row["eval_clients"] == (10 if row["round"] == 3 else row["participants"])


@pytest.mark.slow
def test_adaptive_clipping_with_poisson_sampling_resumes_exactly(tmp_path):
    """The clip norm is server state: a run stopped at its round-2 checkpoint and resumed writes
    the rows of the uninterrupted run (each row's clip C_t among them), with Poisson sampling;
    the summary records C_0 and the noise split z_Δ, σ_b that the accounted z stands for."""
    flags = ["--dp-clip", "0.05", "--dp-clip-quantile", "0.5", "--dp-noise-multiplier", "0.3",
             "--sampling", "poisson", "--checkpoint-every", "2"]
    full = runner.run(_config(tmp_path / "full", *flags, "--rounds", "4"))
    runner.run(_config(tmp_path / "resumed", *flags, "--rounds", "2"))
    runner.run(_config(tmp_path / "resumed", *flags, "--rounds", "4", "--resume"))

    def rows(out):
        return [{k: v for k, v in json.loads(line).items() if k != "round_time"}
                for line in (out / "metrics.jsonl").read_text().splitlines()]

    assert rows(tmp_path / "resumed") == rows(tmp_path / "full")
    clips = [row["dp_clip"] for row in rows(tmp_path / "full")]
    assert clips[0] == pytest.approx(0.05) and len(set(clips)) == 4
    adaptive = full["privacy"]["adaptive_clip"]
    sigma = 0.5 * 10 / 20                                    # D/20, D = q·N = 5
    assert adaptive["count_noise"] == pytest.approx(sigma)
    assert (adaptive["update_noise_multiplier"] ** -2 + (2 * sigma) ** -2) ** -0.5 == \
        pytest.approx(0.3, rel=1e-5)


def _plan(target, clients=20, participation=0.25, rounds=50):
    from fedjax_pfl import algorithms
    from fedjax_pfl.runner import privacy

    cfg = runner.RunConfig(rounds=rounds, target_epsilon=target)
    hparams = algorithms.spec("fedavg").resolve({"dp_clip": 1.0, "participation": participation})
    return privacy.plan(cfg, hparams, clients)


@pytest.mark.slow
def test_a_target_epsilon_that_calls_for_useless_noise_or_the_accountants_floor_is_warned():
    """20 clients, M = 5 a round, 10 rounds, δ = 20^-1.1. ε = 1e-6 is below what RDP resolves:
    the z it gets has ε(z) = 0.0 (the floor) where 0.1 % less noise has ε ~ 4e-5 ≫ 1e-6; and
    that z is far above M = 5 (noise on the mean z·C/M > C). ε = 1 still needs z > 5 here."""
    from fedjax_pfl.errors import OptionWarning

    delta = 20 ** -1.1
    common = dict(rounds=10, num_clients=20, clients_per_round=5, sampling="fixed", delta=delta)
    with pytest.warns(OptionWarning) as caught:
        _, plan = _plan(1e-6, rounds=10)
    (w,) = caught
    z = plan.noise_multiplier
    assert accounting.epsilon(z, **common) == 0.0 < accounting.epsilon(0.999 * z, **common) > 1e-5
    text = str(w.message)
    assert text.startswith(f"target_epsilon 1e-06 calls for dp_noise_multiplier {z:.4g}: above "
                           "the 5 clients a round, the noise on the mean update (z·C/M) exceeds")
    assert "its ε = 0 is the accountant's precision floor, not the target met" in text
    assert "\n" not in text
    with pytest.warns(OptionWarning) as caught:
        _, plan = _plan(1.0, rounds=10)
    assert plan.noise_multiplier > 5 and "above the 5 clients" in str(caught[0].message)
    assert "floor" not in str(caught[0].message)        # ε(z) is the target, within tolerance
    assert accounting.epsilon(plan.noise_multiplier, **common) == pytest.approx(1.0, rel=1e-2)


@pytest.mark.slow
def test_a_target_epsilon_a_run_can_learn_under_is_not_warned():
    """100 clients, M = 50 a round, 3 rounds, ε = 4: z ≈ 1 ≪ M, ε(z) at the target."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, plan = _plan(4.0, clients=100, participation=0.5, rounds=3)
    assert 0 < plan.noise_multiplier < 50
