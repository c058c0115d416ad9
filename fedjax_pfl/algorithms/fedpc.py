"""FedPC: a shared component plus personal components fused on a client similarity graph by ADMM.

docs/algorithms/fedpc.md (the draft "A Fast Training Framework for Federated Model with
Personalized Component", Algorithms 1, 3, 4, 5, with its closed forms corrected). Every client's
model is y^(n) = M x + N z^(n): the shared leaves x (one copy) and the personal leaves z^(n) (one
row per client), split by parameter path (`models/split.py`, `--fedpc-personal`). Objective
(#objective):

    min_{x, Z} (1/N) Σ_n f_n(M x + N z^(n)) + λ Σ_{edges (i,j)} ‖z^(i) − z^(j)‖_p

on a symmetrised kNN graph of the clients built once, in `init`, from client distances in the
data, feature or model space (#graph). One round t (#round, the draft's Algorithm 5):

  S_t ← sample ⌊N·rate⌋ clients                                                   (partial part.)
  y^(n) = M x_t + N z_t^(n) for n ∈ S_t                                           step 1
  ∇^(n) = Σ_{k<K} g_k, the minibatch gradients of K local SGD steps from y^(n)    step 2 (Alg. 1)
        (K = --local-steps, default 10; K = 1 is the draft's single stochastic gradient at y^(n))
  ∇^(n) ← (x_t − v)/η_t, the compressed update, when γ > 0                        step 2 (Alg. 3)
  x_{t+1} = x_t − η_t · mean_{n∈S_t} Mᵀ∇^(n)                                     step 3
  G_t = [∇^(n) for n ∈ S_t, 0 for the others]; K ADMM iterations on
     min_Z (1/N)⟨NᵀG_t, Z⟩ + λ‖ZQ‖_{1,p} + ‖Z − Z_t‖²/(2η_z)  over ALL N clients    step 4 (Alg. 4)
  y_{t+1}^(n) = M x_{t+1} + N z_{t+1}^(n) is client n's personalised model        step 5

Readings settled here (the draft is silent or ambiguous; A1–A10):
  * Local computation (step 2). The client sends the SUM of the minibatch gradients along K
    local SGD steps (lr --lr) from y^(n), accumulated by an optax transform in the engine's
    LocalTrainer: K = 1 is exactly the draft's stochastic gradient at y^(n) (a minibatch of
    --batch-size instead of one sample), and with plain SGD Σ_k g_k = (y^(n) − y_K)/lr, FedAvg's
    pseudo-gradient, so that with d2 = 0 and η = lr the shared update is the unweighted mean of the
    sampled clients' local models. --local-epochs E (without --local-steps) sums E·⌈n_i/B⌉ steps.
  * Shared step (step 3). The draft's (1/N)Σ_n over all clients becomes, under partial
    participation, the unbiased mean over the sampled clients (--fedpc-shared-mean sampled,
    default); 'all' is the literal Σ_{n∈S_t}/N with zero rows for the others.
  * Personal step size (step 4). The Z-subproblem keeps the objective's 1/N, so with λ = 0 it
    gives z^(n) ← z^(n) − (η_z/N)∇_z f_n (A3). The draft uses η_z = η_t, which moves the
    personal parts N times more slowly than the shared part; the default η_z = N·η_t
    (--fedpc-eta-personal unset) makes a λ = 0 round move z^(n) by η_t∇_z f_n, like local SGD.
    Set --fedpc-eta-personal to η (--fedpc-eta, default --lr) for the literal draft.
  * Partial participation (not in the draft): unsampled clients contribute zero rows to G_t; their
    z still moves through the graph coupling (A4).
  * λ = 0 decouples the clients: the Z-subproblem's minimiser Z_t − η_z G_t/N is returned in closed
    form instead of running ADMM (the ADMM converges to it, tests/ops/test_graph.py), and no graph
    is built (nor with d2 = 0).
  * ADMM state: W and Ω persist across rounds (--fedpc-admm-start warm, default) or restart at 0
    (cold). ρ defaults to 1/η_z, so the Z-system is I + L. The system (I + η_zρL) is factored once
    per round (Cholesky, N ≤ 1024) or solved by matrix-free CG (--fedpc-solver).
  * The ‖·‖_p of an edge spans all personal leaves together (one vector in R^{d2}), so W and Ω are
    [M, d2] matrices over the flattened personal part (edge axis leading).
  * Compression (#compression): per sampled client, on the whole ∇ (shared and personal leaves), Λ
    per leaf; ρ_c defaults to 1/(η_t γ) (c = ρ_c η_t γ = 1); the output is exactly piecewise
    constant: −δ_J/η fitted on the jump set of the ADMM's sparse r (ops/difference.py).
    Uplink accounting: Σ_leaves d_l⌈log2 k_l⌉ + 32k_l bits for k_l distinct values, against
    32·d dense.
  * Downlink: the sampled clients receive their y^(n) (d floats each) before computing.
  * Graph. data: squared MMD (RBF, median-heuristic bandwidth) between per-client subsamples
    of --fedpc-graph-samples flattened training inputs (random Fourier features above 1,000
    clients); feature: log-Euclidean (or Frobenius) distance of the input covariances on a fixed
    Gaussian projection to --fedpc-projection-dim dimensions, same subsamples (the Frobenius
    distance is dominated by the sampling noise of high-variance clients); model: cosine (or
    Euclidean) distance of the displacements θ_n − θ_0 after --fedpc-warmup-epochs of local SGD
    from the common initialisation (the engine's LocalTrainer; the warm-up only builds the graph,
    training starts from θ_0). kNN with --fedpc-k, symmetrised. `init` builds it on the host, so
    `init` is not jittable (round_fn is).
Metrics: the engine's, plus comm_* (floats and bits), bits_per_client (and _dense), distinct
values, ADMM residuals, η_t, and the graph's edge count, mean degree and fraction of edges
joining clients with identical training label sets (for the clustered partition: the fraction
of edges inside a planted cluster).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_pfl import core
from fedjax_pfl.algorithms.engine import Engine, EngineConfig, client_keys
from fedjax_pfl.algorithms.interface import Algorithm, evaluated_ids
from fedjax_pfl.algorithms.registry import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, AlgorithmSpec, Check, HParam, register
from fedjax_pfl.core.local import LocalTrainer, epoch_permutation
from fedjax_pfl.data.federated import label_counts
from fedjax_pfl.models import split as split_lib
from fedjax_pfl.models.model import Model
from fedjax_pfl.ops import difference
from fedjax_pfl.ops import graph as graph_ops

Params = Any
# Above this many clients the data-space distance uses random Fourier features (O(N·F) memory)
# instead of the exact kernel MMD (B·N·S² kernel entries per block of B rows).
MMD_EXACT_MAX_CLIENTS = 1000
RFF_FEATURES = 512


class State(NamedTuple):
    """FedPC's state: server-side x, W, Ω and the graph, per-client personal parts z."""

    x: Params                  # shared component x (None on personal leaves)          leaves [...]
    z: Params                  # personal components z^(n) (None on shared leaves)    leaves [N, ...]
    w: jax.Array               # ADMM split variable W ≈ ZQ, one row per edge         [M, d2]
    omega: jax.Array           # ADMM multiplier Ω                                    [M, d2]
    graph: graph_ops.Graph     # kNN edges, senders < receivers                       [M] int32 each
    same_labels: jax.Array     # fraction of edges joining identical label sets       shape=()
    round: jax.Array           # rounds completed; shape=(), int32
    CLIENT_FIELDS = ("z",)  # per-client rows [N, ...]


