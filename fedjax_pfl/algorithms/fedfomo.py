"""FedFomo (Zhang, Sapra, Fidler, Yeung & Alvarez, "Personalized Federated Learning with First
Order Model Optimization", ICLR 2021, arXiv:2012.08565, Section 3 and Algorithm 1);
docs/algorithms/fedfomo.md (readings F1–F9 cited below).

Each client i keeps a personalised model θ_i and holds out its last v_i = ⌈f·n_i⌉ training
samples as a validation split D_i^val (F1). Per round, with S the sampled clients (|S| = M) and
P = S_{t−1} the clients whose models were uploaded last round (F2):

  each i ∈ S downloads C = min(--fedfomo-candidates, M) models θ_j, j ∈ P \\ {i}: the highest
      affinity P_ij, each slot exploring a random one instead with probability ε_t   (F3)
  L_i(θ) = mean loss of θ on D_i^val: own model and candidates, all M·(C+1) pairs in one
      batched evaluation                                                             (F4)
  w_ij = max(0, (L_i(θ_i) − L_i(θ_j)) / ‖θ_j − θ_i‖), normalised to sum 1 where any is
      positive, else all 0                                                  (eqs. 5–6, F5)
  θ_i ← θ_i + Σ_j w_ij (θ_j − θ_i)              one [M, M+M] matmul per leaf           (F6)
  P_ij ← P_ij + w_ij                                                                   (F3)
  θ_i ← E epochs of the engine's local SGD from there on i's first n_i − v_i samples (F7)
  unsampled clients keep θ_i (and their optimizer rows)

Round 1 has no uploads yet: local training only. --fedfomo-baseline start compares with and
moves from s_i, the model i's last local training started from, with the trained θ_i one more
candidate, kept when no weight is positive (the reference codes' reading, F5).
Evaluated: each client's θ_i ("client").
Communication per sampled client: C models down, θ_i up (F8).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_pfl import core, ops
from fedjax_pfl.algorithms.engine import Engine, EngineConfig, client_keys, first_row, require_choices
from fedjax_pfl.algorithms.interface import Algorithm
from fedjax_pfl.algorithms.registry import (
    AT_LEAST_ONE,
    NON_NEGATIVE,
    UNIT_CLOSED,
    UNIT_CLOSED_OPEN,
    AlgorithmSpec,
    HParam,
    register,
)
from fedjax_pfl.data.federated import ClientSplits
from fedjax_pfl.models.model import Model
from fedjax_pfl.ops import fomo

Params = Any


class State(NamedTuple):
    params: Params        # personalised models θ_i                                  leaves [N, ...]
    opt_state: Any        # per-client optimizer states (momentum_buffer=persist) [N, ...], else None
    affinity: jax.Array   # P, client-to-client affinities (Σ of past weights w_ij)      [N, N]
    uploaded: jax.Array   # S_{t−1} sorted: whose models the server holds as uploads     [M] int32
    has_prev: jax.Array   # False in round 1 (nothing uploaded yet); shape=(), bool
    round: jax.Array      # rounds completed; shape=(), int32
    start: Params = None  # --fedfomo-baseline start: s_i, where i's last training began [N, ...]
    CLIENT_FIELDS = ("params", "opt_state", "affinity", "start")  # per-client rows [N, ...]


def validation_data(data, idx: jax.Array, counts: jax.Array, val_fraction: float):
    """`data` whose clients are evaluation pairs: row r = (k, c) of the [M, C+1] `counts` tests
    on the validation block of client idx[k] (the last v_i of its training samples), counts[k, c]
    samples of it (0: nothing evaluated). The Evaluator then computes every pair's loss at once."""
    c = data.clients
    n = c.train_count[idx]
    start = c.train_start[idx] + n - fomo.validation_counts(n, val_fraction)
    width = counts.shape[1]
    starts = jnp.repeat(start, width)
    clients = ClientSplits(train_start=starts, train_count=jnp.zeros_like(starts),
                           test_start=starts, test_count=counts.reshape(-1).astype(jnp.int32))
    max_val = max(1, math.ceil(val_fraction * data.max_train))     # only sizes the eval batch
    return dataclasses.replace(data, clients=clients, max_test=max_val, real_clients=None)


