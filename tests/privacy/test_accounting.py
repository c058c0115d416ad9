"""privacy.accounting against dp-accounting called directly (events built here), published
figures of TF Privacy, and the exact ε of the Gaussian mechanism in closed form."""

import math

import dp_accounting
import pytest

from fedjax_pfl import privacy
from fedjax_pfl.privacy import accounting

REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE


# ----------------------------------------------------------------------------------------------
# 1. The same number as dp-accounting called directly, with the event written out here.

def _direct(event, count, delta, accountant):
    return accountant.compose(dp_accounting.SelfComposedDpEvent(event, count)).get_epsilon(delta)


def _poisson(z, q):
    return dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))


def _fixed(z, n, m):
    # Replace one of N clients: the sum of clipped updates moves by up to 2C, so the Gaussian's
    # noise multiplier relative to its sensitivity is z/2.
    gaussian = dp_accounting.GaussianDpEvent(z / 2)
    return dp_accounting.SampledWithoutReplacementDpEvent(n, m, gaussian)


@pytest.mark.parametrize("z, q, rounds, delta", [(1.1, 0.02, 300, 1e-5), (0.8, 0.3, 40, 1e-6)])
def test_poisson_rdp_equals_dp_accounting(z, q, rounds, delta):
    want = _direct(_poisson(z, q), rounds, delta, dp_accounting.rdp.RdpAccountant())
    got = privacy.epsilon(z, rounds=rounds, num_clients=1000, rate=q, sampling="poisson",
                          delta=delta, accountant="rdp")
    assert got == pytest.approx(want, rel=1e-12)


def test_poisson_pld_equals_dp_accounting():
    want = _direct(_poisson(2.0, 0.05), 30, 1e-6, dp_accounting.pld.PLDAccountant())
    got = privacy.epsilon(2.0, rounds=30, num_clients=500, rate=0.05, sampling="poisson",
                          delta=1e-6, accountant="pld")
    assert got == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("z, n, m, rounds", [(1.2, 100, 10, 200), (3.0, 3400, 10, 1500)])
@pytest.mark.slow
def test_fixed_rdp_equals_dp_accounting(z, n, m, rounds):
    want = _direct(_fixed(z, n, m), rounds, 1e-5,
                   dp_accounting.rdp.RdpAccountant(neighboring_relation=REPLACE_ONE))
    got = privacy.epsilon(z, rounds=rounds, num_clients=n, clients_per_round=m, delta=1e-5)
    assert got == pytest.approx(want, rel=1e-12)


@pytest.mark.slow
def test_epsilons_equal_dp_accounting_after_each_round():
    poisson = privacy.epsilons(1.0, rounds=60, num_clients=200, rate=0.05, sampling="poisson",
                               delta=1e-5)
    fixed = privacy.epsilons(1.5, rounds=60, num_clients=200, clients_per_round=10, delta=1e-5)
    assert len(poisson) == len(fixed) == 60
    for t in (1, 17, 60):                         # entry t − 1 is ε after round t
        want = _direct(_poisson(1.0, 0.05), t, 1e-5, dp_accounting.rdp.RdpAccountant())
        assert poisson[t - 1] == pytest.approx(want, rel=1e-12), t
        want = _direct(_fixed(1.5, 200, 10), t, 1e-5,
                       dp_accounting.rdp.RdpAccountant(neighboring_relation=REPLACE_ONE))
        assert fixed[t - 1] == pytest.approx(want, rel=1e-12), t


def test_fixed_size_sampling_is_rdp_only_in_this_dp_accounting():
    event = _fixed(1.0, 100, 10)
    # dp-accounting 0.6.0: the RDP accountant takes WOR sampling under replace-one only, the PLD
    # accountant not at all (rdp_privacy_accountant.py:1064, pld_privacy_accountant.py:240).
    assert dp_accounting.rdp.RdpAccountant(neighboring_relation=REPLACE_ONE).supports(event)
    assert not dp_accounting.rdp.RdpAccountant().supports(event)        # add or remove one
    assert not dp_accounting.pld.PLDAccountant(neighboring_relation=REPLACE_ONE).supports(event)
    with pytest.raises(ValueError, match="PLD accountant does not support sampling='fixed'.*"
                                         "use accountant='rdp'"):
        privacy.epsilon(1.0, rounds=5, num_clients=100, clients_per_round=10, delta=1e-5,
                        accountant="pld")


