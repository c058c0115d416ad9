"""Guards for FedPC's graph ADMM (issue 30, item 10): the multiplier update
Ω_{k+1} = Ω_k + ρ(W_{k+1} − QᵀZ_{k+1}) keeps its ρ. Every other test of it runs ρ = 1 (where the
factor is invisible) or a single iteration (where Ω_{k+1} is never used), and at convergence the
minimiser does not depend on the dual step either, so the guard follows the iterates: K = 6
iterations from a non-zero warm start at ρ ≠ 1 against an ADMM written here in float64 NumPy,
directly from the scaled-form equations of docs/algorithms/fedpc.md#round step 4:

    Z_{k+1} = (I + ηρL)⁻¹ (Z_t − η·linear + η Q(Ω_k + ρW_k))
    W_{k+1} = prox_{(λ/ρ)‖·‖_p}(QᵀZ_{k+1} − Ω_k/ρ)     row by row
    Ω_{k+1} = Ω_k + ρ(W_{k+1} − QᵀZ_{k+1})

(dense incidence matrix Q, dense solve, the prox of each p by its textbook formula), then through
a FedPC round (public API) whose personal step is that ADMM with ρ = 2.5 and K = 4.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import linear_model, make_data, make_raw

from fedjax_pfl import algorithms
from fedjax_pfl.ops import graph as G


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
