"""Model poisoning (`ops.attacks`): each attack's malicious rows against its formula written
here in NumPy float64 (ALIE's μ − zσ with Baruch et al.'s z by hand, IPM's −ε·μ), the other rows
kept bit for bit, empty slots out of the benign statistics."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfl.ops import attacks

M = 7


def stack(seed=0):
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(size=(M, 3, 2)).astype(np.float32),
            "b": rng.normal(size=(M, 4)).astype(np.float32)}


MALICIOUS = np.array([0, 1, 0, 0, 1, 0, 0], bool)
BENIGN = ~MALICIOUS


def as_jax(tree):
    return jax.tree.map(jnp.asarray, tree)


def check_rows(got, deltas, malicious, expected_row):
    """Malicious rows equal expected_row(leaf name, row) in float64; the others are Δ's own."""
    for name in deltas:
        g = np.asarray(got[name])
        for i in range(M):
            if malicious[i]:
                np.testing.assert_allclose(g[i], expected_row(name, i), rtol=2e-6, atol=1e-6)
            else:
                np.testing.assert_array_equal(g[i], deltas[name][i])


def test_sign_flip_and_scale():
    d = stack()
    got = attacks.sign_flip(as_jax(d), jnp.asarray(MALICIOUS), 4.0)
    check_rows(got, d, MALICIOUS, lambda k, i: -4.0 * d[k][i].astype(np.float64))
    got = attacks.scale_update(as_jax(d), jnp.asarray(MALICIOUS), 2.5)
    check_rows(got, d, MALICIOUS, lambda k, i: 2.5 * d[k][i].astype(np.float64))


def test_gaussian_is_pure_noise_of_the_given_std():
    d = {"w": np.zeros((M, 4000), np.float32) + 5.0}
    got = np.asarray(attacks.gaussian(as_jax(d), jnp.asarray(MALICIOUS), jax.random.key(1),
                                      0.3)["w"])
    for i in np.flatnonzero(MALICIOUS):        # N(0, 0.09): the honest 5.0 is gone
        assert abs(got[i].mean()) < 0.03 and abs(got[i].std() - 0.3) < 0.02
    np.testing.assert_array_equal(got[BENIGN], d["w"][BENIGN])
    assert not np.array_equal(got[1], got[4])  # each slot its own draw


def alie_z_by_hand(n, f):
    s = max(math.floor(n / 2 + 1) - f, 1)
    p = (n - s) / n
    # Φ⁻¹(p) by bisection of the erf CDF (float64), not scipy's ndtri.
    lo, hi = -10.0, 10.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < p:
            lo = mid
        else:
            hi = mid
    return lo


@pytest.mark.parametrize("n,f", [(10, 3), (50, 10), (25, 6), (7, 2), (5, 4)])
def test_alie_z_formula(n, f):
    np.testing.assert_allclose(float(attacks.alie_z(n, f)), alie_z_by_hand(n, f), rtol=1e-5,
                               atol=1e-5)


def test_alie_z_hand_values():
    # n = 10, f = 3: s = 6 − 3 = 3, z = Φ⁻¹(0.7) = 0.5244; n = 50, f = 10: s = 16, Φ⁻¹(0.68).
    assert float(attacks.alie_z(10, 3)) == pytest.approx(0.524400, abs=1e-5)
    assert float(attacks.alie_z(50, 10)) == pytest.approx(0.467699, abs=1e-5)


def benign_stats(d, benign):
    x = d[benign].astype(np.float64)
    return x.mean(0), x.std(0)                  # population std (ddof 0)


def test_alie_is_mu_minus_z_sigma_of_the_benign():
    d = stack(3)
    z = 1.3
    got = attacks.alie(as_jax(d), jnp.asarray(MALICIOUS), jnp.asarray(BENIGN), z)
    check_rows(got, d, MALICIOUS, lambda k, i: benign_stats(d[k], BENIGN)[0]
               - z * benign_stats(d[k], BENIGN)[1])


def test_alie_default_z_from_the_rounds_counts():
    d = stack(4)
    got = attacks.poison_updates("alie", as_jax(d), jnp.asarray(MALICIOUS), jnp.asarray(BENIGN),
                                 key=jax.random.key(0))
    z = alie_z_by_hand(M, 2)                    # n = 7, f = 2: s = 2, z = Φ⁻¹(5/7)
    check_rows(got, d, MALICIOUS, lambda k, i: benign_stats(d[k], BENIGN)[0]
               - z * benign_stats(d[k], BENIGN)[1])


def test_ipm_is_minus_eps_benign_mean():
    d = stack(5)
    got = attacks.ipm(as_jax(d), jnp.asarray(MALICIOUS), jnp.asarray(BENIGN), 0.7)
    check_rows(got, d, MALICIOUS, lambda k, i: -0.7 * benign_stats(d[k], BENIGN)[0])


def test_empty_slots_stay_out_of_the_benign_statistics():
    """A Poisson round's empty slot (neither benign nor malicious) holding a huge value does
    not move μ or σ."""
    d = stack(6)
    d["w"][6] = 1e6
    benign = BENIGN.copy()
    benign[6] = False
    got = attacks.ipm(as_jax(d), jnp.asarray(MALICIOUS), jnp.asarray(benign), 1.0)
    check_rows(got, d, MALICIOUS, lambda k, i: -benign_stats(d[k], benign)[0])
    got = attacks.alie(as_jax(d), jnp.asarray(MALICIOUS), jnp.asarray(benign), 1.0)
    mu, sd = benign_stats(d["w"], benign)
    np.testing.assert_allclose(np.asarray(got["w"])[1], mu - sd, rtol=2e-6, atol=1e-6)


def test_no_malicious_slot_changes_nothing():
    d = stack(7)
    none = jnp.zeros(M, bool)
    for kind in attacks.MODEL_ATTACKS:
        got = attacks.poison_updates(kind, as_jax(d), none, jnp.ones(M, bool),
                                     key=jax.random.key(0), scale=3.0)
        for k in d:
            np.testing.assert_array_equal(np.asarray(got[k]), d[k])


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="kind must be one of"):
        attacks.poison_updates("label_flip", as_jax(stack()), jnp.asarray(MALICIOUS),
                               jnp.asarray(BENIGN), key=jax.random.key(0))
