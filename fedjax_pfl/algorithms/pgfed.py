"""PGFed, PGFedMo and PGFed-CE (Luo et al., ICCV 2023, arXiv:2212.01448);
docs/algorithms/pgfed.md (readings A1–A21 cited below).

The round is the vectorised statement of the authors' code (#round) of the paper's Algorithm 1
(server lines S1–S14, client lines C1–C11). With S = S_t, P = S_{t−1} (both of size M),
G ∈ R^{M×d} the full-data gradients G_j = ∇f_j(θ_j) of P's clients at their final models,
b_j = μ(L_j − G_j·θ_j) (the first term g_α^(1) of eq. 11, Alg. 1 C10) and
ḡ = (μ/M) Σ_{j∈P} G_j (eq. 14, Alg. 1 S10):

  C = μ · A[S, P] @ G                          c_i = μ Σ_{j∈P} α_ij G_j   (eq. 13, one matmul)
  h_i ← c_i the first time, else (1−β) c_i + β h_i                      (PGFedMo eq. 15, A6)
  each i ∈ S starts from θ_g and for k = 1 … E·⌊n_i/B⌋:
      s = ḡ·θ_i                                θ_i BEFORE this step    (eq. 12, A5)
      A[i, P] ← max(0, A[i, P] − η₂ (b + s))                            (eq. 11, A2, A4)
      buf ← 0.9 buf + ∇ℓ_B(θ_i) + h_i;  θ_i ← θ_i − η₁ buf             (eq. 10, A8)
  L_i, G_i ← mean loss and gradient over ALL of i's training samples at the final θ_i
                                                                        (Alg. 1 C10, A10)
  θ_g ← Σ_{i∈S} (n_i / Σ_S n) θ_i;  ḡ ← (μ/M) Σ_{i∈S} G_i     (Alg. 1 S13, eq. 14; A11, A12)

Round 1 is FedAvg local training (no auxiliary gradient, no α update). A starts at 1/M with
M = floor(N·rate) (A3). Unsampled clients keep θ_i, h_i, their α row and optimizer state (A14).
PGFed is β = 0; PGFed-CE (Appendix D, A20) replaces s by the per-j constant μ G_j·θ_g.
The personalised θ_i of every client is evaluated (stale for unsampled clients), and the
global model as "global".
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_pfl import core, ops
from fedjax_pfl.algorithms.engine import Engine, EngineConfig
from fedjax_pfl.algorithms.interface import Algorithm
from fedjax_pfl.algorithms.registry import NON_NEGATIVE, UNIT_CLOSED, AlgorithmSpec, HParam, register
from fedjax_pfl.core.local import FullPass, add_aux_gradient
from fedjax_pfl.models.model import Model

Params = Any


class ClientState(NamedTuple):
    """Per-client state; every leaf has leading axis N."""

    theta: Params       # personalised model θ_i                              leaves [N, ...]
    opt_state: Any      # optimizer state (momentum buffer) when it persists, else None
    aux: Params         # held auxiliary gradient h_i (g̃^i), zero until set   leaves [N, ...]
    aux_set: jax.Array  # whether h_i was ever set                            [N] bool
    CLIENT_FIELDS = ("theta", "opt_state", "aux", "aux_set")  # per-client rows [N, ...]


class State(NamedTuple):
    clients: ClientState
    alpha: jax.Array          # A, the N×N coefficient matrix                 [N, N]
    alpha_row_sum: jax.Array  # Σ_j A[i, j] per row (for the α statistics)     [N]
    alpha_zeros: jax.Array    # number of zero entries of A; shape=(), int32
    prev_idx: jax.Array       # S_{t−1}                                        [M] int32
    prev_grads: Params        # G_j for j ∈ S_{t−1}                            leaves [M, ...]
    prev_b: jax.Array         # b_j = μ(L_j − G_j·θ_j)                          [M]
    gbar: Params              # ḡ = (μ/M) Σ_{j∈S_{t−1}} G_j                    leaves [...]
    has_prev: jax.Array       # False in round 1 (nothing uploaded yet); shape=(), bool
    global_params: Params     # θ_g                                            leaves [...]
    server: Any               # the server chain's state (Engine.init_server)
    round: jax.Array          # rounds completed; shape=(), int32
    CLIENT_FIELDS = ("clients", "alpha", "alpha_row_sum")  # per-client rows [N, ...]
    # Kept on the devices under --state-placement host: the α statistics read every row sum.
    DEVICE_CLIENT_FIELDS = ("alpha_row_sum",)


def pgfed(
    model: Model,
    config: EngineConfig,
    *,
    mu: float,
    alpha_lr: float,
    beta: float = 0.0,
    first_aux: str = "copy",
    constant_alpha_grad: bool = False,
) -> Algorithm:
    """PGFed (β = 0), PGFedMo (β > 0) or PGFed-CE (constant_alpha_grad); see the module docstring."""

    def update_alpha_row(alpha_row: jax.Array, params: Params, extra: dict) -> jax.Array:
        """One minibatch's projected step on α_i over P (eq. 11 with the eq. 12 surrogate)."""
        if constant_alpha_grad:
            grad = extra["alpha_grad"]                                   # PGFed-CE: per-j constant
        else:
            grad = extra["b"] + ops.tree_vdot(extra["gbar"], params)     # b_j + ḡ·θ_i, θ_i pre-step
        stepped = jnp.maximum(alpha_row - alpha_lr * grad, 0.0)
        return jnp.where(extra["update_alpha"], stepped, alpha_row)

    engine = Engine(model, config, client_transform=add_aux_gradient(),
                         on_step=update_alpha_row)
    # --eval-batch-size (0: automatic, 256 for the MLPs of docs/results/, 8 for the CNN) also
    # batches the full-data pass; G_i depends on it only by float rounding of the sums.
    full_pass = FullPass(model, batch_size=config.eval_batch_size, mapper=engine.mapper)

    def init(key: jax.Array, data) -> State:
        params = model.init(key)
        n, m = data.num_clients, engine.num_sampled(data)
        zeros = ops.tree_zeros_like(params)
        clients = ClientState(core.broadcast(params, n), engine.init_opt_rows(params, n),
                              core.broadcast(zeros, n), jnp.zeros(n, bool))
        real = data.num_real_clients     # padding clients (sharded runs) stay out of the statistics
        return State(clients, jnp.full((n, n), 1.0 / m), jnp.full(n, real / m),
                     jnp.zeros((), jnp.int32), jnp.arange(m, dtype=jnp.int32),
                     core.broadcast(zeros, m), jnp.zeros(m), zeros, jnp.zeros((), bool), params,
                     engine.init_server(params, data), jnp.zeros((), jnp.int32))

    def round_fn(state: State, data, key: jax.Array) -> tuple[State, dict]:
        rnd = engine.begin(data, key)                                                # S_t
        idx, m = rnd.idx, rnd.m
        c = core.gather(state.clients, idx)
        # A[S, P] at least float32 whatever the storage (--state-dtype): the α steps accumulate
        # in it, and bfloat16 would round them away.
        alpha_rows = core.gather(state.alpha, idx)                                    # A[S, :]
        alpha_sp = alpha_rows[:, state.prev_idx]                                        # A[S, P]
        alpha_sp = alpha_sp.astype(jnp.promote_types(alpha_sp.dtype, jnp.float32))
        downloaded = jax.tree.map(lambda g: mu * jnp.tensordot(alpha_sp, g, axes=1),
                                  state.prev_grads)                                  # C = μ A G
        if first_aux == "copy":
            first = downloaded                                                       # A6: copy
        else:
            first = ops.tree_scale(1.0 - beta, downloaded)                           # zero init
        blended = ops.tree_lerp(downloaded, c.aux, beta)                             # eq. 15
        aux = core.where_clients(c.aux_set, blended, first)
        aux = core.where_clients(state.has_prev, aux, c.aux)                          # round 1
        has_prev = jnp.broadcast_to(state.has_prev, (m,))
        extra = {"aux_grad": aux, "update_alpha": has_prev}
        if constant_alpha_grad:   # α gradient μ(L_j + G_j·(θ_g − θ_j)) = b_j + μ G_j·θ_g (A20)
            g_dot_global = jax.vmap(ops.tree_vdot, (0, None))(state.prev_grads, state.global_params)
            extra["alpha_grad"] = core.broadcast(state.prev_b + mu * g_dot_global, m)
        else:
            extra.update(b=core.broadcast(state.prev_b, m), gbar=core.broadcast(state.gbar, m))
        result = engine.train(rnd, state.global_params, extra=extra, hook_state=alpha_sp,  # θ_i ← θ_g
                              opt_state=c.opt_state if engine.persist_opt_state else None,
                              shared_start=True)
        theta = result.params
        losses, grads = full_pass(data, theta, core.gather(data.clients, idx), ids=idx)       # L_i, G_i
        b = mu * (losses - jax.vmap(ops.tree_vdot)(grads, theta))                     # b_i
        # Rows S of A change, at columns P: read and written as client rows (core.gather /
        # core.scatter), so they may wait off the devices (--state-placement host). The new
        # entries are rounded to A's storage dtype as they would be stored.
        new_rows = alpha_rows.at[:, state.prev_idx].set(
            result.hook_state.astype(state.alpha.dtype).astype(alpha_rows.dtype))
        alpha = core.scatter(state.alpha, idx, new_rows)
        # The α statistics in O(M·N), never an N×N temporary: only rows S changed.
        real = data.num_real_clients
        new_row_sums = jnp.sum(new_rows[:, :real].astype(alpha_sp.dtype), axis=1)
        row_sum = state.alpha_row_sum.at[idx].set(new_row_sums.astype(state.alpha_row_sum.dtype))
        zeros = (state.alpha_zeros + jnp.sum(new_rows[:, state.prev_idx] == 0)
                 - jnp.sum(alpha_rows[:, state.prev_idx] == 0)).astype(jnp.int32)
        rows = ClientState(theta, result.opt_state if engine.persist_opt_state else None, aux,
                           c.aux_set | has_prev)
        clients = core.scatter(state.clients, idx, rows)
        global_params, server, agg = engine.aggregate(rnd, state.global_params, theta,   # θ_g
                                                      rnd.train_counts, state.server)
        gbar = ops.tree_scale(mu / m, core.sum_over_clients(grads))                   # ḡ
        new_state = State(clients, alpha, row_sum, zeros, idx, grads, b, gbar, jnp.ones((), bool),
                          global_params, server, state.round + 1)
        metrics = engine.metrics(rnd, result, server=agg)
        row_means = row_sum[:real] / real
        metrics.update(
            alpha_mean=jnp.sum(row_sum[:real]) / float(real) ** 2, alpha_row_mean_min=row_means.min(),
            alpha_row_mean_max=row_means.max(), alpha_zero_fraction=zeros / float(real) ** 2,
            aux_norm_mean=jnp.mean(jax.vmap(ops.tree_norm)(aux)), gbar_norm=ops.tree_norm(gbar),
            full_loss_mean=jnp.mean(losses),
        )
        return new_state, metrics

    evaluate, parts = engine.evaluation(personal=lambda state: state.clients.theta,
                                        shared=lambda state: state.global_params)
    return engine.algorithm("pgfed", init, round_fn, evaluate, parts, host_state=True)


