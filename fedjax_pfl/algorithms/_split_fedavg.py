"""FedAvg on part of the model, each client keeping the rest: FedPer (the head kept) and
LG-FedAvg (the body kept) are this one factory with their masks. A private helper module (no
algorithm imports a sibling)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_pfl import core
from fedjax_pfl.algorithms.engine import Engine, EngineConfig
from fedjax_pfl.algorithms.interface import Algorithm, evaluated_ids
from fedjax_pfl.models import split as split_lib
from fedjax_pfl.models.model import Model

Params = Any


class SplitModelState(NamedTuple):
    """The state of FedAvg on part of the model, each client keeping the rest (`split_fedavg`:
    FedPer's head, LG-FedAvg's body)."""

    body: Params       # the averaged leaves θ_B (None on the kept ones)              leaves [...]
    heads: Params      # each client's kept leaves h_i (None on the averaged ones)    leaves [N, ...]
    opt_state: Any     # per-client optimizer states [N, ...] (momentum_buffer=persist), else None
    server: Any        # the server chain's state (Engine.init_server)
    round: jax.Array   # rounds completed; shape=(), int32
    CLIENT_FIELDS = ("heads", "opt_state")  # per-client rows [N, ...]


def split_fedavg(name: str, model: Model, config: EngineConfig, mask: Any) -> Algorithm:
    """FedAvg (McMahan et al. 2017, Algorithm 1) on the leaves where `mask` is False; each client
    keeps its own copy of the leaves where it is True (FedPer: the head; LG-FedAvg: the body).
    Per round, with θ_B the averaged leaves and h_i client i's kept ones:

        each sampled i ∈ S_t starts from (θ_B, h_i) and runs local SGD on all its parameters
        θ_B ← Σ_{i∈S_t} (n_i / Σ_{k∈S_t} n_k) θ_B,i        FedAvg's sample weights
        h_i ← what client i trained; unsampled clients keep theirs

    Communication: |θ_B| floats down to and up from each sampled client. Evaluated: each
    client's (θ_B, h_i). With nothing kept (mask all False) it is FedAvg bit for bit (one
    shared start); with everything kept, Local.
    """
    engine = Engine(model, config)
    template = jax.eval_shape(model.init, jax.random.key(0))
    has_head = any(jax.tree.leaves(mask))
    body_size = split_lib.count(split_lib.split(template, mask)[0])    # d1: what is communicated

    def init(key: jax.Array, data) -> SplitModelState:
        params = model.init(key)                   # the same initial model as every algorithm
        body, head0 = split_lib.split(params, mask)
        return SplitModelState(body, core.broadcast(head0, data.num_clients),
                               engine.init_opt_rows(params, data.num_clients),
                               engine.init_server(body, data), jnp.zeros((), jnp.int32))

    def round_fn(state: SplitModelState, data, key: jax.Array) -> tuple[SplitModelState, dict]:
        rnd = engine.begin(data, key)                                              # S_t
        if has_head:
            start = split_lib.merge(core.broadcast(state.body, rnd.m),
                                    core.gather(state.heads, rnd.idx), mask)
            trained = engine.train(rnd, start, opt_rows=state.opt_state)           # (θ_B, h_i)
        else:                                      # no head: one shared start, exactly FedAvg
            trained = engine.train(rnd, state.body, opt_rows=state.opt_state, shared_start=True)
        bodies, heads = split_lib.split(trained.params, mask)
        body, server, agg = engine.aggregate(rnd, state.body, bodies, rnd.train_counts,  # θ_B
                                             state.server)                              # average
        new_state = SplitModelState(body, core.scatter(state.heads, rnd.idx, heads),    # keep h_i
                                    trained.opt_rows, server, state.round + 1)
        metrics = engine.metrics(rnd, trained, up=body_size, down=body_size, server=agg)
        return new_state, metrics

    def evaluate(state: SplitModelState, data, ids=None) -> dict[str, core.ClientEval]:
        if not has_head:
            return {"client": engine.evaluator.shared(data, state.body, ids)}
        ids = evaluated_ids(data, ids)
        params = split_lib.merge(core.broadcast(state.body, ids.shape[0]),
                                 core.gather(state.heads, ids), mask)
        return {"client": engine.evaluator.rows(data, params, ids)}

    return engine.algorithm(name, init, round_fn, evaluate, host_state=True)