def accumulate_gradients() -> optax.GradientTransformation:
    """Passes the gradient through unchanged and keeps the running sum Σ_k g_k in its state."""

    def update(updates, state, params=None):
        del params
        return updates, jax.tree.map(jnp.add, state, updates)

    return optax.GradientTransformation(lambda params: jax.tree.map(jnp.zeros_like, params), update)


def fedpc(
    model: Model,
    config: EngineConfig,
    *,
    personal: str,
    lam: float,
    p: str,
    k: int,
    graph: str,
    graph_samples: int,
    projection_dim: int,
    cov_metric: str,
    model_metric: str,
    warmup_epochs: int,
    rho: float | None,
    admm_iters: int,
    admm_start: str,
    eta: float | None,
    eta_decay: str,
    eta_personal: float | None,
    shared_mean: str,
    gamma: float,
    rho_c: float | None,
    compress_iters: int,
    solver: str,
) -> Algorithm:
    """FedPC; see the module docstring for the round and the readings."""
    if config.momentum_buffer == "persist" and config.momentum > 0:
        raise ValueError("fedpc sums each round's fresh minibatch gradients: --momentum-buffer "
                         "persist is not supported")
    lr = config.lr
    eta = lr if eta is None else eta
    engine = Engine(model, config, optimizer=optax.chain(
        accumulate_gradients(), optax.sgd(lr, momentum=config.momentum or None)))
    template = jax.eval_shape(model.init, jax.random.key(0))
    mask = split_lib.personal_mask(template, personal)                 # fails early on a bad regex
    _, personal_template = split_lib.split(template, mask)
    d = split_lib.count(template)
    d2 = split_lib.count(personal_template)
    warmup = LocalTrainer(model, optax.sgd(lr), epochs=warmup_epochs,
                          batch_size=config.batch_size, mapper=engine.evaluator.mapper,
                          drop_last=config.drop_last)

    def step_sizes(t: jax.Array, num_clients: int):
        """(η_t, η_z, ρ, ρ_c) for the round after t completed rounds, as scalar arrays (float32;
        float64 under x64)."""
        dtype = jax.dtypes.canonicalize_dtype(jnp.float64)
        f32 = lambda v: jnp.asarray(v, dtype)
        decay = f32(1.0) if eta_decay == "constant" else jax.lax.rsqrt(t.astype(dtype) + 1.0)
        eta_t = f32(eta) * decay
        eta_z = f32(num_clients * eta if eta_personal is None else eta_personal) * decay
        rho_t = 1.0 / eta_z if rho is None else f32(rho)
        if gamma > 0:
            rho_c_t = 1.0 / (eta_t * gamma) if rho_c is None else f32(rho_c)
        else:
            rho_c_t = f32(1.0)
        return eta_t, eta_z, rho_t, rho_c_t

    def replicated(tree):
        """`tree` held whole on every device of the engine's client mesh (no-op on one device).

        The mapped clients' outputs are split across devices; without this constraint XLA's
        partitioner splits the server's ADMM loop too and synchronises the devices at every
        iteration (about 20× slower per round on two CPU devices)."""
        mesh = engine.mapper.mesh
        if mesh is None:
            return tree
        return jax.lax.with_sharding_constraint(tree, core.replicated_sharding(mesh))

    def compress_one(eta_t, rho_c_t, grad):                             # Algorithm 3, one client
        return difference.compress_gradient(grad, eta=eta_t, gamma=gamma, rho_c=rho_c_t,
                                            iters=compress_iters)

    def build_graph(key: jax.Array, data, params0: Params) -> graph_ops.Graph:   # #graph
        n = data.num_clients
        if graph == "model":
            keys = client_keys(key, jnp.arange(n))
            start = core.broadcast(params0, n)
            opt = core.broadcast(warmup.init_opt_state(params0), n)
            warm = warmup(data, start, opt, data.clients, keys).params
            emb = graph_ops.model_embedding(warm, params0)
            rows = graph_ops.cosine_rows(emb) if model_metric == "cosine" else graph_ops.euclidean_rows(emb)
            return graph_ops.knn_graph(rows, k, num_nodes=n)
        samples, counts = client_subsamples(key, data, graph_samples)
        if graph == "feature":
            proj = graph_ops.random_projection(jax.random.fold_in(key, 1), samples.shape[-1],
                                               projection_dim, samples.dtype)
            emb = graph_ops.covariance_embedding(samples, counts, proj, metric=cov_metric)
            return graph_ops.knn_graph(graph_ops.euclidean_rows(emb), k, num_nodes=n)
        valid = np.asarray(jnp.arange(samples.shape[1])[None, :] < counts[:, None]).reshape(-1)
        pool = samples.reshape(-1, samples.shape[-1])[np.flatnonzero(valid)]
        bandwidth = graph_ops.median_heuristic(pool, key=jax.random.fold_in(key, 2))
        bandwidth = jnp.where(bandwidth > 0, bandwidth, 1.0)
        if n <= MMD_EXACT_MAX_CLIENTS:
            rows = graph_ops.mmd_rows(samples, counts, bandwidth)
            return graph_ops.knn_graph(rows, k, num_nodes=n,
                                       block_size=graph_ops.mmd_block_size(n, samples.shape[1]))
        emb = graph_ops.rff_mean_embedding(samples, counts, jax.random.fold_in(key, 3),
                                           num_features=RFF_FEATURES, bandwidth=bandwidth)
        return graph_ops.knn_graph(graph_ops.euclidean_rows(emb), k, num_nodes=n)

    def init(key: jax.Array, data) -> State:
        params0 = model.init(key)                 # the same initial model as every algorithm
        n = data.num_clients
        x, z0 = split_lib.split(params0, mask)
        if d2 > 0 and lam > 0:      # over the real clients; padding clients stay isolated nodes
            real = dataclasses.replace(
                data, clients=jax.tree.map(lambda a: a[:data.num_real_clients], data.clients),
                real_clients=None)
            edges = build_graph(jax.random.fold_in(key, 7), real, params0)
        else:   # no personal part or λ = 0: the graph plays no role and is not built
            edges = graph_ops.Graph(jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.int32))
        present = label_counts(data, "train") > 0
        s, r = np.asarray(edges.senders), np.asarray(edges.receivers)
        same = float(np.mean(np.all(present[s] == present[r], axis=1))) if s.size else float("nan")
        w, omega = (jnp.zeros((edges.num_edges, d2), jnp.zeros(()).dtype) for _ in range(2))
        return State(x, core.broadcast(z0, n), w, omega, edges, jnp.asarray(same, jnp.float32),
                     jnp.zeros((), jnp.int32))

    def round_fn(state: State, data, key: jax.Array) -> tuple[State, dict]:
        chex.assert_tree_shape_prefix(state.z, (data.num_clients,))   # every personal leaf is [N, ...]
        n = data.num_real_clients      # the objective's 1/N (padding clients of a sharded run excluded)
        rnd = engine.begin(data, key)                                                # S_t
        idx, s = rnd.idx, rnd.m
        eta_t, eta_z, rho_t, rho_c_t = step_sizes(state.round, n)
        y = split_lib.merge(core.broadcast(state.x, s), core.gather(state.z, idx), mask)   # step 1
        trained = engine.train(rnd, y)                                               # step 2
        grads = trained.opt_state[0]                                                 # Σ_k g_k
        metrics = {}
        if gamma > 0:                                                                # Alg. 3
            packed = engine.mapper(compress_one, grads, shared=(eta_t, rho_c_t))
            grads, bits = packed.grad, packed.bits
            metrics["distinct_values"] = jnp.mean(packed.distinct.astype(jnp.float32))
        else:
            bits = jnp.full((s,), 32.0 * d)
        grads = replicated(grads)       # the server's step below runs whole on every device
        g_x, g_z = split_lib.split(grads, mask)
        if shared_mean == "sampled":
            mean_gx = core.mean_over_clients(g_x)
        else:
            mean_gx = jax.tree.map(lambda g: jnp.sum(g, axis=0) / n, g_x)
        x = jax.tree.map(lambda xi, gi: (xi - eta_t * gi).astype(xi.dtype), state.x, mean_gx)  # step 3
        z, w, omega = state.z, state.w, state.omega
        if d2 > 0:                                                                   # step 4
            # z is sharded by client: gather it; rows stored in bfloat16 (--state-dtype) are
            # computed in float32, as core.gather hands them out.
            z_t = replicated(split_lib.flatten_rows(state.z)).astype(jnp.result_type(float))
            g_rows = jnp.zeros_like(z_t).at[idx].set(split_lib.flatten_rows(g_z).astype(z_t.dtype))
            linear = g_rows / n                                                      # NᵀG_t / N
            if lam == 0:
                z_new = z_t - eta_z * linear
            else:
                w0, omega0 = (w, omega) if admm_start == "warm" else (jnp.zeros_like(w),
                                                                        jnp.zeros_like(omega))
                res = graph_ops.graph_prox_admm(z_t, linear, w0, omega0, state.graph, eta=eta_z,
                                                lam=lam, rho=rho_t, p=p, iters=admm_iters,
                                                method=solver)
                z_new, w, omega = res.z, res.w, res.omega
                metrics.update(admm_primal=res.primal, admm_dual=res.dual)
            z = split_lib.unflatten_rows(z_new, state.z)
        metrics.update(engine.metrics(rnd, trained, up=d, down=d, up_bits=jnp.sum(bits),
                                      up_bits_dense=32.0 * d * s))
        metrics.update(bits_per_client=jnp.mean(bits), bits_per_client_dense=jnp.asarray(32.0 * d),
                       eta=jnp.asarray(eta_t, jnp.float32),
                       graph_edges=jnp.asarray(state.graph.num_edges, jnp.float32),
                       graph_mean_degree=jnp.asarray(2.0 * state.graph.num_edges / n, jnp.float32),
                       graph_same_labels=state.same_labels)
        return State(x, z, w, omega, state.graph, state.same_labels, state.round + 1), metrics

    def evaluate(state: State, data, ids=None) -> dict[str, core.ClientEval]:
        ids = evaluated_ids(data, ids)
        y = split_lib.merge(core.broadcast(state.x, ids.shape[0]), core.gather(state.z, ids),
                            mask)                                                         # step 5
        return {"client": engine.evaluator.rows(data, y, ids)}

    return engine.algorithm("fedpc", init, round_fn, evaluate)