# ----------------------------------------------------------------------------------------------
# 2. Published figures. TF Privacy's tests of its DP-SGD privacy statement,
# https://github.com/tensorflow/privacy/blob/03035d5d4a271ac795dab80f5bc1cef82fc3d462/
#   tensorflow_privacy/privacy/analysis/compute_dp_sgd_privacy_test.py
# lines 85-93 (`test_compute_dp_sgd_example_privacy`: num_epochs 1.2, noise multiplier 0.7,
# δ = 1e-5; steps = ceil(1.2 / q) = 120 with Poisson q = 0.01, ceil(1.2) = 2 without sampling;
# "microbatching" halves the noise multiplier for sensitivity 2, compute_dp_sgd_privacy_lib.py
# lines 179-181) and lines 199-200 and 294-295 (the statement for 10,000 examples, batch 64,
# 5 epochs, noise multiplier 2.0 with microbatching, δ = 1e-6: q = 0.0064, ceil(5/q) = 782 steps).
# Its 7-decimal figures are compared with assertAlmostEqual (±5e-8); the statement prints 3.

def _poisson_args(z, q, rounds, accountant):
    return dict(noise_multiplier=z, rate=q, rounds=rounds, sampling="poisson",
                accountant=accountant)


TFP_EXAMPLE = [  # (name in the source, our arguments, published ε)
    ("no_microbatching_with_subsampling_rdp", _poisson_args(0.7, 0.01, 120, "rdp"), 3.2392676),
    ("no_microbatching_with_subsampling_pld", _poisson_args(0.7, 0.01, 120, "pld"), 2.4612381),
    ("microbatching_with_subsampling_rdp", _poisson_args(0.35, 0.01, 120, "rdp"), 22.6248601),
    ("no_microbatching_no_subsampling_rdp", _poisson_args(0.7, 1.0, 2, "rdp"), 10.8602036),
    ("no_microbatching_no_subsampling_pld", _poisson_args(0.7, 1.0, 2, "pld"), 10.1224946),
    # Fixed-size sampling of all N clients under replace-one is the Gaussian with sensitivity 2C:
    # TF Privacy's sensitivity-doubled ("microbatching") Gaussian, same z = 0.7.
    ("microbatching_no_subsampling_rdp", dict(noise_multiplier=0.7, clients_per_round=50, rounds=2,
                                              sampling="fixed", accountant="rdp"), 26.2880374),
]


@pytest.mark.parametrize("name, kwargs, published", TFP_EXAMPLE, ids=[t[0] for t in TFP_EXAMPLE])
@pytest.mark.slow
def test_tf_privacy_published_example_privacy(name, kwargs, published):
    got = privacy.epsilon(num_clients=50, delta=1e-5, **kwargs)
    assert got == pytest.approx(published, abs=5e-8 + 1e-12), name   # 7 decimals; float slack


@pytest.mark.parametrize("accountant, published", [("rdp", 1.616), ("pld", 1.199)])
def test_tf_privacy_published_statement(accountant, published):
    got = privacy.epsilon(1.0, rounds=782, num_clients=10000, rate=64 / 10000, sampling="poisson",
                          delta=1e-6, accountant=accountant)
    assert got == pytest.approx(published, abs=5e-4)


# ----------------------------------------------------------------------------------------------
# 3. Closed form. With every client in every round (q = 1) T rounds of the Gaussian mechanism
# with sensitivity Δ and noise zC are one Gaussian mechanism with μ = (Δ/C)·√T / z, whose exact
# privacy curve is (Balle & Wang, "Improving the Gaussian Mechanism for Differential Privacy",
# ICML 2018, Theorem 8)  δ(ε) = Φ(μ/2 − ε/μ) − e^ε Φ(−μ/2 − ε/μ).  PLD is near exact; RDP is a
# valid upper bound within ~10 %. Δ = C for Poisson (add or remove one), 2C for fixed (replace one).

def _exact_gaussian_epsilon(mu, delta):
    phi = lambda x: 0.5 * math.erfc(-x / math.sqrt(2.0))
    curve = lambda eps: phi(mu / 2 - eps / mu) - math.exp(eps) * phi(-mu / 2 - eps / mu)
    lo, hi = 0.0, 1.0
    while curve(hi) > delta:
        hi *= 2
    for _ in range(200):                      # δ(ε) decreases in ε
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if curve(mid) > delta else (lo, mid)
    return hi


