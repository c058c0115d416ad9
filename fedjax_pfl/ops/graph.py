"""FedPC's similarity network: client distances, the kNN graph, Laplacian solves and the Z-ADMM.

Notation (docs/algorithms/fedpc.md#graph, #round). N clients, M undirected edges. Edge
m = (i, j), i < j, is column m of the signed incidence matrix Q ∈ R^{N×M} (+1 at i, −1 at j);
L = QQᵀ is the graph Laplacian.
The draft stacks personal parts as columns, Z ∈ R^{d2×N}; the engine stacks clients on the
LEADING axis, so here Z is [N, d2] (row n = z^(n)) and the edge variables W, Ω are [M, d2]
(row m = column m of the draft's W, Ω). In this layout

    draft ZQ   = here Qᵀ Z  = `edge_differences(graph, Z)`   row m: z^(i) − z^(j)      [M, d2]
    draft WQᵀ  = here Q W   = `incidence_apply(graph, W, N)`  row n: Σ_{m∋n} ±W_m       [N, d2]
    draft ZL   = here L Z   = `laplacian_apply(graph, Z)`                               [N, d2]

Q is never formed: its actions are gathers and `segment_sum`s over the edge endpoints, O(M·d2).
Nothing here allocates an N×N array except `dense_laplacian` and the Cholesky path of
`laplacian_solver`, which are used only up to `CHOLESKY_MAX_NODES` clients; above it the
Z-system is solved by matrix-free conjugate gradients. The kNN graph is computed from distance
rows in blocks, so N = 10,000 clients never materialise an N×N distance matrix either.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfl.ops.prox import prox_norm

Params = Any
RowsFn = Callable[[int, int], jax.Array]

# Up to this many clients the Z-system (I + ηρL)Z = R is solved by a Cholesky factor of the dense
# N×N matrix, computed once per round and reused by every ADMM iteration (N = 1024: 4 MB in
# float32, a 0.4 GFLOP factorisation); above it by Jacobi-preconditioned conjugate gradients on
# the sparse Laplacian, which never holds anything N×N.
CHOLESKY_MAX_NODES = 1024
# Elements of one block of distance computations (kNN rows, MMD kernel blocks): 64 MB in float32.
BLOCK_BUDGET = 2**24


class Graph(NamedTuple):
    """An undirected graph as an edge list; edge m = (senders[m], receivers[m]), senders < receivers."""

    senders: jax.Array    # [M] int32
    receivers: jax.Array  # [M] int32

    @property
    def num_edges(self) -> int:
        return self.senders.shape[0]


# ----------------------------------------------------------------------------------------------
# Incidence and Laplacian actions


def edge_differences(graph: Graph, z: jax.Array) -> jax.Array:
    """Qᵀz: row m is z[i] − z[j] for edge m = (i, j). [N, ...] -> [M, ...] (the draft's ZQ)."""
    return z[graph.senders] - z[graph.receivers]


def incidence_apply(graph: Graph, w: jax.Array, num_nodes: int) -> jax.Array:
    """Qw: row n is Σ_{m=(n,·)} w_m − Σ_{m=(·,n)} w_m. [M, ...] -> [N, ...] (the draft's WQᵀ)."""
    return (jax.ops.segment_sum(w, graph.senders, num_nodes)
            - jax.ops.segment_sum(w, graph.receivers, num_nodes))


def laplacian_apply(graph: Graph, z: jax.Array) -> jax.Array:
    """Lz = QQᵀz: row n is Σ_{j~n} (z_n − z_j). [N, ...] -> [N, ...]; O(M·d)."""
    return incidence_apply(graph, edge_differences(graph, z), z.shape[0])


def degrees(graph: Graph, num_nodes: int) -> jax.Array:
    """[N] number of edges at each node (the diagonal of L)."""
    ones = jnp.ones(graph.num_edges, jnp.float32)
    return (jax.ops.segment_sum(ones, graph.senders, num_nodes)
            + jax.ops.segment_sum(ones, graph.receivers, num_nodes))


def dense_laplacian(graph: Graph, num_nodes: int, dtype=None) -> jax.Array:
    """L = D − A as a dense [N, N] array (small N only: the Cholesky path and tests)."""
    dtype = dtype or jnp.zeros(()).dtype
    s, r = graph.senders, graph.receivers
    lap = jnp.zeros((num_nodes, num_nodes), dtype)
    lap = lap.at[s, r].add(-1.0).at[r, s].add(-1.0)
    return lap.at[s, s].add(1.0).at[r, r].add(1.0)


# ----------------------------------------------------------------------------------------------
# The Z-system (I + ηρL) Z = R


def laplacian_solver(graph: Graph, num_nodes: int, shift: jax.typing.ArrayLike, *,
                     method: str = "auto", tol: float = 1e-6, maxiter: int = 200
                     ) -> Callable[..., jax.Array]:
    """A function solve(R, X0=None) -> X with (I + shift·L) X = R for R [N, d2] (all columns at once).

    method:
      "cholesky": factor I + shift·L (dense N×N) once, here; every call is two triangular solves.
      "cg":       Jacobi-preconditioned conjugate gradients with the sparse Laplacian action,
                  column-wise (each of the d2 columns has its own step sizes), from X0 (default
                  R), until every column's residual is ≤ tol·‖R column‖ or `maxiter` iterations.
                  The matrix is SPD with eigenvalues in [1, 1 + 2·shift·max degree].
      "auto":     "cholesky" for N ≤ CHOLESKY_MAX_NODES, else "cg".
    The factor (or the degrees) is computed once per solver, so the K ADMM iterations of a round
    that share η_t share it.
    """
    if method == "auto":
        method = "cholesky" if num_nodes <= CHOLESKY_MAX_NODES else "cg"
    if method == "cholesky":
        lap = dense_laplacian(graph, num_nodes, jnp.result_type(shift, jnp.zeros(()).dtype))
        matrix = jnp.eye(num_nodes, dtype=lap.dtype) + shift * lap
        factor = jax.scipy.linalg.cho_factor(matrix, lower=True)

        def solve_cholesky(rhs, x0=None):
            del x0
            flat = rhs.reshape(num_nodes, -1)
            return jax.scipy.linalg.cho_solve(factor, flat).astype(rhs.dtype).reshape(rhs.shape)

        return solve_cholesky
    if method != "cg":
        raise ValueError(f"method must be 'auto', 'cholesky' or 'cg', got {method!r}")
    diag = 1.0 + shift * degrees(graph, num_nodes)

    def solve_cg(rhs, x0=None):
        b = rhs.reshape(num_nodes, -1)
        dtype = b.dtype
        inv_diag = (1.0 / diag).astype(dtype)[:, None]
        apply = lambda x: x + jnp.asarray(shift, dtype) * laplacian_apply(graph, x)
        x = b if x0 is None else x0.reshape(num_nodes, -1).astype(dtype)
        r = b - apply(x)
        zz = inv_diag * r
        p = zz
        rz = jnp.sum(r * zz, axis=0)
        target = (tol ** 2) * jnp.maximum(jnp.sum(b * b, axis=0), jnp.finfo(dtype).tiny)

        def cond(carry):
            it, _, r, _, _ = carry
            return (it < maxiter) & jnp.any(jnp.sum(r * r, axis=0) > target)

        def body(carry):
            it, x, r, p, rz = carry
            ap = apply(p)
            pap = jnp.sum(p * ap, axis=0)
            alpha = jnp.where(pap > 0, rz / jnp.where(pap > 0, pap, 1.0), 0.0)
            x = x + alpha * p
            r = r - alpha * ap
            zz = inv_diag * r
            rz_new = jnp.sum(r * zz, axis=0)
            beta = jnp.where(rz > 0, rz_new / jnp.where(rz > 0, rz, 1.0), 0.0)
            return it + 1, x, r, zz + beta * p, rz_new

        _, x, _, _, _ = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), x, r, p, rz))
        return x.reshape(rhs.shape)

    return solve_cg