@functools.partial(jax.jit, static_argnums=2)
def client_subsamples(key: jax.Array, data, size: int) -> tuple[jax.Array, jax.Array]:
    """([N, S, D] flattened inputs, [N] counts): up to S = `size` training samples per client,
    drawn uniformly without replacement (all of them when n_i ≤ S; the rest is padding)."""
    n = data.num_clients
    counts = jnp.minimum(data.clients.train_count, size)
    keys = client_keys(key, jnp.arange(n))
    positions = jax.vmap(lambda kk, c: epoch_permutation(kk, c, jnp.arange(size)))(
        keys, data.clients.train_count)                  # the first S of a random order
    rows = data.clients.train_start[:, None] + positions
    x = data.inputs(rows)
    return x.reshape(n, size, -1), counts


register(AlgorithmSpec(
    name="fedpc",
    not_private=("its server step updates every client's ADMM variables on the client graph; not "
                 'built yet'),
    factory=fedpc,
    summary="FedPC: shared body by SGD, personal parts fused on a kNN client graph by ADMM",
    hparams=(
        HParam("personal", str, "head",
                    "which parameters are personal z^(n) (the rest is the shared x): 'head' (the "
                    "last dense layer), 'all', 'none', or a regex searched in each leaf path such "
                    "as 'Dense_1/'", check=Check(split_lib.is_pattern, "'head', 'all', 'none' or a regex")),
        HParam("lam", float, 0.05,
                    "λ, weight of the graph penalty Σ_edges ‖z^(i) − z^(j)‖_p (0: no coupling)",
                    check=NON_NEGATIVE, flag="--fedpc-lambda"),
        HParam("p", str, "2", "p of the edge norm ‖·‖_p", choices=("1", "2", "inf")),
        HParam("k", int, 3, "k of the symmetrised kNN similarity graph", check=AT_LEAST_ONE),
        HParam("graph", str, "data",
                    "space of the client distances: 'data' (MMD of input subsamples), 'feature' "
                    "(input covariance on a random projection) or 'model' (parameters after a "
                    "local warm-up)", choices=("data", "feature", "model")),
        HParam("graph_samples", int, 64,
                    "training samples per client used by the data and feature distances",
                    check=AT_LEAST_ONE),
        HParam("projection_dim", int, 16,
                    "feature space: dimension of the fixed random projection of the inputs",
                    check=AT_LEAST_ONE),
        HParam("cov_metric", str, "log_euclidean",
                    "feature space: distance of the covariances C_n, ‖log C_i − log C_j‖_F "
                    "('log_euclidean', robust to the scale of the sampling noise) or ‖C_i − C_j‖_F",
                    choices=("log_euclidean", "frobenius")),
        HParam("model_metric", str, "cosine",
                    "model space: distance of the warm-up displacements θ_n − θ_0",
                    choices=("cosine", "euclidean")),
        HParam("warmup_epochs", int, 1,
                    "model space: local epochs of SGD (--lr) from θ_0 before measuring distances",
                    check=AT_LEAST_ONE),
        HParam("rho", float, None,
                    "ρ, ADMM penalty of the Z-subproblem (default 1/η_z: the system is I + L)",
                    check=POSITIVE),
        HParam("admm_iters", int, 10, "K, ADMM iterations per round", check=AT_LEAST_ONE),
        HParam("admm_start", str, "warm",
                    "W and Ω at the start of a round's ADMM: 'warm' (last round's) or 'cold' (0)",
                    choices=("warm", "cold")),
        HParam("eta", float, None, "η, the server step size of x and of Z (default: --lr)",
                    check=POSITIVE),
        HParam("eta_decay", str, "constant",
                    "η_t schedule: 'constant' or 'inv_sqrt' (η/√t in round t)",
                    choices=("constant", "inv_sqrt")),
        HParam("eta_personal", float, None,
                    "η_z, the proximal step of the Z-subproblem (default N·η: with λ = 0 a round "
                    "moves z^(n) by η∇f_n; the draft's literal value is η)", check=POSITIVE),
        HParam("shared_mean", str, "sampled",
                    "shared step under partial participation: mean over the 'sampled' clients "
                    "(unbiased) or Σ over them / N ('all', zero rows for the others)",
                    choices=("sampled", "all")),
        HParam("gamma", float, 0.0,
                    "γ, weight of the communication-efficient regulariser γ‖Λ(y − x_t)‖₁ "
                    "(0: send the plain gradient)", check=NON_NEGATIVE),
        HParam("rho_c", float, None,
                    "ρ_c, ADMM penalty of the compression (default 1/(η_t γ): c = ρ_c η_t γ = 1)",
                    check=POSITIVE),
        HParam("compress_iters", int, 50, "J, ADMM iterations of the compression",
                    check=AT_LEAST_ONE),
        HParam("solver", str, "auto",
                    "Z-system solver: 'cholesky' (dense factor, reused by the K iterations), 'cg' "
                    "(matrix-free, sparse Laplacian) or 'auto' (Cholesky up to 1024 clients)",
                    choices=("auto", "cholesky", "cg")),
    ),
    # Defaults (tuned on the embedded digits, 20 clients, Dir(0.5), 50 rounds: 96.5 % mean
    # personalised accuracy; docs/results/fedpc.md): every client takes part, as in the draft's
    # Algorithm 5, and sends the sum of 10 local minibatch gradients (lr 0.1, B = 10); η = lr.
    defaults={"participation": 1.0, "local_steps": 10, "lr": 0.1},
    traceable=(),
    test_hparams={"local_steps": 1},
))
