"""FedDWA (Liu, Wu, Chen, Hu, Zhou & Wu, "FedDWA: Personalized Federated Learning with Dynamic
Weight Adjustment", IJCAI 2023, arXiv:2305.06124); docs/algorithms/feddwa.md
(readings R1–R8 cited below). Where the paper leaves a point open we read the authors' code
(github.com/Sherrylife/FedDWA, `clients/clientFedDWA.py`, `servers/serverFedDWA.py`).

Each client i keeps a personalised model w̃_i. Per round, over the sampled S (|S| = M):

  w_i  ← local training of F_i from w̃_i             (the engine's E epochs or K steps)    (R1)
  ŵ_i  ← one more pass of local training from w_i   the guidance model; default the same
                                                    schedule again (authors' code), or
                                                    --feddwa-guidance-steps/-epochs       (R2)
  both uploaded; the server, for each i ∈ S, over j ∈ S:
  D_ij = ‖ŵ_i − w_j‖²                               one Gram matrix of [w − w̄; ŵ − w]     (R3)
  p_ij ∝ D_ij^{-1}, kept for the K smallest D_ij of row i, normalised     (R4, R5; the paper's
                                    closed-form weights, as the authors' cal_optimal_weight)
  w̃_i ← Σ_{j∈S} p_ij w_j                           W̃ = P W, one matmul per leaf          (R6)
  unsampled clients keep w̃_i (and their optimizer rows)                                  (R7)

Evaluated: each client's w̃_i ("client"; the shared initial model for clients never sampled)
(R8). Communication: w_i and ŵ_i up (2d floats), w̃_i down (d floats) per sampled client.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_pfl import core, ops
from fedjax_pfl.algorithms.engine import Engine, EngineConfig, first_row
from fedjax_pfl.algorithms.interface import Algorithm
from fedjax_pfl.algorithms.registry import AT_LEAST_ONE, AlgorithmSpec, HParam, register
from fedjax_pfl.models.model import Model
from fedjax_pfl.ops import attention_mix

Params = Any


class State(NamedTuple):
    params: Params      # personalised models w̃_i                                leaves [N, ...]
    opt_state: Any      # per-client optimizer states (momentum_buffer=persist) [N, ...], else None
    round: jax.Array    # rounds completed; shape=(), int32
    CLIENT_FIELDS = ("params", "opt_state")  # per-client rows [N, ...]


def guidance_sq_distances(guides: Params, rows: Params) -> jax.Array:
    """D ∈ R^{M×M}, D_ij = ‖ŵ_i − w_j‖² over all leaves together (R3).

    With v_i = w_i − w̄ (w̄ the mean row) and δ_i = ŵ_i − w_i (the guidance step, formed directly),
    ŵ_i − w_j = (v_i − v_j) + δ_i, so

        D_ij = G_ii + G_jj − 2G_ij + 2(C_ii − C_ij) + H_ii,
        G = VVᵀ, C = ΔVᵀ, H = ΔΔᵀ,

    the blocks of one Gram matrix of the stacked [V; Δ] ([2M, d_leaf] per leaf, accumulated over
    leaves). The self distance D_ii = H_ii = ‖δ_i‖² is then exact (the other terms cancel
    exactly), where the plain ‖ŵ_i‖² + ‖w_i‖² − 2⟨ŵ_i, w_i⟩ would lose the digits of the small
    guidance step in float32; and v removes the part common to all models. Clipped at 0;
    at least float32. Costs O(M²d); nothing [M, M, d].

    Args:
      guides: the guidance models ŵ_i, leaves [M, ...].
      rows: the trained models w_j, leaves [M, ...] (the same structure).
    Returns:
      [M, M], row i the distances from client i's guidance model to every trained model.
    """
    dtype = jnp.promote_types(jnp.result_type(*jax.tree.leaves(rows)), jnp.float32)
    w_leaves, g_leaves = jax.tree.leaves(rows), jax.tree.leaves(guides)
    m = w_leaves[0].shape[0]
    gram = jnp.zeros((2 * m, 2 * m), dtype)
    for w, g in zip(w_leaves, g_leaves, strict=True):
        w = w.reshape(m, -1).astype(dtype)
        delta = g.reshape(m, -1).astype(dtype) - w
        z = jnp.concatenate([w - jnp.mean(w, axis=0, keepdims=True), delta])   # [V; Δ]
        gram = gram + z @ z.T
    g_vv, c_dv, h_dd = gram[:m, :m], gram[m:, :m], gram[m:, m:]
    sq_v, c_self = jnp.diag(g_vv), jnp.diag(c_dv)
    dist = (sq_v[:, None] + sq_v[None, :] - 2.0 * g_vv
            + 2.0 * (c_self[:, None] - c_dv) + jnp.diag(h_dd)[:, None])
    return jnp.maximum(dist, 0.0)


def dwa_weights(sq_dist: jax.Array, topk: int) -> jax.Array:
    """P ∈ R^{M×M}, row i client i's weights over the M trained models (R4, R5):

        p_ij = D_ij^{-1} 1[j ∈ T_i] / Σ_{k∈T_i} D_ik^{-1},   T_i the K = min(topk, M) indices
                                                            of the smallest D_ij in row i

    (the authors normalise, keep the top K, and normalise again: the same, since a positive
    factor per row changes neither the order nor the final ratios). Computed as
    r_ij = D_i,min / D_ij ∈ [0, 1] (1 at the row minimum), which is exact for any scale of D and
    gives the limit where some D_ij = 0: the weight goes to the zero-distance models only, equally
    (then fewer than K weights are non-zero). Ties at the K-th place keep the lower row index
    (`lax.top_k`; the authors' `np.argpartition` leaves it unspecified).

    Args:
      sq_dist: [M, M] `guidance_sq_distances`.
      topk: K ≥ 1 neighbours kept per row (the client itself counts if it is among them).
    Returns:
      [M, M], non-negative, every row summing to 1, at most K non-zero per row.
    """
    m = sq_dist.shape[0]
    k = min(topk, m)
    d_min = jnp.min(sq_dist, axis=1, keepdims=True)
    at_min = sq_dist <= d_min
    ratio = jnp.where(at_min, 1.0, d_min / jnp.where(at_min, 1.0, sq_dist))   # ∝ 1/D_ij
    _, top = jax.lax.top_k(ratio, k)                                          # ties: lower index
    keep = jnp.zeros((m, m), bool).at[jnp.arange(m)[:, None], top].set(True)
    kept = jnp.where(keep, ratio, 0.0)
    return kept / jnp.sum(kept, axis=1, keepdims=True)


def weight_statistics(p: jax.Array, sq_dist: jax.Array) -> dict[str, jax.Array]:
    """The round's weights P [M, M] summarised as PGFed summarises its α: the self weights p_ii
    (mean, min), each row's largest weight (mean), the weights on other clients p_ij, j ≠ i
    (mean, max; 0 with M = 1), the non-zero weights per row (mean; K unless distances vanish),
    the guidance steps ‖ŵ_i − w_i‖² = D_ii (mean) and the other distances D_ij, j ≠ i (mean)."""
    m = p.shape[0]
    off = ~jnp.eye(m, dtype=bool)
    pairs = max(m * (m - 1), 1)
    return {
        "p_self_mean": jnp.mean(jnp.diag(p)), "p_self_min": jnp.min(jnp.diag(p)),
        "p_max_mean": jnp.mean(jnp.max(p, axis=1)),
        "p_other_mean": jnp.sum(jnp.where(off, p, 0.0)) / pairs,
        "p_other_max": jnp.max(jnp.where(off, p, -jnp.inf)) if m > 1 else jnp.zeros((), p.dtype),
        "p_nonzero_mean": jnp.mean(jnp.sum(p > 0, axis=1).astype(p.dtype)),
        "guide_sq_dist_mean": jnp.mean(jnp.diag(sq_dist)),
        "sq_dist_mean": jnp.sum(jnp.where(off, sq_dist, 0.0)) / pairs,
    }


def feddwa(model: Model, config: EngineConfig, *, topk: int,
           guidance_epochs: int | None = None, guidance_steps: int | None = None
           ) -> Algorithm:
    """FedDWA; see the module docstring."""
    engine = Engine(model, config)                                       # w_i
    if guidance_steps is not None:                                            # R2
        guide_config = dataclasses.replace(config, local_steps=guidance_steps)
    elif guidance_epochs is not None:
        guide_config = dataclasses.replace(config, local_epochs=guidance_epochs, local_steps=None)
    else:
        guide_config = config
    guidance = Engine(model, guide_config)                               # ŵ_i

    def init(key: jax.Array, data) -> State:
        params = model.init(key)
        n = data.num_clients
        return State(core.broadcast(params, n), engine.init_opt_rows(params, n),
                     jnp.zeros((), jnp.int32))

    def round_fn(state: State, data, key: jax.Array) -> tuple[State, dict]:
        rnd = engine.begin(data, key)                                              # S
        start = core.gather(state.params, rnd.idx)                                 # w̃_i
        trained = engine.train(rnd, start, opt_rows=state.opt_state)               # w_i (R1)
        # ŵ_i continues the same optimizer run (its momentum buffer) one pass further, with its
        # own batch order; it is only uploaded: the client keeps w_i's optimizer state (R2).
        guide = guidance.train(rnd, trained.params, opt_state=trained.opt_state,
                               key=jax.random.fold_in(rnd.keys["train"], 1))
        sq_dist = guidance_sq_distances(guide.params, trained.params)             # D (R3)
        p = dwa_weights(sq_dist, topk)                                             # P (R4, R5)
        mixed = attention_mix.mix_rows(p, trained.params)                          # P W (R6)
        new_state = State(core.scatter(state.params, rnd.idx, mixed), trained.opt_rows,
                          state.round + 1)
        d = ops.tree_size(first_row(start))
        metrics = engine.metrics(rnd, trained, up=2 * d, down=d)
        metrics["client_steps"] = metrics["client_steps"] + jnp.sum(guide.num_steps)
        metrics.update(weight_statistics(p, sq_dist))
        return new_state, metrics

    evaluate, parts = engine.evaluation(personal=lambda state: state.params)       # R8
    return engine.algorithm("feddwa", init, round_fn, evaluate, parts)


register(AlgorithmSpec(
    name="feddwa", factory=feddwa,
    not_private=("a pairwise server mixture: one client's upload reaches every other client's "
                 "personalised model through its own weight, which the sum's noise does not bound"),
    summary="FedDWA: per-client mixtures Σ_j p_ij w_j of the sampled clients' trained models, "
            "p_ij ∝ ‖ŵ_i − w_j‖^{-2} over the top-K, ŵ_i a guidance model one more local pass "
            "ahead; personalised models evaluated",
    hparams=(
        HParam("topk", int, 5,
                    "K, the neighbours each client's mixture keeps: the K trained models "
                    "closest to its guidance model (itself included when among them), weighted "
                    "∝ ‖ŵ_i − w_j‖^{-2} and normalised; capped at the clients per round "
                    "(default 5, the paper's and the authors' scripts')",
                    check=AT_LEAST_ONE),
        HParam("guidance_epochs", int, None,
                    "epochs of the guidance pass ŵ_i from the trained w_i; unset: the local "
                    "schedule again (--local-epochs E or --local-steps K), as the authors' code",
                    check=AT_LEAST_ONE),
        HParam("guidance_steps", int, None,
                    "if set: the guidance pass is exactly this many minibatch steps (1: the "
                    "paper's one-step-ahead ŵ_i = w_i − η∇F_i(w_i; B)); overrides "
                    "--feddwa-guidance-epochs",
                    check=AT_LEAST_ONE),
    ),
    # The paper's 20-client settings: every client every round, K = 5 of M = 20 (R8).
    defaults={"participation": 1.0},
    test_hparams={"momentum": 0.5, "momentum_buffer": "persist", "topk": 2},
))