@pytest.mark.parametrize("z, rounds", [(1.0, 10), (5.0, 1000)])
@pytest.mark.slow
def test_full_participation_against_the_exact_gaussian(z, rounds):
    exact = _exact_gaussian_epsilon(math.sqrt(rounds) / z, 1e-5)
    pld = privacy.epsilon(z, rounds=rounds, num_clients=8, rate=1.0, sampling="poisson",
                          delta=1e-5, accountant="pld")
    assert exact - 1e-9 <= pld <= exact + 1e-5
    rdp = privacy.epsilon(z, rounds=rounds, num_clients=8, rate=1.0, sampling="poisson",
                          delta=1e-5)
    assert exact <= rdp <= 1.1 * exact
    exact_replace = _exact_gaussian_epsilon(2 * math.sqrt(rounds) / z, 1e-5)    # Δ = 2C
    fixed = privacy.epsilon(z, rounds=rounds, num_clients=8, clients_per_round=8, delta=1e-5)
    assert exact_replace <= fixed <= 1.1 * exact_replace


# ----------------------------------------------------------------------------------------------
# 4. Properties.

@pytest.mark.slow
def test_epsilon_grows_with_rounds_and_sampling_and_falls_with_noise():
    common = dict(num_clients=100, delta=1e-5)
    curve = privacy.epsilons(1.0, rounds=300, rate=0.05, sampling="poisson", **common)
    assert all(b >= a for a, b in zip(curve, curve[1:])) and curve[-1] > 2 * curve[0]
    by_rate = [privacy.epsilon(1.0, rounds=50, rate=q, sampling="poisson", **common)
               for q in (0.01, 0.05, 0.2, 1.0)]
    assert by_rate == sorted(by_rate) and len(set(by_rate)) == 4
    by_m = [privacy.epsilon(2.0, rounds=50, clients_per_round=m, **common) for m in (5, 20, 100)]
    assert by_m == sorted(by_m) and len(set(by_m)) == 3
    by_z = [privacy.epsilon(z, rounds=50, rate=0.05, sampling="poisson", **common)
            for z in (0.6, 1.0, 2.0, 8.0)]
    assert by_z == sorted(by_z, reverse=True) and len(set(by_z)) == 4


@pytest.mark.parametrize("kwargs", [dict(clients_per_round=10, accountant="rdp"),
                                    dict(rate=0.1, sampling="poisson", accountant="rdp"),
                                    dict(rate=0.1, sampling="poisson", accountant="pld")])
def test_no_noise_is_infinite_epsilon_and_no_rounds_is_zero(kwargs):
    assert privacy.epsilon(0.0, rounds=3, num_clients=100, delta=1e-5, **kwargs) == math.inf
    assert privacy.epsilon(0.0, rounds=0, num_clients=100, delta=1e-5, **kwargs) == 0.0
    assert privacy.epsilon(1.0, rounds=0, num_clients=100, delta=1e-5, **kwargs) == 0.0
    if kwargs["accountant"] == "rdp":
        got = privacy.epsilons(0.0, rounds=3, num_clients=100, delta=1e-5, **kwargs)
        assert got == [math.inf] * 3
        assert privacy.epsilons(1.0, rounds=0, num_clients=100, delta=1e-5, **kwargs) == []


@pytest.mark.parametrize("target, kwargs, tol", [
    (3.0, dict(rounds=500, num_clients=1000, rate=0.01, sampling="poisson"), 1e-3),
    (50.0, dict(rounds=5, num_clients=1000, rate=0.01, sampling="poisson"), 1e-3),  # z < 1
    pytest.param(5.0, dict(rounds=30, num_clients=200, rate=1.0, sampling="poisson",
                           accountant="pld"), 5e-2, marks=pytest.mark.slow),
    pytest.param(8.0, dict(rounds=100, num_clients=100, clients_per_round=10), 5e-2,
                 marks=pytest.mark.slow),
])
@pytest.mark.slow
def test_noise_multiplier_for_is_the_smallest_within_tolerance(target, kwargs, tol):
    z = privacy.noise_multiplier_for(target, delta=1e-5, tolerance=tol, **kwargs)
    assert privacy.epsilon(z, delta=1e-5, **kwargs) <= target
    assert privacy.epsilon(z * (1 - tol), delta=1e-5, **kwargs) > target


def test_noise_multiplier_for_edges():
    common = dict(num_clients=100, rate=1.0, sampling="poisson", delta=1e-5)
    assert privacy.noise_multiplier_for(1.0, rounds=0, **common) == 0.0
    with pytest.raises(ValueError, match=r"no noise multiplier up to 1e\+06 gives ε ≤ 1e-08"):
        privacy.noise_multiplier_for(1e-8, rounds=1000, **common)
    for bad, match in ((0.0, "target_epsilon must be > 0"), (-1.0, "target_epsilon must be > 0"),
                       (math.inf, "target_epsilon must be a finite number")):
        with pytest.raises(ValueError, match=match):
            privacy.noise_multiplier_for(bad, rounds=10, **common)
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="tolerance must be in"):
            privacy.noise_multiplier_for(1.0, rounds=10, tolerance=bad, **common)


