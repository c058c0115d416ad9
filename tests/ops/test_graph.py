"""The similarity graph, Laplacian solves, the Z-subproblem ADMM and client distances:
docs/algorithms/fedpc.md#graph, #round and #tests. References: dense float64 numpy and scipy
SLSQP (convex_reference.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg
from convex_reference import norm_epigraph_minimize

from fedjax_pfl.ops import graph as G


def dense_incidence(graph, n):
    q = np.zeros((n, graph.num_edges))
    for m, (i, j) in enumerate(zip(np.asarray(graph.senders), np.asarray(graph.receivers))):
        q[i, m], q[j, m] = 1.0, -1.0
    return q


def brute_knn_edges(points, k):
    d = np.linalg.norm(points[:, None] - points[None], axis=-1)
    np.fill_diagonal(d, np.inf)
    edges = set()
    for i in range(len(points)):
        for j in np.argsort(d[i], kind="stable")[:k]:
            edges.add((min(i, j), max(i, j)))
    return sorted(edges)


def edge_list(graph):
    return list(zip(np.asarray(graph.senders).tolist(), np.asarray(graph.receivers).tolist()))


def test_knn_graph_by_hand():
    # Points on a line at 0, 1, 3, 7, 8.
    x = np.array([0.0, 1.0, 3.0, 7.0, 8.0])
    dist = np.abs(x[:, None] - x[None])
    assert edge_list(G.knn_graph(dist, 1)) == [(0, 1), (1, 2), (3, 4)]
    assert edge_list(G.knn_graph(dist, 2)) == [(0, 1), (0, 2), (1, 2), (2, 3), (2, 4), (3, 4)]
    assert len(edge_list(G.knn_graph(dist, 10))) == 10                   # k ≥ N − 1: complete


def test_knn_graph_in_blocks_equals_brute_force():
    points = np.random.default_rng(0).normal(size=(37, 3)).astype(np.float32)
    expected = brute_knn_edges(points.astype(np.float64), 4)
    emb = jnp.asarray(points)
    for block in (5, 37):
        graph = G.knn_graph(G.euclidean_rows(emb), 4, num_nodes=37, block_size=block)
        assert edge_list(graph) == expected
    dense = np.linalg.norm(points[:, None] - points[None], axis=-1)
    assert edge_list(G.knn_graph(dense, 4)) == expected


def test_incidence_and_laplacian_actions(x64):
    x = np.random.default_rng(1).normal(size=(9, 2))
    graph = G.knn_graph(G.euclidean_rows(jnp.asarray(x)), 2, num_nodes=9)
    q = dense_incidence(graph, 9)
    z = np.random.default_rng(2).normal(size=(9, 4))
    w = np.random.default_rng(3).normal(size=(graph.num_edges, 4))
    np.testing.assert_allclose(G.edge_differences(graph, jnp.asarray(z)), q.T @ z, rtol=1e-13)
    np.testing.assert_allclose(G.incidence_apply(graph, jnp.asarray(w), 9), q @ w, rtol=1e-13)
    np.testing.assert_allclose(G.laplacian_apply(graph, jnp.asarray(z)), q @ q.T @ z, rtol=1e-13)
    np.testing.assert_allclose(G.dense_laplacian(graph, 9), q @ q.T)           # L = QQᵀ
    np.testing.assert_allclose(G.degrees(graph, 9), np.diag(q @ q.T))


@pytest.mark.parametrize("method", ["cholesky", "cg", "auto"])
def test_laplacian_solve_matches_a_dense_solve(x64, method):
    x = np.random.default_rng(4).normal(size=(12, 2))
    graph = G.knn_graph(G.euclidean_rows(jnp.asarray(x)), 3, num_nodes=12)
    lap = dense_laplacian_np = dense_incidence(graph, 12) @ dense_incidence(graph, 12).T
    rhs = np.random.default_rng(5).normal(size=(12, 5))
    expected = np.linalg.solve(np.eye(12) + 0.7 * lap, rhs)
    got = G.laplacian_solve(graph, jnp.asarray(rhs), 0.7, method=method, tol=1e-12)
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-11)
    del dense_laplacian_np


@pytest.mark.slow
def test_cholesky_and_cg_agree_in_float32():
    x = np.random.default_rng(6).normal(size=(50, 2))
    graph = G.knn_graph(G.euclidean_rows(jnp.asarray(x, jnp.float32)), 4, num_nodes=50)
    rhs = jnp.asarray(np.random.default_rng(7).normal(size=(50, 3)), jnp.float32)
    a = G.laplacian_solve(graph, rhs, 2.0, method="cholesky")
    b = G.laplacian_solve(graph, rhs, 2.0, method="cg")
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_ten_thousand_clients_without_an_n_by_n_array():
    n, d2 = 10_000, 3
    points = jnp.asarray(np.random.default_rng(8).uniform(size=(n, 2)), jnp.float32)
    graph = G.knn_graph(G.euclidean_rows(points), 4, num_nodes=n, block_size=1000)   # [1000, N] blocks
    check = np.random.default_rng(9).choice(n, 5, replace=False)            # spot-check the kNN
    pts = np.asarray(points, np.float64)
    edges = set(edge_list(graph))
    for i in check:
        d = np.linalg.norm(pts - pts[i], axis=1)
        d[i] = np.inf
        for j in np.argsort(d)[:4]:
            assert (min(i, j), max(i, j)) in edges
    rhs = jnp.asarray(np.random.default_rng(10).normal(size=(n, d2)), jnp.float32)
    solve = jax.jit(lambda r: G.laplacian_solve(graph, r, 0.5))               # auto: CG above 1024
    temp = solve.lower(rhs).compile().memory_analysis().temp_size_in_bytes
    assert temp < 100 * n * d2 * 4 and temp < n * n * 4 // 10                  # O(N·d2), not N²
    x = solve(rhs)
    residual = x + 0.5 * G.laplacian_apply(graph, x) - rhs
    assert float(jnp.max(jnp.linalg.norm(residual, axis=0) / jnp.linalg.norm(rhs, axis=0))) < 1e-4
    # A harder system (condition number ~ 1 + 2·10·max degree): conjugate gradients reach 1e-4 in
    # 80 iterations, where steepest descent (β = 0) would not.
    x = G.laplacian_solve(graph, rhs, 10.0, method="cg", maxiter=80, tol=1e-7)
    residual = x + 10.0 * G.laplacian_apply(graph, x) - rhs
    assert float(jnp.max(jnp.linalg.norm(residual, axis=0) / jnp.linalg.norm(rhs, axis=0))) < 1e-4


def small_problem(seed=11, n=4, d2=3):
    rng = np.random.default_rng(seed)
    z_t = rng.normal(size=(n, d2))
    linear = rng.normal(size=(n, d2))
    graph = G.Graph(jnp.array([0, 0, 1, 2], jnp.int32), jnp.array([1, 2, 3, 3], jnp.int32))  # a 4-cycle
    return z_t, linear, graph


def brute_force_z(z_t, linear, graph, eta, lam, p):
    """argmin_Z ⟨linear, Z⟩ + λ Σ_m ‖z_i − z_j‖_p + ‖Z − Z_t‖²/(2η), by SLSQP on vec(Z)."""
    n, d2 = z_t.shape
    blocks = []
    for i, j in edge_list(graph):
        b = np.zeros((d2, n * d2))
        b[:, i * d2:(i + 1) * d2] = np.eye(d2)
        b[:, j * d2:(j + 1) * d2] = -np.eye(d2)
        blocks.append(b)
    hess = np.eye(n * d2) / eta
    lin = linear.reshape(-1) - z_t.reshape(-1) / eta
    return norm_epigraph_minimize(hess, lin, blocks, lam, p, x0=(z_t - eta * linear).reshape(-1)).reshape(n, d2)


@pytest.mark.parametrize("p", ["1", "2", "inf"])
def test_z_admm_converges_to_the_brute_force_minimiser(x64, p):
    z_t, linear, graph = small_problem()
    eta, lam = 0.5, 0.4
    expected = brute_force_z(z_t, linear, graph, eta, lam, p)
    m = graph.num_edges
    res = G.graph_prox_admm(jnp.asarray(z_t), jnp.asarray(linear), jnp.zeros((m, 3)), jnp.zeros((m, 3)),
                            graph, eta=eta, lam=lam, rho=1.0, p=p, iters=1500)
    np.testing.assert_allclose(res.z, expected, atol=2e-6)
    assert float(res.primal) < 1e-7
    # The penalty's structure is exact: p = 1 fuses single coordinates (W entries 0), p = ∞
    # clips an edge's largest differences to one common magnitude.
    w = np.asarray(res.w)
    if p == "1":
        assert np.sum(np.abs(w) < 1e-9) >= 2
    if p == "inf":
        assert any(np.sum(np.abs(np.abs(row) - np.abs(row).max()) < 1e-9) >= 2 for row in w)


def test_z_step_solves_its_normal_equations(x64):
    # After one iteration from (W_0, Ω_0): G/N + (Z − Z_t)/η − QΩ_0 + ρQ(QᵀZ − W_0) = 0.
    z_t, linear, graph = small_problem(seed=12)
    rng = np.random.default_rng(13)
    w0, omega0 = rng.normal(size=(4, 3)), rng.normal(size=(4, 3))
    eta, rho = 0.3, 2.0
    for method in ("cholesky", "cg"):
        res = G.graph_prox_admm(jnp.asarray(z_t), jnp.asarray(linear), jnp.asarray(w0), jnp.asarray(omega0),
                                graph, eta=eta, lam=0.1, rho=rho, p=2, iters=1, method=method, tol=1e-13)
        q = dense_incidence(graph, 4)
        z = np.asarray(res.z)
        normal = linear + (z - z_t) / eta - q @ omega0 + rho * q @ (q.T @ z - w0)
        assert np.abs(normal).max() < 1e-10


def test_lambda_zero_gives_the_plain_gradient_step(x64):
    # T2: with λ = 0 the personal parts follow z ← z − η·(G/N), independently of the graph.
    z_t, linear, graph = small_problem(seed=14)
    res = G.graph_prox_admm(jnp.asarray(z_t), jnp.asarray(linear), jnp.zeros((4, 3)), jnp.zeros((4, 3)),
                            graph, eta=0.5, lam=0.0, rho=1.0, p=2, iters=200)
    np.testing.assert_allclose(res.z, z_t - 0.5 * linear, atol=1e-10)


@pytest.mark.parametrize("p", ["1", "2", "inf"])
def test_large_lambda_makes_all_personal_parts_equal(x64, p):
    # T3: λ → ∞ on a connected graph: consensus at the mean of Z_t − η·G/N.
    z_t, linear, graph = small_problem(seed=15)
    res = G.graph_prox_admm(jnp.asarray(z_t), jnp.asarray(linear), jnp.zeros((4, 3)), jnp.zeros((4, 3)),
                            graph, eta=0.5, lam=1e4, rho=1.0, p=p, iters=400)
    np.testing.assert_allclose(res.z, np.broadcast_to((z_t - 0.5 * linear).mean(0), (4, 3)), atol=1e-8)


def test_warm_start_at_the_solution_stays_there(x64):
    z_t, linear, graph = small_problem(seed=16)
    kw = dict(eta=0.5, lam=0.3, rho=1.0, p=2)
    res = G.graph_prox_admm(jnp.asarray(z_t), jnp.asarray(linear), jnp.zeros((4, 3)), jnp.zeros((4, 3)),
                            graph, iters=2000, **kw)
    again = G.graph_prox_admm(jnp.asarray(z_t), jnp.asarray(linear), res.w, res.omega, graph,
                              iters=1, **kw)
    np.testing.assert_allclose(again.z, res.z, atol=1e-10)


# ----------------------------------------------------------------------------------------------
# Distances


def subsamples(seed=17, n=5, s=6, dim=4):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, s, dim)) + np.arange(n)[:, None, None] * 0.3
    counts = np.array([6, 3, 6, 1, 5])[:n]
    return x, counts


def test_mmd_rows_match_numpy(x64):
    x, counts = subsamples()
    sigma = 1.7

    def k(a, b):
        return np.exp(-np.sum((a[:, None] - b[None]) ** 2, -1) / (2 * sigma**2))

    expected = np.zeros((5, 5))
    for i in range(5):
        for j in range(5):
            a, b = x[i, :counts[i]], x[j, :counts[j]]
            expected[i, j] = k(a, a).mean() + k(b, b).mean() - 2 * k(a, b).mean()
    rows = G.mmd_rows(jnp.asarray(x), jnp.asarray(counts), sigma)
    np.testing.assert_allclose(np.concatenate([rows(0, 2), rows(2, 5)]), expected, atol=1e-12)
    # Random Fourier features estimate the same squared MMD.
    emb = G.rff_mean_embedding(jnp.asarray(x), jnp.asarray(counts), jax.random.key(0),
                               num_features=20000, bandwidth=sigma)
    approx = np.sum((np.asarray(emb)[:, None] - np.asarray(emb)[None]) ** 2, -1)
    np.testing.assert_allclose(approx, expected, atol=0.03)


def test_median_heuristic(x64):
    pts = np.random.default_rng(18).normal(size=(30, 3))
    d = np.linalg.norm(pts[:, None] - pts[None], axis=-1)[np.triu_indices(30, 1)]
    np.testing.assert_allclose(G.median_heuristic(jnp.asarray(pts)), np.median(d), rtol=1e-12)


@pytest.mark.parametrize("metric", ["frobenius", "log_euclidean"])
def test_covariance_embedding_matches_numpy(x64, metric):
    x, counts = subsamples()
    proj = np.random.default_rng(19).normal(size=(4, 2))
    emb = np.asarray(G.covariance_embedding(jnp.asarray(x), jnp.asarray(counts), jnp.asarray(proj),
                                            metric=metric))
    for i in range(5):
        if counts[i] < 2:
            np.testing.assert_allclose(emb[i], 0.0 if metric == "frobenius" else emb[i])
            continue
        cov = np.cov((x[i, :counts[i]] @ proj).T)
        if metric == "log_euclidean":
            cov = scipy.linalg.logm(cov + 1e-6 * np.eye(2)).real
        np.testing.assert_allclose(emb[i].reshape(2, 2), cov, rtol=1e-8, atol=1e-10)


def test_euclidean_cosine_and_model_rows(x64):
    rng = np.random.default_rng(20)
    ref = {"a": rng.normal(size=(2, 3)), "b": rng.normal(size=2)}
    stacked = jax.tree.map(lambda r: r[None] + rng.normal(size=(4, *r.shape)), ref)
    emb = np.asarray(G.model_embedding(jax.tree.map(jnp.asarray, stacked), jax.tree.map(jnp.asarray, ref)))
    flat = np.concatenate([(stacked["a"] - ref["a"]).reshape(4, -1), (stacked["b"] - ref["b"])], 1)
    np.testing.assert_allclose(emb, flat, rtol=1e-12)
    eu = np.linalg.norm(flat[:, None] - flat[None], axis=-1)
    np.testing.assert_allclose(G.euclidean_rows(jnp.asarray(flat))(0, 4), eu, atol=1e-7)
    unit = flat / np.linalg.norm(flat, axis=1, keepdims=True)
    np.testing.assert_allclose(G.cosine_rows(jnp.asarray(flat))(1, 3), 1 - unit[1:3] @ unit.T, atol=1e-12)


def test_edges_within_planted_groups():
    graph = G.Graph(jnp.array([0, 0, 1, 2]), jnp.array([1, 2, 3, 3]))
    assert G.edges_within(graph, np.array([0, 0, 1, 1])) == 0.5
