"""FedFomo's weights, update and candidate choice (fedjax_pfl/ops/fomo.py) against naive float64
loops over pairs of clients, and the ε-greedy choice's properties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfl.ops import fomo

M, P, C = 4, 5, 3


def test_validation_counts_are_ceil_capped_at_n_minus_one():
    n = np.array([0, 1, 2, 4, 5, 10, 11, 99, 100])
    want = [min(int(np.ceil(0.2 * k - 1e-9)), max(k - 1, 0)) for k in n]     # 0.2·10 = 2, not 3
    np.testing.assert_array_equal(fomo.validation_counts(jnp.asarray(n), 0.2), want)
    np.testing.assert_array_equal(fomo.validation_counts(jnp.asarray(n), 0.0), 0)


def naive_weights_and_update(own_loss, cand_loss, slots, valid, own, pool):
    """One pair at a time in float64: w = max(0, ΔL/‖Δθ‖) normalised, θ_i + Σ w (θ_j − θ_i)."""
    w = np.zeros(slots.shape)
    new = own.copy()
    dist = np.zeros(slots.shape)
    for i in range(slots.shape[0]):
        for c in range(slots.shape[1]):
            dist[i, c] = np.sqrt(np.sum((pool[slots[i, c]] - own[i]) ** 2))
            if valid[i, c] and dist[i, c] > 0 and np.isfinite(cand_loss[i, c]):
                w[i, c] = max(0.0, (own_loss[i] - cand_loss[i, c]) / dist[i, c])
        if w[i].sum() > 0:
            w[i] /= w[i].sum()
        for c in range(slots.shape[1]):
            new[i] = new[i] + w[i, c] * (pool[slots[i, c]] - own[i])
    return w, new, dist


@pytest.mark.slow
def test_weights_update_and_distances_equal_the_naive_loop(x64):
    rng = np.random.default_rng(0)
    own = rng.normal(size=(M, 6)) + 10.0            # far from 0: the Gram must be centred
    pool = own[rng.integers(0, M, P)] + 0.1 * rng.normal(size=(P, 6))
    pool[4] = own[3]                                # zero distance for client 3 → weight 0
    slots = np.array([[0, 1, 2], [3, 4, 0], [1, 2, 3], [4, 0, 1]])
    valid = np.ones((M, C), bool)
    valid[1, 2] = False                             # an empty slot
    own_loss = np.array([1.0, 0.5, 0.2, 0.8])
    cand_loss = np.array([[0.5, np.nan, 0.7],       # two better, a NaN loss ignored
                          [0.3, 0.4, 0.1],          # two better, slot 2 empty
                          [0.9, 0.3, 0.25],         # nothing better: client 2 keeps θ_2
                          [0.1, 0.6, 0.9]])         # slot 0 is θ_3 itself (distance 0)
    w_ref, new_ref, dist_ref = naive_weights_and_update(own_loss, cand_loss, slots, valid, own, pool)
    assert np.all(w_ref[2] == 0) and w_ref[3, 0] == 0 and np.sum(w_ref > 0) == 5
    dist = fomo.candidate_distances({"a": own[:, :2], "b": own[:, 2:]},
                                    {"a": pool[:, :2], "b": pool[:, 2:]}, jnp.asarray(slots))
    np.testing.assert_allclose(dist, dist_ref, rtol=1e-9, atol=1e-6)
    w = fomo.fomo_weights(jnp.asarray(own_loss), jnp.asarray(cand_loss), jnp.asarray(dist_ref),
                          jnp.asarray(valid))
    np.testing.assert_allclose(w, w_ref, rtol=1e-12, atol=1e-15)
    assert np.all(np.asarray(w) >= 0)
    np.testing.assert_allclose(np.asarray(w).sum(1), [1, 1, 0, 1], atol=1e-12)
    new = fomo.fomo_update(w, jnp.asarray(slots), {"a": own[:, :2], "b": own[:, 2:]},
                           {"a": pool[:, :2], "b": pool[:, 2:]})
    np.testing.assert_allclose(np.concatenate([new["a"], new["b"]], 1), new_ref, rtol=1e-12)
    np.testing.assert_array_equal(np.concatenate([new["a"], new["b"]], 1)[2], own[2])


def test_bfloat16_rows_are_mixed_in_float32():
    own = {"w": jnp.ones((2, 3), jnp.bfloat16)}
    pool = {"w": jnp.full((2, 3), 3.0, jnp.bfloat16)}
    w = jnp.array([[0.25, 0.75], [0.0, 0.0]])
    new = fomo.fomo_update(w, jnp.array([[0, 1], [0, 1]]), own, pool)
    assert new["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(new["w"], np.float32), [[3.0] * 3, [1.0] * 3])


@pytest.mark.parametrize("epsilon", [0.0, 0.4, 1.0])
def test_candidates_are_distinct_valid_and_greedy_without_exploration(epsilon):
    rng = np.random.default_rng(1)
    affinity = jnp.asarray(rng.permutation(M * P).reshape(M, P) / 10.0)   # no ties
    valid = np.ones((M, P), bool)
    valid[0, 4] = valid[1, 0] = False                # e.g. the client itself
    valid[3, :3] = False                             # only 2 valid entries < C
    pick = jax.jit(fomo.select_candidates, static_argnums=3)
    for r in range(20):
        slots, ok = pick(jax.random.split(jax.random.key(r), M), affinity, jnp.asarray(valid), C, epsilon)
        slots, ok = np.asarray(slots), np.asarray(ok)
        for i in range(M):
            chosen = slots[i][ok[i]]
            assert len(set(chosen.tolist())) == len(chosen) == min(C, valid[i].sum())
            assert valid[i][chosen].all()
            if epsilon == 0.0:                       # the top-C valid entries by affinity
                order = [p for p in np.argsort(-np.asarray(affinity[i])) if valid[i, p]]
                assert set(chosen.tolist()) == set(order[:C])


@pytest.mark.slow
def test_full_exploration_is_uniform_over_the_valid_entries():
    affinity = jnp.asarray(np.tile(np.arange(P, dtype=float), (1, 1)))      # 1 row
    valid = jnp.asarray(np.array([[True, True, False, True, True]]))
    keys = jax.random.split(jax.random.key(0), 4000)
    slots, ok = jax.vmap(lambda k: fomo.select_candidates(k[None], affinity, valid, 2, 1.0))(keys)
    counts = np.bincount(np.asarray(slots)[np.asarray(ok)], minlength=P) / 4000
    np.testing.assert_allclose(counts, [0.5, 0.5, 0.0, 0.5, 0.5], atol=0.04)
    # ε = 0 always takes the two highest affinities (entries 4 and 3).
    greedy, _ = jax.vmap(lambda k: fomo.select_candidates(k[None], affinity, valid, 2, 0.0))(keys[:50])
    assert {tuple(sorted(s)) for s in np.asarray(greedy)[:, 0].tolist()} == {(3, 4)}