def pgfed_plain(model: Model, config: EngineConfig, *, mu: float, alpha_lr: float
                ) -> Algorithm:
    return pgfed(model, config, mu=mu, alpha_lr=alpha_lr, beta=0.0)


def pgfed_ce(model: Model, config: EngineConfig, *, mu: float, alpha_lr: float
             ) -> Algorithm:
    return pgfed(model, config, mu=mu, alpha_lr=alpha_lr, beta=0.0, constant_alpha_grad=True)


# The reference code's defaults (docs/algorithms/pgfed.md#a8, #a9, #a16): SGD momentum 0.9 with
# a persistent per-client buffer, lr 0.005, batch 10 with drop_last, 5 local epochs, 25 %
# participation.
_REFERENCE_DEFAULTS = {"lr": 0.005, "momentum": 0.9, "momentum_buffer": "persist", "batch_size": 10,
                       "local_epochs": 5, "participation": 0.25, "drop_last": True}
_MU = HParam("mu", float, 0.1,
                  "μ, weight of the auxiliary risk: F_i = f_i + μ Σ_j α_ij [f_j(θ_j) + ∇f_j(θ_j)ᵀ(θ_i − θ_j)] "
                  "(α is unbounded above: if PGFed diverges, lower μ; see docs/results/pgfed.md)",
                  check=NON_NEGATIVE)
