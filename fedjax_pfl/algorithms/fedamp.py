"""FedAMP (Huang, Chu, Zhou, Wang, Liu, Pei & Zhang, "Personalized Cross-Silo Federated Learning
on Non-IID Data", AAAI 2021, arXiv:2007.03797, Algorithm 1); docs/algorithms/fedamp.md (readings
R1–R9 cited below).

Each client i keeps a personalised model w_i. FedAMP minimises Σ_i F_i(w_i) + λ Σ_{i<j}
A(‖w_i − w_j‖²) with the attention-inducing A(x) = 1 − e^{−x/σ}, alternating a server gradient
step on the attention term and a proximal client step on F. Per round, over the sampled S (|S| = M):

  D_ij = ‖w_i − w_j‖²                          one Gram matrix of the stacked rows    (R3)
  ξ_ij = α A'(D_ij) = α e^{−D_ij/σ}/σ (j ≠ i),  ξ_ii = 1 − Σ_{j≠i} ξ_ij               (R1, R2)
  u_i  = Σ_{j∈S} ξ_ij w_j                      U = Ξ W, one matmul                    (R4)
  each i ∈ S starts from u_i and runs the engine's local SGD on
      F_i(w) + (λ/(2α))‖w − u_i‖²              gradient ∇F_i(w; B) + (λ/α)(w − u_i)   (R5, R6)
  w_i ← the result; unsampled clients keep w_i (and their optimizer rows)            (R7)

--fedamp-self-weight s replaces ξ by the normalised form ξ_ij = (1 − s) softmax_{j≠i}(−D_ij/σ),
ξ_ii = s (R2). --fedamp-start own starts local training from w_i instead of u_i (R5).
Evaluated: each client's w_i ("client"; the shared initial model for clients never sampled).
Communication: u_i down and w_i up, d floats each per sampled client (FedAvg's).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_pfl import core, ops
from fedjax_pfl.algorithms import _prox
from fedjax_pfl.algorithms.engine import Engine, EngineConfig, first_row, require_choices
from fedjax_pfl.algorithms.interface import Algorithm
from fedjax_pfl.algorithms.registry import NON_NEGATIVE, POSITIVE, UNIT_CLOSED, AlgorithmSpec, HParam, register
from fedjax_pfl.models.model import Model
from fedjax_pfl.ops import attention_mix

Params = Any


class State(NamedTuple):
    params: Params      # personalised models w_i                                 leaves [N, ...]
    opt_state: Any      # per-client optimizer states (momentum_buffer=persist) [N, ...], else None
    round: jax.Array    # rounds completed; shape=(), int32
    CLIENT_FIELDS = ("params", "opt_state")  # per-client rows [N, ...]


def mixing_statistics(xi: jax.Array, sq_dist: jax.Array) -> dict[str, jax.Array]:
    """The round's mixing weights Ξ [M, M] summarised as PGFed summarises its α: the self weights
    ξ_ii (mean, min), the weights on other clients ξ_ij, j ≠ i (mean, max; 0 with M = 1) and the
    mean squared distance between the sampled models (the scale σ is compared with)."""
    m = xi.shape[0]
    off = ~jnp.eye(m, dtype=bool)
    pairs = max(m * (m - 1), 1)
    return {
        "xi_self_mean": jnp.mean(jnp.diag(xi)), "xi_self_min": jnp.min(jnp.diag(xi)),
        "xi_other_mean": jnp.sum(jnp.where(off, xi, 0.0)) / pairs,
        "xi_other_max": jnp.max(jnp.where(off, xi, -jnp.inf)) if m > 1 else jnp.zeros((), xi.dtype),
        "sq_dist_mean": jnp.sum(sq_dist) / pairs,
    }


def fedamp(model: Model, config: EngineConfig, *, alpha: float, sigma: float, lam: float,
           self_weight: float | None = None, start: str = "cloud") -> Algorithm:
    """FedAMP; see the module docstring."""
    require_choices(**{"--fedamp-start": (start, ("cloud", "own"))})
    # (λ/(2α))‖w − u_i‖² joins the chain before sgd(lr, momentum): its gradient (λ/α)(w − u_i)
    # with the anchor u_i passed per client (R6).
    engine = Engine(model, config, client_transform=_prox.add_proximal_term(lam / alpha))

    def init(key: jax.Array, data) -> State:
        params = model.init(key)
        n = data.num_clients
        return State(core.broadcast(params, n), engine.init_opt_rows(params, n),
                     jnp.zeros((), jnp.int32))

    def round_fn(state: State, data, key: jax.Array) -> tuple[State, dict]:
        rnd = engine.begin(data, key)                                                # S
        w = core.gather(state.params, rnd.idx)                                       # w_j, j ∈ S
        sq_dist = attention_mix.pairwise_sq_distances(w)                             # D (Gram)
        xi = attention_mix.attention_weights(sq_dist, alpha=alpha, sigma=sigma,
                                             self_weight=self_weight)                # Ξ
        u = attention_mix.mix_rows(xi, w)                                            # U = Ξ W
        trained = engine.train(rnd, u if start == "cloud" else w, opt_rows=state.opt_state,
                               extra={"anchor": u})                 # min F_i + (λ/2α)‖w − u_i‖²
        new_state = State(core.scatter(state.params, rnd.idx, trained.params), trained.opt_rows,
                          state.round + 1)
        d = ops.tree_size(first_row(w))
        metrics = engine.metrics(rnd, trained, up=d, down=d)
        metrics.update(mixing_statistics(xi, sq_dist))
        return new_state, metrics

    evaluate, parts = engine.evaluation(personal=lambda state: state.params)
    return engine.algorithm("fedamp", init, round_fn, evaluate, parts)


register(AlgorithmSpec(
    name="fedamp", factory=fedamp,
    not_private=("a pairwise server mixture: one client's upload reaches every other client's "
                 "personalised model through its own weight, which the sum's noise does not bound"),
    summary="FedAMP: per-client cloud models mixed by attention e^{−‖w_i − w_j‖²/σ}, local "
            "training pulled towards them by (λ/2α)‖w − u_i‖²; personalised models evaluated",
    hparams=(
        HParam("alpha", float, 0.05,
                    "α (the paper's α_k, constant), the server step: "
                    "ξ_ij = α e^{−‖w_i − w_j‖²/σ}/σ for j ≠ i and ξ_ii = 1 − Σ_{j≠i} ξ_ij; "
                    "all weights are ≥ 0 when α ≤ σ/(M−1) "
                    "(default 0.05 with σ = 1: M ≤ 21; equal models are then mixed about "
                    "uniformly at M = 20). Also divides the prox weight: λ/α",
                    check=POSITIVE),
        HParam("sigma", float, 1.0,
                    "σ, length scale of the attention A(x) = 1 − e^{−x/σ} in squared-distance "
                    "units: clients farther apart than a few σ in ‖w_i − w_j‖² barely mix "
                    "(the metric sq_dist_mean shows the scale)",
                    check=POSITIVE),
        HParam("lam", float, 0.005,
                    "λ, weight of the attention term; local training adds (λ/(2α))‖w − u_i‖², "
                    "so λ/α is the proximal weight (default 0.1 = 0.005/0.05; λ = 0: plain local "
                    "SGD from u_i)",
                    check=NON_NEGATIVE),
        HParam("self_weight", float, None,
                    "if set, s: normalised weights with a fixed self weight, as the paper's "
                    "HeurFedAMP (§5) but on the distance kernel: ξ_ii = s and ξ_ij = (1 − s)·"
                    "softmax_{j≠i}(−‖w_i − w_j‖²/σ); unset: the paper's ξ (α enters the mixture)",
                    check=UNIT_CLOSED),
        HParam("start", str, "cloud",
                    "where each sampled client's local training starts: 'cloud' (its cloud model "
                    "u_i, the centre of the proximal step) or 'own' (its previous w_i, as PFLlib)",
                    choices=("cloud", "own")),
    ),
    # Cross-silo: every client takes part in every round (Algorithm 1 of the paper, R8).
    defaults={"participation": 1.0},
    traceable=("lr", "alpha", "sigma", "lam"),
    test_hparams={"momentum": 0.5, "momentum_buffer": "persist"},
))
