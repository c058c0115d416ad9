"""First differences Λ, difference_solve and the compressed uplink:
docs/algorithms/fedpc.md#compression, #f2, #f3 and #tests.

Every fix (F2, F3) has a test the draft's formula fails: the r-step threshold 1/ρ_c (not ρ), the
y-step constant c = ρ_c·η·γ (not 4/(ρηγ)), and the inverse (the draft's P(cΣ + 1)P⁻¹ is the
matrix itself). References are dense float64 numpy solves and scipy's SLSQP (tests/support/convex_reference.py).
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from convex_reference import norm_epigraph_minimize

from fedjax_pfl.ops import difference as D
from fedjax_pfl.ops.prox import soft_threshold


def dense_lambda(d):
    """The d×d first-difference matrix: 1 on the diagonal, −1 on the superdiagonal."""
    return np.eye(d) - np.eye(d, k=1)


def test_difference_actions_match_the_dense_matrix(x64):
    d = 7
    lam = dense_lambda(d)
    v = np.random.default_rng(0).normal(size=d)
    np.testing.assert_allclose(D.diff_apply(jnp.asarray(v)), lam @ v, rtol=1e-14)
    np.testing.assert_allclose(D.diff_transpose(jnp.asarray(v)), lam.T @ v, rtol=1e-14)
    np.testing.assert_array_equal(lam.T @ lam, np.diag([1.0] + [2.0] * 6) - np.eye(d, k=1) - np.eye(d, k=-1))


@pytest.mark.slow
def test_piecewise_constant_fit_on_the_jump_set_of_r():
    # r ≠ 0 at 1, 4 and 7 (jumps after coordinates 1, 4, 7), r_9 = 0: runs [0..1], [2..4],
    # [5..7], [8..9]; each takes y's mean, the last is anchored at 0.
    r = jnp.array([0.0, 0.1, 0.0, 0.0, 0.7, 0.0, 0.0, 0.3, 0.0, 0.0], jnp.float32)
    y = jnp.arange(10.0, dtype=jnp.float32)
    out = np.asarray(D.piecewise_constant(y, r))
    np.testing.assert_allclose(out, [0.5, 0.5, 3, 3, 3, 6, 6, 6, 0, 0])
    assert int(D.count_distinct(jnp.asarray(out))) == 4
    # r_{d−1} ≠ 0: the last run keeps its mean.
    np.testing.assert_allclose(D.piecewise_constant(y, r.at[9].set(1.0))[8:], [8.5, 8.5])
    # Where Λy = r exactly, the fit is y itself.
    lam = dense_lambda(10)
    yy = np.array([2.0, 2, 1, 1, 1, 0.5, 0.5, 0.5, 0.2, 0.2])
    np.testing.assert_allclose(D.piecewise_constant(jnp.asarray(yy), jnp.asarray(lam @ yy)), yy, rtol=1e-6)


@pytest.mark.parametrize("c", [0.0, 0.5, 3.0])
@pytest.mark.slow
def test_difference_solve_matches_a_dense_solve_per_leaf(x64, c):
    rng = np.random.default_rng(1)
    b = {"a": rng.normal(size=(3, 4)), "b": rng.normal(size=(7,)), "c": rng.normal(size=(1,))}
    got = D.difference_solve(jax.tree.map(jnp.asarray, b), c)
    for name, leaf in b.items():
        d = leaf.size
        lam = dense_lambda(d)
        expected = np.linalg.solve(np.eye(d) + c * lam.T @ lam, leaf.reshape(-1)).reshape(leaf.shape)
        np.testing.assert_allclose(got[name], expected, rtol=1e-12, atol=1e-14)


def test_difference_solve_is_linear_time_without_a_d_by_d_array():
    d = 10**6
    b = jnp.asarray(np.random.default_rng(2).normal(size=d), jnp.float32)
    solve = jax.jit(D.difference_solve_vector)
    compiled = solve.lower(b, 2.0).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < 64 * d                        # a handful of length-d vectors, never d² (4 TB)
    y = solve(b, 2.0).block_until_ready()
    t0 = time.perf_counter()
    y = solve(b, 2.0).block_until_ready()
    assert time.perf_counter() - t0 < 1.0       # ~30 ms on one CPU core
    residual = y + 2.0 * D.diff_transpose(D.diff_apply(y)) - b     # (I + cΛᵀΛ)y − b, matrix-free
    assert float(jnp.max(jnp.abs(residual))) < 1e-4


def test_the_drafts_inverse_is_the_matrix_itself():
    # [fix] The draft writes (cΛᵀΛ + I)⁻¹ = P(cΣ + 1)P⁻¹, dropping the −1 on the eigenvalues.
    d, c = 6, 1.5
    lam = dense_lambda(d)
    sigma, P = np.linalg.eigh(lam.T @ lam)
    b = np.random.default_rng(3).normal(size=d)
    expected = np.linalg.solve(np.eye(d) + c * lam.T @ lam, b)
    with jax.enable_x64(True):
        np.testing.assert_allclose(D.difference_solve_vector(jnp.asarray(b), c), expected, rtol=1e-12)
    np.testing.assert_allclose(P @ np.diag(1 / (c * sigma + 1)) @ P.T @ b, expected, rtol=1e-10)
    assert np.abs(P @ np.diag(c * sigma + 1) @ P.T @ b - expected).max() > 1.0


def test_r_step_thresholds_at_one_over_rho_c(x64):
    # [fix] argmin_r ‖r‖₁ + ⟨ω, r⟩ + (ρ_c/2)‖r − a‖² = soft_threshold(a − ω/ρ_c, 1/ρ_c); the draft
    # thresholds at ρ_c.
    rng = np.random.default_rng(4)
    a, omega, rho_c = rng.normal(size=6), 0.3 * rng.normal(size=6), 2.5
    expected = norm_epigraph_minimize(rho_c * np.eye(6), omega - rho_c * a, [np.eye(6)], 1.0, "1")
    ours = soft_threshold(jnp.asarray(a - omega / rho_c), 1.0 / rho_c)
    np.testing.assert_allclose(ours, expected, atol=1e-8)
    draft = soft_threshold(jnp.asarray(a - omega / rho_c), rho_c)
    assert np.abs(np.asarray(draft) - expected).max() > 0.1


def test_y_step_constant_is_rho_c_eta_gamma(x64):
    # [fix] argmin_y ‖y − u‖²/(2ηγ) − ⟨ω, Λy⟩ + (ρ_c/2)‖r − Λy + Λx_t‖² solves
    # (I + cΛᵀΛ)y = u + cΛᵀ(r + Λx_t + ω/ρ_c) with c = ρ_c·η·γ; the draft's c = 4/(ρηγ) does not.
    d, eta, gamma, rho_c = 8, 0.1, 0.5, 3.0
    rng = np.random.default_rng(5)
    u, x_t, r, omega = (rng.normal(size=d) for _ in range(4))
    lam = dense_lambda(d)
    # Stationarity, written from the objective: (y − u)/(ηγ) − Λᵀω − ρ_cΛᵀ(r − Λy + Λx_t) = 0.
    expected = np.linalg.solve(np.eye(d) / (eta * gamma) + rho_c * lam.T @ lam,
                               u / (eta * gamma) + lam.T @ omega + rho_c * lam.T @ (r + lam @ x_t))

    def y_step(c):
        rhs = u + c * lam.T @ (r + lam @ x_t + omega / rho_c)
        return np.asarray(D.difference_solve_vector(jnp.asarray(rhs), c))

    np.testing.assert_allclose(y_step(rho_c * eta * gamma), expected, rtol=1e-10)
    assert np.abs(y_step(4.0 / (rho_c * eta * gamma)) - expected).max() > 0.1


def brute_force_v(g, x_t, eta, gamma):
    """argmin_y ⟨g, y⟩ + γ‖Λ(y − x_t)‖₁ + ‖y − x_t‖²/(2η), by SLSQP in y (x_t kept, not shifted)."""
    d = g.size
    lam = dense_lambda(d)
    return norm_epigraph_minimize(np.eye(d) / eta, g - x_t / eta, [(lam, lam @ x_t)], gamma, "1",
                                  x0=x_t - eta * g)


@pytest.mark.parametrize("output", ["piecewise", "y"])
def test_compression_admm_matches_the_brute_force_v_problem(x64, output):
    rng = np.random.default_rng(6)
    g, x_t = rng.normal(size=10), rng.normal(size=10)
    eta, gamma = 0.2, 0.4
    v = brute_force_v(g, x_t, eta, gamma)
    expected = (x_t - v) / eta
    got = D.compress_vector(jnp.asarray(g), eta=eta, gamma=gamma, rho_c=1 / (eta * gamma),
                            iters=500, output=output)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    # The exact ∇ is piecewise constant; the "piecewise" output is exactly so.
    assert len(np.unique(np.round(expected, 6))) < 10
    if output == "piecewise":
        assert int(D.count_distinct(got)) == len(np.unique(np.round(expected, 6)))


def test_the_drafts_compression_iteration_does_not_reach_the_minimiser(x64):
    # The draft's Algorithm 3 as written: threshold ρ, constant 4/(ρηγ) and its non-inverse.
    rng = np.random.default_rng(6)
    g, x_t = rng.normal(size=10), rng.normal(size=10)
    eta, gamma, rho = 0.2, 0.4, 1 / (0.2 * 0.4)
    expected = (x_t - brute_force_v(g, x_t, eta, gamma)) / eta
    d = g.size
    lam = dense_lambda(d)
    sigma, P = np.linalg.eigh(lam.T @ lam)
    c = 4.0 / (rho * eta * gamma)
    not_inverse = P @ np.diag(c * sigma + 1) @ P.T
    y, omega, u = x_t - eta * g, np.zeros(d), x_t - eta * g
    with np.errstate(over="ignore", invalid="ignore"):
        for _ in range(500):
            a = lam @ (y - x_t) - omega / rho
            r = np.maximum(a - rho, 0) - np.maximum(-a - rho, 0)
            y = not_inverse @ (u + c * lam.T @ (r + lam @ x_t + omega / rho))
            omega = omega + rho * (r - lam @ y + lam @ x_t)
        draft = (x_t - y) / eta
    assert not np.all(np.abs(draft - expected) < 1e-2)


def test_gamma_zero_returns_the_gradient_bit_for_bit():
    g = {"w": jnp.asarray(np.random.default_rng(7).normal(size=(4, 3)), jnp.float32),
         "b": jnp.asarray([0.1, 0.2, 0.1], jnp.float32)}
    out = D.compress_gradient(g, eta=0.05, gamma=0.0, rho_c=1.0, iters=5)
    for k in g:
        np.testing.assert_array_equal(out.grad[k], g[k])
    assert int(out.distinct) == 12 + 2
    assert float(out.bits) == 12 * 4 + 32 * 12 + 3 * 1 + 32 * 2     # ⌈log2 12⌉ = 4, ⌈log2 2⌉ = 1


def test_distinct_values_decrease_monotonically_in_gamma(x64):
    g = jnp.asarray(np.random.default_rng(8).normal(size=60))
    eta = 0.1
    counts = []
    for gamma in (0.0, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2):
        rho_c = 1.0 / (eta * gamma) if gamma else 1.0
        grad = D.compress_vector(g, eta=eta, gamma=gamma, rho_c=rho_c, iters=3000)
        counts.append(int(D.count_distinct(grad)))
    assert counts[0] == 60
    assert all(b <= a for a, b in zip(counts, counts[1:])), counts
    assert counts[-1] < 10


def test_leaves_are_compressed_independently(x64):
    rng = np.random.default_rng(9)
    g = {"a": jnp.asarray(rng.normal(size=(2, 5))), "b": jnp.asarray(rng.normal(size=4))}
    out = D.compress_gradient(g, eta=0.1, gamma=0.3, rho_c=1 / 0.03, iters=100)
    for k in g:
        alone = D.compress_vector(g[k].reshape(-1), eta=0.1, gamma=0.3, rho_c=1 / 0.03, iters=100)
        np.testing.assert_array_equal(out.grad[k].reshape(-1), alone)
    counts = [int(D.count_distinct(out.grad[k])) for k in g]
    assert int(out.distinct) == sum(counts)
    np.testing.assert_allclose(float(out.bits), sum(float(D.codebook_bits(g[k].size, c))
                                                    for k, c in zip(g, counts)))


@pytest.mark.parametrize("size,k,bits", [(1000, 1, 32), (1000, 2, 1064), (1000, 5, 3160),
                                         (1000, 8, 3256), (1000, 9, 4288)])
def test_codebook_bits(size, k, bits):
    # d·⌈log2 k⌉ + 32·k: e.g. k = 5 needs 3 bits per coordinate, k = 9 needs 4.
    assert float(D.codebook_bits(size, k)) == bits


def test_unconverged_output_does_not_drift_along_a_long_leaf():
    # After few ADMM iterations r_J is inexact. The piecewise fit takes run means of −δ_J/η, so it
    # stays within their range; rebuilding ∇ from r_J by a cumulative sum (Λ⁻¹r) would not.
    g = jnp.asarray(np.random.default_rng(10).normal(size=50_000) * 0.01, jnp.float32)
    eta, gamma = 0.1, 0.01
    kw = dict(eta=eta, gamma=gamma, rho_c=1 / (eta * gamma), iters=5)
    literal = np.asarray(D.compress_vector(g, output="y", **kw))
    fitted = np.asarray(D.compress_vector(g, **kw))
    assert fitted.min() >= literal.min() - 1e-6 and fitted.max() <= literal.max() + 1e-6
    assert int(D.count_distinct(jnp.asarray(fitted))) < 50_000 // 2
    assert np.abs(fitted - literal).mean() < np.abs(literal).mean()