def laplacian_solve(graph: Graph, rhs: jax.Array, shift: jax.typing.ArrayLike, *,
                    method: str = "auto", x0: jax.Array | None = None, **kw) -> jax.Array:
    """X with (I + shift·L) X = rhs, rhs [N, ...]; see `laplacian_solver`."""
    return laplacian_solver(graph, rhs.shape[0], shift, method=method, **kw)(rhs, x0)


# ----------------------------------------------------------------------------------------------
# The Z-subproblem


class AdmmResult(NamedTuple):
    z: jax.Array        # Z_K                                   [N, d2]
    w: jax.Array        # W_K                                   [M, d2]
    omega: jax.Array    # Ω_K                                   [M, d2]
    primal: jax.Array   # ‖W_K − QᵀZ_K‖_F, the constraint violation      ()
    dual: jax.Array     # ρ‖Q(W_K − W_{K−1})‖_F                           ()


@functools.partial(jax.jit, static_argnames=("p", "iters", "method", "tol", "maxiter"))
def graph_prox_admm(z_t: jax.Array, linear: jax.Array, w: jax.Array, omega: jax.Array,
                    graph: Graph, *, eta: jax.typing.ArrayLike, lam: jax.typing.ArrayLike,
                    rho: jax.typing.ArrayLike, p, iters: int, method: str = "auto",
                    tol: float = 1e-6, maxiter: int = 200) -> AdmmResult:
    """K iterations of ADMM on FedPC's Z-subproblem (docs/algorithms/fedpc.md#round step 4; the
    draft's Algorithm 4):

        min_Z ⟨linear, Z⟩ + λ Σ_m ‖(QᵀZ)_m‖_p + ‖Z − Z_t‖_F²/(2η),   linear = G_t/N,

    split as W = QᵀZ with multiplier Ω and penalty ρ (row layout of the module docstring):

        Z_{k+1} solves (I + ηρL) Z = Z_t + η(QΩ_k − linear + ρ QW_k)
        W_{k+1} = prox_{(λ/ρ)‖·‖_p}(QᵀZ_{k+1} − Ω_k/ρ)     row by row              [F1] all p
        Ω_{k+1} = Ω_k + ρ(W_{k+1} − QᵀZ_{k+1})

    The system matrix is factored (or its preconditioner built) once and reused by all K
    iterations; the CG path starts each solve from the previous Z. Jitted (p, K, the solver and
    its tol/maxiter are static), so it compiles once even when called eagerly.

    Args:
      z_t: Z_t, [N, d2].
      linear: the coefficient of the linear term, G_t/N, [N, d2].
      w, omega: W_0 and Ω_0, [M, d2] (warm start: last round's; cold start: zeros).
      graph: the edges (M of them).
      eta: η_t > 0; lam: λ ≥ 0; rho: ρ > 0; p: 1, 2 or inf; iters: K ≥ 1 (static).
      method, tol, maxiter: the Z-system solver, see `laplacian_solver`.
    Returns:
      AdmmResult(Z_K, W_K, Ω_K, primal residual, dual residual).
    """
    n = z_t.shape[0]
    dtype = z_t.dtype
    eta = jnp.asarray(eta, dtype)
    rho = jnp.asarray(rho, dtype)
    solve = laplacian_solver(graph, n, eta * rho, method=method, tol=tol, maxiter=maxiter)
    tau = jnp.asarray(lam, dtype) / rho
    prox_rows = jax.vmap(prox_norm, in_axes=(0, None, None))
    base = z_t - eta * linear

    def body(_, carry):
        z, w, omega, _ = carry
        rhs = base + eta * incidence_apply(graph, omega + rho * w, n)
        z = solve(rhs, z)
        diffs = edge_differences(graph, z)
        w_new = prox_rows(diffs - omega / rho, tau, p)
        omega = omega + rho * (w_new - diffs)
        return z, w_new, omega, w

    z, w_last, omega_last, w_prev = jax.lax.fori_loop(0, iters, body, (z_t, w, omega, w), unroll=iters <= 16)
    primal = jnp.sqrt(jnp.sum((w_last - edge_differences(graph, z)) ** 2))
    dual = rho * jnp.sqrt(jnp.sum(incidence_apply(graph, w_last - w_prev, n) ** 2))
    return AdmmResult(z, w_last, omega_last, primal, dual)


