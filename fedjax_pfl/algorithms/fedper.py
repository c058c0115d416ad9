"""FedPer (Arivazhagan, Aggarwal, Singh & Choudhary, arXiv:1912.00818, 2019): federated base
layers, personalisation layers kept on each client.

The parameters split by path (`core/split.py`) into the base (body) θ_B, shared by all, and the
personalisation layers (head) h_i of client i (--fedper-head, default the last dense layer).
Per round, as FedAvg (McMahan et al. 2017, Algorithm 1) on the whole model:

    each sampled i ∈ S_t starts from (θ_B, h_i) and runs E epochs of local SGD on all its parameters
    θ_B ← Σ_{i∈S_t} (n_i / Σ_{k∈S_t} n_k) θ_B,i        the body only, FedAvg's sample weights
    h_i ← the head client i trained; unsampled clients keep theirs

Communication per round: the body, d1 floats, down to and up from each sampled client.

Every head starts from the common initialisation. Evaluated: each client's (θ_B, h_i).
Limits: --fedper-head none (no personal layers) is FedAvg, bit for bit (the clients then start
from one shared model, as FedAvg's do); --fedper-head all (no shared layers) is Local.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_pfl import core
from fedjax_pfl.algorithms import base
from fedjax_pfl.core import split as split_lib
from fedjax_pfl.models.model import Model

Params = Any


class State(NamedTuple):
    body: Params       # base layers θ_B (None on head leaves)                    leaves [...]
    heads: Params      # personalisation layers h_i (None on body leaves)         leaves [N, ...]
    opt_state: Any     # per-client optimizer states [N, ...] (momentum_buffer=persist), else None
    round: jax.Array   # rounds completed; shape=(), int32
    CLIENT_FIELDS = ("heads", "opt_state")  # per-client rows [N, ...]


def fedper(model: Model, *, head: str, **common: Any) -> base.Algorithm:
    """FedPer; see the module docstring."""
    template = jax.eval_shape(model.init, jax.random.key(0))
    mask = split_lib.personal_mask(template, head)                     # fails early on a bad regex
    return personal_part_fedavg("fedper", model, mask, **common)


def personal_part_fedavg(name: str, model: Model, mask: Any, **common: Any) -> base.Algorithm:
    """FedAvg on the leaves where `mask` is False; each client keeps its own copy of the leaves
    where it is True (FedPer: the head; LG-FedAvg: the body). See the module docstring."""
    engine = base.Engine(model, **common)
    template = jax.eval_shape(model.init, jax.random.key(0))
    has_head = any(jax.tree.leaves(mask))
    body_size = split_lib.count(split_lib.split(template, mask)[0])    # d1: what is communicated

    def init(key: jax.Array, data) -> State:
        params = model.init(key)                   # the same initial model as every algorithm
        body, head0 = split_lib.split(params, mask)
        return State(body, core.broadcast(head0, data.num_clients),
                     engine.init_client_opt_states(params, data.num_clients),
                     jnp.zeros((), jnp.int32))

    def round_fn(state: State, data, key: jax.Array) -> tuple[State, dict]:
        sample_key, train_key = jax.random.split(key)
        idx = engine.sample(sample_key, data)                                      # S_t
        m = idx.shape[0]
        if has_head:
            start = split_lib.merge(core.broadcast(state.body, m), core.gather(state.heads, idx), mask)
            opt = engine.opt_states_for(state.opt_state, idx, base.first_row(start))
            result = engine.train(data, idx, start, opt, train_key)                # (θ_B, h_i)
        else:                                      # no head: one shared start, exactly FedAvg
            opt = engine.opt_states_for(state.opt_state, idx, state.body)
            result = engine.train(data, idx, state.body, opt, train_key, shared_start=True)
        bodies, heads = split_lib.split(result.params, mask)
        weights = core.gather(data.clients.train_count, idx)
        body = core.mean_over_clients(bodies, weights)                             # θ_B average
        new_state = State(body, core.scatter(state.heads, idx, heads),             # keep h_i
                          engine.store_opt_states(state.opt_state, idx, result.opt_state),
                          state.round + 1)
        metrics = base.train_metrics(result, idx)
        metrics.update(base.communication(up_clients=m, up_floats_per_client=body_size,
                                          down_clients=m, down_floats_per_client=body_size))
        return new_state, metrics

    def evaluate(state: State, data, ids=None) -> dict[str, core.ClientEval]:
        if not has_head:
            return {"client": engine.evaluator.shared(data, state.body, ids)}
        ids = base.evaluated_ids(data, ids)
        params = split_lib.merge(core.broadcast(state.body, ids.shape[0]),
                                 core.gather(state.heads, ids), mask)
        return {"client": engine.evaluator.rows(data, params, ids)}

    return base.Algorithm(name, init, round_fn, evaluate, {})


base.register(base.AlgorithmSpec(
    name="fedper",
    factory=fedper,
    summary="FedPer: FedAvg on the base layers, each client keeps its own head",
    hparams=(
        base.HParam("head", str, "head",
                    "the personalisation layers kept on each client: 'head' (the last dense "
                    "layer), 'all' (= local), 'none' (= fedavg) or a regex searched in each leaf "
                    "path such as 'Dense_1/'",
                    check=base.Check(split_lib.is_pattern, "'head', 'all', 'none' or a regex")),
    ),
))
