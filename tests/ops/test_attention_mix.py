"""FedAMP's attentive mixture (fedjax_pfl/ops/attention_mix.py) against a naive float64 double loop
over pairs of clients, and its properties: rows of Ξ sum to one, weights non-negative where the
paper's step size condition holds, equal models mixed into themselves, stable distances of close
models in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfl.ops import attention_mix as am

M = 5


def rows(seed=0, spread=0.3, offset=0.0):
    """M models {a: [3, 2], b: [4]} (d = 10), as stacked rows."""
    rng = np.random.default_rng(seed)
    base = {"a": rng.normal(size=(3, 2)), "b": rng.normal(size=4)}
    return {k: offset + v[None] + spread * rng.normal(size=(M, *v.shape)) for k, v in base.items()}


def flat(w, i):
    return np.concatenate([np.ravel(w["a"][i]), np.ravel(w["b"][i])])


def naive(w, *, alpha, sigma, self_weight=None):
    """(D, Ξ, U) one pair at a time in float64: the paper's ξ_ij = α e^{−D_ij/σ}/σ and
    ξ_ii = 1 − Σ_{j≠i} ξ_ij, or with a self weight s the normalised (1 − s) e^{−D_ij/σ} /
    Σ_{h≠i} e^{−D_ih/σ} and ξ_ii = s; u_i = Σ_j ξ_ij w_j."""
    vecs = [flat(w, i) for i in range(M)]
    dist = np.zeros((M, M))
    for i in range(M):
        for j in range(M):
            diff = vecs[i] - vecs[j]
            dist[i, j] = float(diff @ diff)
    xi = np.zeros((M, M))
    for i in range(M):
        if self_weight is None:
            for j in range(M):
                if j != i:
                    xi[i, j] = alpha * np.exp(-dist[i, j] / sigma) / sigma
            xi[i, i] = 1.0 - sum(xi[i, j] for j in range(M) if j != i)
        else:
            total = sum(np.exp(-dist[i, h] / sigma) for h in range(M) if h != i)
            for j in range(M):
                xi[i, j] = (self_weight if j == i
                            else (1.0 - self_weight) * np.exp(-dist[i, j] / sigma) / total)
    mixed = {k: np.zeros_like(v) for k, v in w.items()}
    for i in range(M):
        for j in range(M):
            for k in w:
                mixed[k][i] += xi[i, j] * w[k][j]
    return dist, xi, mixed


@pytest.mark.parametrize("self_weight", [None, 0.3])
@pytest.mark.parametrize("alpha,sigma", [(0.2, 2.0), (0.05, 0.5)])
def test_matches_naive_double_loop(x64, alpha, sigma, self_weight):
    w = rows()
    dist, xi, mixed = naive(w, alpha=alpha, sigma=sigma, self_weight=self_weight)
    assert 0.3 < np.median(dist[dist > 0]) / sigma < 10     # e^{−D/σ} far from 0 and from 1
    tree = jax.tree.map(jnp.asarray, w)
    got_dist = am.pairwise_sq_distances(tree)
    got_xi = am.attention_weights(got_dist, alpha=alpha, sigma=sigma, self_weight=self_weight)
    got_u = am.mix_rows(got_xi, tree)
    np.testing.assert_allclose(got_dist, dist, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got_xi, xi, rtol=1e-12, atol=1e-15)
    for k in w:
        np.testing.assert_allclose(got_u[k], mixed[k], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("self_weight", [None, 0.0, 0.4, 1.0])
def test_weights_are_nonnegative_and_rows_sum_to_one(x64, self_weight):
    w = jax.tree.map(jnp.asarray, rows(seed=1))
    sigma = 1.5
    alpha = sigma / (M - 1)          # the largest α with ξ_ii ≥ 0 for every distance (A' ≤ 1/σ)
    xi = np.asarray(am.attention_weights(am.pairwise_sq_distances(w), alpha=alpha, sigma=sigma,
                                         self_weight=self_weight))
    np.testing.assert_allclose(xi.sum(axis=1), 1.0, rtol=1e-12)
    assert np.all(xi >= 0)
    if self_weight is not None:
        np.testing.assert_allclose(np.diag(xi), self_weight, rtol=1e-12)
    else:                             # the self weight is what the others leave
        assert np.all(np.diag(xi) > 0) and np.all(np.diag(xi) < 1)


def test_paper_weights_turn_negative_above_the_step_size_bound(x64):
    # α > σ/(M−1): equal models (D = 0) get ξ_ii = 1 − (M−1)α/σ < 0; rows still sum to one.
    xi = np.asarray(am.attention_weights(jnp.zeros((M, M)), alpha=0.5, sigma=1.0))
    np.testing.assert_allclose(np.diag(xi), 1 - 4 * 0.5)
    np.testing.assert_allclose(xi.sum(axis=1), 1.0)


@pytest.mark.parametrize("self_weight", [None, 0.25])
def test_equal_models_mix_uniformly_into_themselves(x64, self_weight):
    one = rows(spread=0.0)
    w = jax.tree.map(jnp.asarray, one)
    sigma = 0.7
    dist = am.pairwise_sq_distances(w)
    assert float(jnp.abs(dist).max()) == 0.0
    xi = np.asarray(am.attention_weights(dist, alpha=sigma / M, sigma=sigma,
                                         self_weight=self_weight))
    if self_weight is None:          # α = σ/M: ξ_ij = α A'(0) = α/σ = 1/M for every j
        np.testing.assert_allclose(xi, np.full((M, M), 1 / M), rtol=1e-12)
    else:
        expected = np.full((M, M), 0.75 / (M - 1))
        np.fill_diagonal(expected, 0.25)
        np.testing.assert_allclose(xi, expected, rtol=1e-12)
    u = am.mix_rows(jnp.asarray(xi), w)
    for k in one:
        np.testing.assert_allclose(u[k], one[k], rtol=1e-12)


def test_close_models_far_from_zero_keep_their_distances_in_float32():
    # Models from one initialisation: a common part of norm ~100 and differences ~1e-2. The raw
    # identity ‖w_i‖² + ‖w_j‖² − 2⟨w_i, w_j⟩ in float32 cancels ~1e4 down to ~1e-3 with an error
    # of ~1e-3; the centred Gram keeps the small distances to float32 precision.
    rng = np.random.default_rng(2)
    common = 3.0 + rng.normal(size=1000)
    stacked = common[None] + 0.003 * rng.normal(size=(M, 1000))
    diff = stacked[:, None, :] - stacked[None, :, :]
    expected = np.einsum("ijk,ijk->ij", diff, diff)                 # float64
    got = np.asarray(am.pairwise_sq_distances({"w": jnp.asarray(stacked, jnp.float32)}))
    assert got.dtype == np.float32
    off = ~np.eye(M, dtype=bool)
    np.testing.assert_allclose(got[off], expected[off], rtol=1e-3)
    assert np.all(np.diag(got) == 0)


def test_far_apart_models_normalised_weights_stay_finite():
    # D/σ ~ 1e4: e^{−D/σ} underflows to 0. The paper's form then keeps each model (ξ_ii = 1);
    # the normalised form is a masked softmax, exact and finite, and still puts 1 − s on others.
    dist = jnp.asarray(np.array([[0, 1e4, 2e4], [1e4, 0, 3e4], [2e4, 3e4, 0]], np.float32))
    paper = np.asarray(am.attention_weights(dist, alpha=0.1, sigma=1.0))
    np.testing.assert_array_equal(paper, np.eye(3))
    normalised = np.asarray(am.attention_weights(dist, alpha=0.1, sigma=1.0, self_weight=0.5))
    assert np.all(np.isfinite(normalised))
    np.testing.assert_allclose(normalised, [[0.5, 0.5, 0], [0.5, 0.5, 0], [0.5, 0, 0.5]], atol=1e-6)


def test_single_model_is_its_own_cloud_model():
    for s in (None, 0.3):
        xi = am.attention_weights(jnp.zeros((1, 1)), alpha=0.1, sigma=1.0, self_weight=s)
        np.testing.assert_array_equal(xi, [[1.0]])


def test_bfloat16_rows_are_mixed_in_float32():
    w = {"w": jnp.asarray(rows()["a"].reshape(M, -1), jnp.bfloat16)}
    xi = am.attention_weights(am.pairwise_sq_distances(w), alpha=0.1, sigma=1.0)
    assert xi.dtype == jnp.float32
    assert am.mix_rows(xi, w)["w"].dtype == jnp.bfloat16