# ----------------------------------------------------------------------------------------------
# The kNN graph


def knn_graph(dist: jax.Array | RowsFn, k: int, *, num_nodes: int | None = None,
              block_size: int | None = None) -> Graph:
    """The symmetrised k-nearest-neighbour graph (docs/algorithms/fedpc.md#graph): edge (i, j) if j
    is among i's k nearest or i among j's, each undirected edge once, sorted, no self-loops.

    Args:
      dist: an [N, N] distance matrix, or a function rows(start, stop) -> [stop − start, N]
        giving distance rows in blocks (then `num_nodes` is required), so the N×N matrix never
        exists; smaller is nearer.
      k: neighbours per node (clipped to N − 1). Ties go to the lower index.
      num_nodes: N, when `dist` is a function.
      block_size: rows per block (default: within BLOCK_BUDGET elements).
    Returns:
      Graph with M ≤ N·k edges. Built on the host (its size depends on the data); not jittable.
    """
    if callable(dist):
        if num_nodes is None:
            raise ValueError("knn_graph: give num_nodes with a distance-rows function")
        rows = dist
    else:
        matrix = jnp.asarray(dist)
        num_nodes = matrix.shape[0]
        rows = lambda a, b: matrix[a:b]
    n = int(num_nodes)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    k = min(int(k), n - 1)
    if k == 0:
        empty = jnp.zeros((0,), jnp.int32)
        return Graph(empty, empty)
    block = block_size or max(1, min(n, BLOCK_BUDGET // max(n, 1)))
    neighbours = []
    for a in range(0, n, block):
        b = min(n, a + block)
        neighbours.append(np.asarray(_nearest(rows(a, b), jnp.arange(a, b), k)))
    nbr = np.concatenate(neighbours)
    i = np.repeat(np.arange(n), k)
    j = nbr.reshape(-1)
    pairs = np.unique(np.stack([np.minimum(i, j), np.maximum(i, j)], axis=1), axis=0)
    return Graph(jnp.asarray(pairs[:, 0], jnp.int32), jnp.asarray(pairs[:, 1], jnp.int32))


@functools.partial(jax.jit, static_argnums=2)
def _nearest(block: jax.Array, row_ids: jax.Array, k: int) -> jax.Array:
    """Indices of the k smallest entries of each row, the row's own node excluded."""
    block = jnp.where(jnp.isnan(block), jnp.inf, block)
    block = block.at[jnp.arange(block.shape[0]), row_ids].set(jnp.inf)
    return jax.lax.top_k(-block, k)[1]


def edges_within(graph: Graph, groups: np.ndarray) -> float:
    """Fraction of edges whose two endpoints share a group label (e.g. a planted cluster)."""
    groups = np.asarray(groups)
    s, r = np.asarray(graph.senders), np.asarray(graph.receivers)
    return float(np.mean(groups[s] == groups[r])) if s.size else float("nan")


# ----------------------------------------------------------------------------------------------
# Client distances in the three spaces of docs/algorithms/fedpc.md#graph


def _sq_dists(a: jax.Array, b: jax.Array) -> jax.Array:
    """‖a_i − b_j‖² for a [P, D], b [Q, D] -> [P, Q], clipped at 0."""
    sq = (jnp.sum(a * a, -1)[:, None] + jnp.sum(b * b, -1)[None, :] - 2.0 * a @ b.T)
    return jnp.maximum(sq, 0.0)


def euclidean_rows(emb: jax.Array) -> RowsFn:
    """Distance rows ‖e_i − e_j‖ for per-client embeddings emb [N, D] (blocks of rows)."""
    fn = jax.jit(lambda block: jnp.sqrt(_sq_dists(block, emb)))
    return lambda a, b: fn(emb[a:b])


def cosine_rows(emb: jax.Array) -> RowsFn:
    """Distance rows 1 − cos(e_i, e_j) for embeddings emb [N, D] (zero vectors: distance 1)."""
    norms = jnp.linalg.norm(emb, axis=-1, keepdims=True)
    unit = emb / jnp.where(norms > 0, norms, 1.0)
    fn = jax.jit(lambda block: 1.0 - block @ unit.T)
    return lambda a, b: fn(unit[a:b])


def median_heuristic(points: jax.Array, max_points: int = 2048, key: jax.Array | None = None) -> jax.Array:
    """RBF bandwidth σ = median of the pairwise distances ‖a − b‖ (a ≠ b) among `points` [P, D]
    (a random subset of `max_points` of them when there are more)."""
    if points.shape[0] > max_points:
        key = jax.random.key(0) if key is None else key
        points = points[jax.random.choice(key, points.shape[0], (max_points,), replace=False)]
    return _median_distance(points)


@jax.jit
def _median_distance(points):
    d = jnp.sqrt(_sq_dists(points, points))
    iu = np.triu_indices(points.shape[0], 1)
    return jnp.median(d[iu])


def _mean_kernel(xa, wa, xb, wb, bandwidth):
    """Σ_ab wa_a wb_b k(xa_a, xb_b) with k(a, b) = exp(−‖a − b‖²/(2σ²))."""
    kernel = jnp.exp(-_sq_dists(xa, xb) / (2.0 * bandwidth ** 2))
    return wa @ kernel @ wb


def mmd_rows(samples: jax.Array, counts: jax.Array, bandwidth: jax.typing.ArrayLike) -> RowsFn:
    """Rows of squared MMD between clients' subsamples (docs/algorithms/fedpc.md#graph, data space).

        MMD²(i, j) = k̄(i, i) + k̄(j, j) − 2 k̄(i, j),   k̄(i, j) = mean_{a∈S_i, b∈S_j} k(x_a, x_b),

    the biased (V-statistic) estimate with the RBF kernel k(a, b) = exp(−‖a − b‖²/(2σ²)).
    samples [N, S, D]: each client's subsample (flattened inputs), of which the first counts[i]
    rows are real (the rest padding). A block of B rows costs B·N·S² kernel entries; choose the
    block size accordingly (`mmd_block_size`).
    """
    weights, self_terms = _mmd_self_terms(samples, counts, bandwidth)

    def cross(xa, wa):   # one client against all: [N]
        return jax.vmap(lambda xb, wb: _mean_kernel(xa, wa, xb, wb, bandwidth))(samples, weights)

    @jax.jit
    def block(xa, wa, self_a):
        k_ab = jax.vmap(cross)(xa, wa)                                   # [B, N]
        return jnp.maximum(self_a[:, None] + self_terms[None, :] - 2.0 * k_ab, 0.0)

    return lambda a, b: block(samples[a:b], weights[a:b], self_terms[a:b])


@jax.jit
def _mmd_self_terms(samples, counts, bandwidth):
    """Normalised sample weights [N, S] and k̄(i, i) [N]."""
    s = samples.shape[1]
    weights = (jnp.arange(s)[None, :] < counts[:, None]).astype(samples.dtype)
    weights = weights / jnp.maximum(weights.sum(-1, keepdims=True), 1.0)
    self_terms = jax.lax.map(lambda xw: _mean_kernel(xw[0], xw[1], xw[0], xw[1], bandwidth),
                             (samples, weights))
    return weights, self_terms


def mmd_block_size(num_nodes: int, samples_per_client: int) -> int:
    """Rows per kNN block so that one MMD block holds at most BLOCK_BUDGET kernel entries."""
    return max(1, BLOCK_BUDGET // max(1, num_nodes * samples_per_client ** 2))


def rff_mean_embedding(samples: jax.Array, counts: jax.Array, key: jax.Array, *,
                       num_features: int, bandwidth: jax.typing.ArrayLike) -> jax.Array:
    """Mean random Fourier features μ_i = mean_{a∈S_i} φ(x_a), φ(x) = √(2/F) cos(Ωᵀx + b),
    Ω ~ N(0, I/σ²), b ~ U[0, 2π): ‖μ_i − μ_j‖² estimates MMD²(i, j) with the same RBF kernel
    (Rahimi & Recht 2007), so the data-space kNN becomes a Euclidean one at O(N·F) memory.
    """
    _, s, dim = samples.shape
    k1, k2 = jax.random.split(key)
    omega = jax.random.normal(k1, (dim, num_features), samples.dtype) / bandwidth
    phase = jax.random.uniform(k2, (num_features,), samples.dtype, 0.0, 2 * jnp.pi)
    weights = (jnp.arange(s)[None, :] < counts[:, None]).astype(samples.dtype)
    weights = weights / jnp.maximum(weights.sum(-1, keepdims=True), 1.0)
    feats = jnp.sqrt(2.0 / num_features) * jnp.cos(samples @ omega + phase)     # [N, S, F]
    return jnp.einsum("ns,nsf->nf", weights, feats)


def random_projection(key: jax.Array, dim: int, rank: int, dtype=jnp.float32) -> jax.Array:
    """A fixed Gaussian projection [dim, rank] with entries N(0, 1/dim)."""
    return jax.random.normal(key, (dim, rank), dtype) / np.sqrt(dim)


def covariance_embedding(samples: jax.Array, counts: jax.Array, projection: jax.Array, *,
                         metric: str = "frobenius", eps: float = 1e-6) -> jax.Array:
    """Per-client input covariance on a fixed projection, flattened (docs/algorithms/fedpc.md#graph,
    feature space).

    C_i = (1/(n_i − 1)) Σ_a (P ᵀx_a − m_i)(Pᵀx_a − m_i)ᵀ over client i's (sub)samples, r×r.
    metric "frobenius": the embedding is C_i, so Euclidean distance = ‖C_i − C_j‖_F;
    "log_euclidean": the embedding is log(C_i + εI), distance ‖log C_i − log C_j‖_F.
    Returns [N, r·r].
    """
    if metric not in ("frobenius", "log_euclidean"):
        raise ValueError(f"metric must be 'frobenius' or 'log_euclidean', got {metric!r}")
    s = samples.shape[1]
    mask = (jnp.arange(s)[None, :] < counts[:, None]).astype(samples.dtype)[..., None]
    proj = (samples @ projection) * mask                                          # [N, S, r]
    n = jnp.maximum(counts.astype(samples.dtype), 1.0)[:, None, None]
    mean = proj.sum(1, keepdims=True) / n
    centred = (proj - mean) * mask
    cov = jnp.einsum("nsa,nsb->nab", centred, centred) / jnp.maximum(n - 1.0, 1.0)
    if metric == "log_euclidean":
        r = cov.shape[-1]
        vals, vecs = jnp.linalg.eigh(cov + eps * jnp.eye(r, dtype=cov.dtype))
        cov = jnp.einsum("nab,nb,ncb->nac", vecs, jnp.log(jnp.maximum(vals, eps)), vecs)
    return cov.reshape(cov.shape[0], -1)


def model_embedding(stacked: Params, reference: Params) -> jax.Array:
    """[N, d]: each client's parameters minus the common `reference`, flattened
    (docs/algorithms/fedpc.md#graph, model space). Euclidean distances equal those of the parameters
    themselves; cosine distances compare the directions the clients moved in from the common
    initialisation."""
    leaves = jax.tree.leaves(jax.tree.map(lambda s, r: (s - r[None]).reshape(s.shape[0], -1),
                                          stacked, reference))
    return jnp.concatenate(leaves, axis=1)