_ALPHA_LR = HParam("alpha_lr", float, 0.01,
                        "η₂, learning rate of the coefficients α_ij (projected at 0 every minibatch)",
                        check=NON_NEGATIVE)

# Why --dp-clip is refused (AlgorithmSpec.not_private).
_NOT_PRIVATE = ("a pairwise server mixture: the server builds each client's aggregate from the "
                "others' α-weighted gradients, and one client's upload reaches every other "
                "client's through its own weight, which the sum's noise does not bound")


register(AlgorithmSpec(
    name="pgfed", factory=pgfed_plain, flag_prefix="pgfed",
    not_private=_NOT_PRIVATE,
    summary="PGFed: local risk plus a first-order estimate of other clients' risks (μ, α_ij)",
    hparams=(_MU, _ALPHA_LR), defaults=_REFERENCE_DEFAULTS, traceable=("lr", "mu", "alpha_lr"),
    test_hparams={},
))
register(AlgorithmSpec(
    name="pgfedmo", factory=pgfed, flag_prefix="pgfed",
    not_private=_NOT_PRIVATE,
    summary="PGFedMo: PGFed with a client-side moving average of the auxiliary gradient (β)",
    hparams=(_MU, _ALPHA_LR,
             HParam("beta", float, 0.5,
                         "β, momentum of the held auxiliary gradient: g̃_i ← (1−β)·download + β·g̃_i",
                         check=UNIT_CLOSED),
             HParam("first_aux", str, "copy",
                         "first download of the auxiliary gradient: 'copy' it (the reference code) "
                         "or blend it with 'zero' ((1−β)·download)", choices=("copy", "zero"))),
    defaults=_REFERENCE_DEFAULTS, traceable=("lr", "mu", "alpha_lr", "beta"),
    test_hparams={},
))
register(AlgorithmSpec(
    name="pgfed_ce", factory=pgfed_ce, flag_prefix="pgfed",
    not_private=_NOT_PRIVATE,
    summary="PGFed-CE: PGFed whose α gradient uses the global model (no ḡ download)",
    hparams=(_MU, _ALPHA_LR), defaults=_REFERENCE_DEFAULTS, traceable=("lr", "mu", "alpha_lr"),
    test_hparams={},
))