def training_data(data, val_fraction: float):
    """`data` with each client's training split cut to its first n_i − v_i samples (F1, F7)."""
    c = data.clients
    count = c.train_count - fomo.validation_counts(c.train_count, val_fraction)
    return dataclasses.replace(data, clients=dataclasses.replace(c, train_count=count))


def weight_statistics(w: jax.Array, slot_valid: jax.Array, dist: jax.Array
                      ) -> dict[str, jax.Array]:
    """The round's weights W [M, C] summarised as PGFed summarises its α: the self weight
    1 − Σ_j w_ij (1 for a client that keeps its own model, 0 for one that moves), the weights of
    the downloaded candidates (mean, max, fraction positive), the candidates per client and
    their mean distance ‖θ_j − θ_i‖."""
    n = jnp.sum(slot_valid)
    per = jnp.maximum(n, 1).astype(jnp.float32)
    return {
        "w_self_mean": jnp.mean(1.0 - jnp.sum(w, axis=1)),
        "w_other_mean": jnp.sum(w) / per,
        "w_other_max": jnp.max(w),
        "w_positive_fraction": jnp.sum(w > 0) / per,
        "candidates_mean": n / w.shape[0],
        "dist_mean": jnp.sum(jnp.where(slot_valid, dist, 0.0)) / per,
    }


def fedfomo(model: Model, config: EngineConfig, *, candidates: int, val_fraction: float,
            epsilon: float, epsilon_decay: float, baseline: str = "current") -> Algorithm:
    """FedFomo; see the module docstring."""
    require_choices(**{"--fedfomo-baseline": (baseline, ("current", "start"))})
    engine = Engine(model, config, streams=("select", "train"))

    def init(key: jax.Array, data) -> State:
        params = model.init(key)
        n, m = data.num_clients, engine.num_sampled(data)
        return State(core.broadcast(params, n), engine.init_opt_rows(params, n),
                     jnp.zeros((n, n)), jnp.arange(m, dtype=jnp.int32),
                     jnp.zeros((), bool), jnp.zeros((), jnp.int32),
                     core.broadcast(params, n) if baseline == "start" else None)

    def round_fn(state: State, data, key: jax.Array) -> tuple[State, dict]:
        rnd = engine.begin(data, key)                                                # S
        idx, m = rnd.idx, rnd.m
        num = min(candidates, m)                                                     # C (F3)
        own = core.gather(state.params, idx)                                         # θ_i, i ∈ S
        pool = core.gather(state.params, state.uploaded)                             # θ_j, j ∈ P
        # F3: ε-greedy download sets from the affinity rows, never the client itself.
        affinity = state.affinity[idx][:, state.uploaded]
        allowed = (idx[:, None] != state.uploaded[None, :]) & state.has_prev
        eps = jnp.maximum(epsilon - epsilon_decay * (state.round - 1), 0.0)
        slots, slot_valid = fomo.select_candidates(client_keys(rnd.keys["select"], idx), affinity,
                                                   allowed, num, eps)
        if baseline == "current":          # F5: θ_i is the baseline, the C downloads the candidates
            ref, cands, cand_slots, cand_valid = own, pool, slots, slot_valid
        else:                              # F5 'start': the start model s_i is the baseline, the
            ref = core.gather(state.start, idx)       # trained θ_i one more candidate (slot 0)
            cands = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), own, pool)
            cand_slots = jnp.concatenate([jnp.arange(m, dtype=jnp.int32)[:, None], m + slots], 1)
            cand_valid = jnp.concatenate([jnp.broadcast_to(state.has_prev, (m, 1)), slot_valid], 1)
        width = cand_slots.shape[1]
        # F4: L_i of the baseline (column 0) and of each candidate, on i's validation block.
        v = fomo.validation_counts(data.clients.train_count[idx], val_fraction)
        evaluated = jnp.concatenate([jnp.any(cand_valid, axis=1, keepdims=True), cand_valid], 1)
        pairs = jax.tree.map(lambda a, b: jnp.concatenate([a[:, None], b[cand_slots]], axis=1)
                             .reshape(m * (width + 1), *a.shape[1:]), ref, cands)
        val = validation_data(data, idx, jnp.where(evaluated, v[:, None], 0), val_fraction)
        loss = engine.evaluator.personal(val, pairs).loss.reshape(m, width + 1)
        dist = fomo.candidate_distances(ref, cands, cand_slots)                      # ‖θ_j − θ_i‖
        w = fomo.fomo_weights(loss[:, 0], loss[:, 1:], dist, cand_valid)            # F5
        if baseline == "start":            # nothing improves on s_i: keep the trained θ_i (PGFed)
            w = w.at[:, 0].set(jnp.where(jnp.sum(w, axis=1) > 0, w[:, 0], 1.0))
        start = fomo.fomo_update(w, cand_slots, ref, cands)                          # F6
        w_pool = w[:, width - num:]                    # the downloaded models' weights
        trained = engine.train(rnd, start, opt_rows=state.opt_state,                # F7
                               data=training_data(data, val_fraction))
        block = (idx[:, None], state.uploaded[slots])
        new_affinity = state.affinity.at[block].add(w_pool.astype(state.affinity.dtype))  # P += W
        new_state = State(core.scatter(state.params, idx, trained.params), trained.opt_rows,
                          new_affinity, jnp.sort(idx), jnp.ones((), bool), state.round + 1,
                          None if state.start is None else core.scatter(state.start, idx, start))
        d = ops.tree_size(first_row(own))
        metrics = engine.metrics(rnd, trained, up=d, down=d, down_clients=jnp.sum(slot_valid))
        metrics.update(weight_statistics(w_pool, slot_valid, dist[:, width - num:]))
        metrics["w_self_mean"] = jnp.mean(1.0 - jnp.sum(w_pool, axis=1))
        metrics["epsilon"] = jnp.where(state.has_prev, eps, 0.0)
        return new_state, metrics

    evaluate, parts = engine.evaluation(personal=lambda state: state.params)
    # Its round evaluates client-model pairs on the participants' validation samples, rows dealt
    # otherwise than its training: no per-device data blocks.
    return engine.algorithm("fedfomo", init, round_fn, evaluate, parts, data_blocks=False)