# ----------------------------------------------------------------------------------------------
# 5. Input validation: each error names the argument and the value.

GOOD = dict(noise_multiplier=1.0, rounds=10, num_clients=100, clients_per_round=10, delta=1e-5)
BAD = [
    (dict(delta=0.0), r"delta must be in \(0, 1\), got 0.0"),
    (dict(delta=1.0), r"delta must be in \(0, 1\), got 1.0"),
    (dict(delta=math.nan), "delta must be a finite number"),
    (dict(clients_per_round=101), "clients_per_round must be ≤ num_clients = 100, got 101"),
    (dict(clients_per_round=0), "clients_per_round must be an integer ≥ 1, got 0"),
    (dict(clients_per_round=None), "sampling='fixed' needs clients_per_round"),
    (dict(rate=0.1), "rate=0.1 is for sampling='poisson'"),
    (dict(clients_per_round=None, sampling="poisson"), "sampling='poisson' needs rate"),
    (dict(sampling="poisson", rate=0.1), "clients_per_round=10 is for sampling='fixed'"),
    (dict(clients_per_round=None, sampling="poisson", rate=0.0), r"rate must be in \(0, 1\]"),
    (dict(clients_per_round=None, sampling="poisson", rate=1.5), r"rate must be in \(0, 1\]"),
    (dict(rounds=-1), "rounds must be an integer ≥ 0, got -1"),
    (dict(rounds=2.5), "rounds must be an integer ≥ 0, got 2.5"),
    (dict(num_clients=0), "num_clients must be an integer ≥ 1"),
    (dict(noise_multiplier=-0.5), "noise_multiplier must be ≥ 0, got -0.5"),
    (dict(noise_multiplier=math.inf), "noise_multiplier must be a finite number"),
    (dict(sampling="shuffle"), r"sampling must be one of \('fixed', 'poisson'\), got 'shuffle'"),
    (dict(accountant="gdp"), r"accountant must be one of \('rdp', 'pld'\), got 'gdp'"),
]


@pytest.mark.parametrize("override, match", BAD, ids=[m for _, m in BAD])
@pytest.mark.parametrize("fn", [privacy.epsilon, privacy.epsilons])
def test_invalid_arguments(fn, override, match):
    kwargs = {**GOOD, **override}
    with pytest.raises(ValueError, match=match):
        fn(kwargs.pop("noise_multiplier"), **kwargs)


def test_epsilons_refuses_pld_and_names_the_alternative():
    match = r"accountant='rdp' only.*epsilon\(\.\.\., accountant='pld'\)"
    with pytest.raises(ValueError, match=match):
        privacy.epsilons(1.0, rounds=10, num_clients=100, rate=0.1, sampling="poisson",
                         delta=1e-5, accountant="pld")


def test_public_names():
    assert privacy.epsilon is accounting.epsilon
    assert set(privacy.__all__) >= {"epsilon", "epsilons", "noise_multiplier_for"}


@pytest.mark.slow
def test_a_noise_search_keeps_dp_accountings_warnings_from_the_user(capfd, caplog):
    """Poisson q = 1/4 at small z: dp-accounting logs (absl) one "failed to converge ...
    Excluding this order" per RDP order α it leaves out, dozens during the search. None reaches
    stderr; one RuntimeWarning says how many orders the answer's own ε left out, and ε of the
    answer still meets the target."""
    common = dict(rounds=1, num_clients=20, rate=0.25, sampling="poisson", delta=0.037)
    with pytest.warns(RuntimeWarning, match=r"left out \d+ orders α whose moments did not "
                                            r"converge at z = 0\.\d+") as caught:
        z = accounting.noise_multiplier_for(3.0, **common)
    assert len(caught) == 1
    assert accounting.epsilon(z, **common) <= 3.0
    assert "absl" not in capfd.readouterr().err
    assert not [r for r in caplog.records if r.name == "absl"]      # nor reaches the root logger
    # The same search over fixed-size sampling excludes nothing: no warning.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accounting.noise_multiplier_for(3.0, rounds=1, num_clients=20, clients_per_round=5,
                                        delta=0.037)
