"""The similarity graph, Laplacian solves, the Z-subproblem ADMM and client distances:
docs/algorithms/fedpc.md#graph, #round and #tests. References: dense float64 numpy and scipy
SLSQP (tests/support/convex_reference.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg
from convex_reference import norm_epigraph_minimize
from helpers import linear_model, make_data, make_raw

from fedjax_pfl import algorithms
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


@pytest.mark.slow
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
@pytest.mark.slow
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


@pytest.mark.slow
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

# -- Guards for FedPC's graph ADMM (issue 30, item 10): the multiplier update --------------------


def _incidence(senders, receivers, n):
    q = np.zeros((n, len(senders)))
    for m, (i, j) in enumerate(zip(senders, receivers)):
        q[i, m], q[j, m] = 1.0, -1.0
    return q


def _prox_row(v, tau, p):
    """argmin_w τ‖w‖_p + ½‖w − v‖² for one vector v (float64)."""
    if p == "1":
        return np.sign(v) * np.maximum(np.abs(v) - tau, 0.0)
    if p == "2":
        norm = np.linalg.norm(v)
        return np.zeros_like(v) if norm <= tau else (1.0 - tau / norm) * v
    # p = ∞: v minus its projection onto the ℓ1 ball of radius τ (Moreau). The projection
    # soft-thresholds |v| at the θ ≥ 0 with Σ max(|v_i| − θ, 0) = τ, found here by bisection.
    if np.abs(v).sum() <= tau:
        return np.zeros_like(v)
    lo, hi = 0.0, np.abs(v).max()
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if np.maximum(np.abs(v) - mid, 0.0).sum() > tau else (lo, mid)
    proj = np.sign(v) * np.maximum(np.abs(v) - 0.5 * (lo + hi), 0.0)
    return v - proj


def numpy_admm(z_t, linear, w, omega, q, *, eta, lam, rho, p, iters):
    """The K iterations above, in float64, plus the residuals ‖W_K − QᵀZ_K‖ and
    ρ‖Q(W_K − W_{K−1})‖."""
    n = z_t.shape[0]
    system = np.eye(n) + eta * rho * (q @ q.T)
    z, w_prev = z_t, w
    for _ in range(iters):
        z = np.linalg.solve(system, z_t - eta * linear + eta * q @ (omega + rho * w))
        diffs = q.T @ z
        w_prev, w = w, np.stack([_prox_row(row, lam / rho, p) for row in diffs - omega / rho])
        omega = omega + rho * (w - diffs)
    return z, w, omega, np.linalg.norm(w - q.T @ z), rho * np.linalg.norm(q @ (w - w_prev))


@pytest.mark.parametrize("p", ["1", "2", "inf"])
@pytest.mark.parametrize("method", ["cholesky", "cg"])
@pytest.mark.slow
def test_admm_iterates_follow_the_scaled_updates_at_rho_not_one(x64, p, method):
    rng = np.random.default_rng(30)
    n, d2 = 5, 3
    senders, receivers = [0, 0, 1, 2, 3, 1], [1, 2, 3, 3, 4, 4]       # a connected 5-node graph
    graph = G.Graph(jnp.asarray(senders, jnp.int32), jnp.asarray(receivers, jnp.int32))
    m = len(senders)
    z_t, linear = rng.normal(size=(n, d2)), rng.normal(size=(n, d2))
    w0, omega0 = rng.normal(size=(m, d2)), rng.normal(size=(m, d2))  # warm start: Ω_0 ≠ 0
    kw = dict(eta=0.3, lam=0.4, rho=2.5, p=p, iters=6)
    want = numpy_admm(z_t, linear, w0, omega0, _incidence(senders, receivers, n), **kw)
    got = G.graph_prox_admm(jnp.asarray(z_t), jnp.asarray(linear), jnp.asarray(w0),
                            jnp.asarray(omega0), graph, method=method, tol=1e-14, maxiter=500, **kw)
    for name, a, b in zip(("z", "w", "omega", "primal", "dual"), got, want):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-8, atol=1e-9, err_msg=name)


@pytest.mark.slow
def test_a_fedpc_round_runs_that_admm_with_its_rho(x64):
    """One FedPC round with every parameter personal (personal='all', so Z holds whole models),
    K = 1 local step with B ≥ n_i (the uploaded ∇^(n) is the full-batch gradient of client n's
    mean cross-entropy at z^(n), written here in NumPy), λ > 0, ρ = 2.5, η_z = 0.7, K_admm = 4,
    cold start: z_{t+1} must be `numpy_admm` of (Z_t, G_t/N) on the round's own graph. The ADMM
    acts on each row's coordinates as a whole vector (‖·‖₂ rows, column-wise solves), so the
    reference may flatten each model in its own order."""
    sizes = [6, 5, 7, 4, 6]
    n, features, classes = len(sizes), 4, 3
    data = make_data(sizes, num_classes=classes, feature_dim=features, seed=3)
    x_raw, y_raw, train, _, _, _ = make_raw(sizes, num_classes=classes, feature_dim=features, seed=3)
    model = linear_model(features, classes)
    algo = algorithms.get("fedpc", model=model, personal="all", lam=0.3, p="2", k=2, rho=2.5,
                          admm_iters=4, admm_start="cold", eta=0.1, eta_personal=0.7,
                          local_steps=1, batch_size=8, lr=0.1, participation=1.0)
    state = algo.init(jax.random.key(0), data)
    senders, receivers = np.asarray(state.graph.senders), np.asarray(state.graph.receivers)
    assert len(senders) >= n - 1                                   # the graph couples the clients

    def flat(w, b):
        return np.concatenate([np.ravel(w), np.ravel(b)])

    z_t = np.stack([flat(np.asarray(state.z["w"][i], np.float64), np.asarray(state.z["b"][i], np.float64))
                    for i in range(n)])
    grads = []
    for i, rows in enumerate(train):
        w, b = z_t[i, :features * classes].reshape(features, classes), z_t[i, features * classes:]
        x = np.asarray(x_raw[rows], np.float64)
        logits = x @ w + b
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        err = (probs - np.eye(classes)[y_raw[rows]]) / len(rows)      # d(mean CE)/d(logits)
        grads.append(flat(x.T @ err, err.sum(0)))
    m = len(senders)
    want_z, *_ = numpy_admm(z_t, np.stack(grads) / n, np.zeros((m, z_t.shape[1])),
                            np.zeros((m, z_t.shape[1])), _incidence(senders, receivers, n),
                            eta=0.7, lam=0.3, rho=2.5, p="2", iters=4)
    new_state, _ = jax.jit(algo.round_fn)(state, data, jax.random.key(1))
    got_z = np.stack([flat(np.asarray(new_state.z["w"][i]), np.asarray(new_state.z["b"][i]))
                      for i in range(n)])
    np.testing.assert_allclose(got_z, want_z, rtol=1e-6, atol=1e-7)
    # The penalty acted: without the graph term the step would be the plain Z_t − η_z G/N.
    assert np.abs(want_z - (z_t - 0.7 * np.stack(grads) / n)).max() > 1e-3