register(AlgorithmSpec(
    name="fedfomo", factory=fedfomo,
    not_private=("a pairwise server mixture: one client's upload reaches every other client's "
                 "personalised model through its own weight, which the sum's noise does not bound"),
    summary="FedFomo: each client mixes downloaded models weighted by validation-loss "
            "improvement per unit distance, max(0, ΔL)/‖θ_j − θ_i‖ normalised, then trains "
            "locally; personalised models evaluated",
    hparams=(
        HParam("candidates", int, 8,
                    "M, models each sampled client downloads from the previous round's uploads "
                    "(other clients only), capped at the clients per round (PGFed's reference "
                    "default 8; the authors' code also 8)",
                    check=AT_LEAST_ONE),
        HParam("val_fraction", float, 0.2,
                    "f, fraction of each client's training samples held out as its validation "
                    "split (the last ⌈f·n_i⌉, at most n_i − 1; fixed): the weights are computed "
                    "on it and local training never sees it (PGFed's reference 0.2; 0: no "
                    "validation, every client keeps its own model, i.e. local training)",
                    check=UNIT_CLOSED_OPEN),
        HParam("epsilon", float, 0.3,
                    "ε, probability that a download slot explores a uniformly random model "
                    "instead of the next highest affinity (the authors' code: 0.3; PGFed's: 0)",
                    check=UNIT_CLOSED),
        HParam("epsilon_decay", float, 0.05,
                    "ε decreases by this much per round after the first: ε_t = max(0, ε − "
                    "δ·(t − 2)) in round t ≥ 2 (the authors' code: 0.05)",
                    check=NON_NEGATIVE),
        HParam("baseline", str, "current",
                    "what the candidates are compared with and moved from: 'current', the "
                    "client's latest model θ_i (the paper's equation); 'start', the model its "
                    "last local training started from, with its trained θ_i one more candidate "
                    "and kept when nothing improves (the PGFed and authors' codes)",
                    choices=("current", "start")),
    ),
    test_hparams={"momentum": 0.5, "momentum_buffer": "persist"},
))
