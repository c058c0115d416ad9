"""FedDPA (Yang, Long, Shen, Jiang & Blumenstein, "Dual-Personalizing Adapter for Federated
Foundation Models", NeurIPS 2024): a global adapter averaged by the server and a personal
(local) adapter kept by each client, mixed in the forward pass.

Our reading of the method (the paper's §4, FedDPA-T, the "iterative" learning of the local
adapter). Each client holds the frozen base W, the global adapter ΔW_g and its local adapter
ΔW_l,i; the model a client uses mixes the two adapters' outputs in every adapted layer,

    y = x W + b + (1 − λ) ΔW_g(x) + λ ΔW_l,i(x),        ΔW(x) = (α/r) x Aᵀ Bᵀ

Per round, for each sampled i ∈ S_t:

    global step: from the server's ΔW_g, E epochs of local SGD on the model with ΔW_g alone;
                 ΔW_g ← Σ_{i∈S_t} (n_i / Σ_k n_k) ΔW_g,i        (FedAvg; only ΔW_g is sent)
    local step:  from ΔW_l,i, E epochs of local SGD on the mixed model above with the ΔW_g it
                 received frozen; ΔW_l,i is kept by the client

Evaluated: each client's mixed model ("client") and the global adapter alone ("global").

λ: the paper weighs the adapters per test instance by the similarity of the instance's
representation to the client's training data (its instance-wise dynamic weighting, at
inference only); we implement a fixed λ (--feddpa-lambda, default 0.5, the mixture the local
adapter is trained with), the instance-wise rule being left as an option for later. On a model
without adapters (no `apply.mix`, `models.lora`), the mixture is of the two models' outputs,
(1 − λ) f(θ_g, x) + λ f(θ_l,i, x).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_pfl import core, ops
from fedjax_pfl.algorithms.engine import Engine, EngineConfig
from fedjax_pfl.algorithms.interface import Algorithm, evaluated_ids
from fedjax_pfl.algorithms.registry import AlgorithmSpec, Check, HParam, register
from fedjax_pfl.models import split as split_lib
from fedjax_pfl.models.model import Model

Params = Any


class State(NamedTuple):
    """FedDPA's state."""

    params: Params     # the global adapter ΔW_g                              leaves [...]
    local: Params      # each client's local adapter ΔW_l,i                   leaves [N, ...]
    server: Any        # the server chain's state (Engine.init_server)
    round: jax.Array   # rounds completed; shape=(), int32
    CLIENT_FIELDS = ("local",)


def mixture(model: Model, lam) -> Model:
    """The model of params {"global": θ_g, "local": θ_l}: the adapters' outputs mixed with
    weights (1 − λ, λ) in one forward pass of the base (`apply.mix`), or the two models'
    outputs so mixed for a model without adapters."""
    mix = getattr(model.apply, "mix", None)

    def apply(params: Params, x: jax.Array) -> jax.Array:
        if mix is not None:
            return mix([(1.0 - lam, params["global"]), (lam, params["local"])], x)
        return ((1.0 - lam) * model.apply(params["global"], x)
                + lam * model.apply(params["local"], x))

    def init(key: jax.Array) -> Params:
        p = model.init(key)
        return {"global": p, "local": p}

    return model._replace(init=init, apply=apply, name=f"{model.name}+feddpa", features=None)


def feddpa(model: Model, config: EngineConfig, *, lam: float) -> Algorithm:
    """FedDPA (FedDPA-T, fixed λ); see the module docstring."""
    engine = Engine(model, config, streams=("train", "local"))
    mixed = mixture(model, lam)
    template = jax.eval_shape(mixed.init, jax.random.key(0))
    only_local = {"global": jax.tree.map(lambda _: False, template["global"]),
                  "local": jax.tree.map(lambda _: True, template["local"])}
    local_tx = split_lib.train_only(optax.sgd(config.lr, momentum=config.momentum or None),
                                    only_local)
    local_engine = Engine(mixed, config, optimizer=local_tx)

    def init(key: jax.Array, data) -> State:
        params = model.init(key)        # both adapters start from the same initialisation
        return State(params, core.broadcast(params, data.num_clients),
                     engine.init_server(params, data), jnp.zeros((), jnp.int32))

    def round_fn(state: State, data, key: jax.Array) -> tuple[State, dict]:
        rnd = engine.begin(data, key)                                             # S_t
        trained = engine.train(rnd, state.params, shared_start=True)              # ΔW_g,i
        params, server, agg = engine.aggregate(rnd, state.params, trained.params,  # Σ (n_i/n)
                                               rnd.train_counts, state.server)    # ΔW_g,i
        start = {"global": core.broadcast(state.params, rnd.m),                   # ΔW_g frozen,
                 "local": core.gather(state.local, rnd.idx)}                      # ΔW_l,i
        local = local_engine.train(rnd, start, key=rnd.keys["local"])
        d = ops.tree_size(params)
        metrics = engine.metrics(rnd, trained, up=d, down=d, server=agg)
        metrics["local_train_loss"] = jnp.mean(local.loss)     # the local step's, over S_t
        return State(params, core.scatter(state.local, rnd.idx, local.params["local"]), server,
                     state.round + 1), metrics

    def rows(state: State, data, ids=None) -> dict[str, core.ClientEval]:
        ids = evaluated_ids(data, ids)
        params = {"global": core.broadcast(state.params, ids.shape[0]),
                  "local": core.gather(state.local, ids)}
        return {"client": local_engine.evaluator.rows(data, params, ids)}

    def rest(state: State, data, ids=None) -> dict[str, core.ClientEval]:
        return {"global": engine.evaluator.shared(data, state.params, ids)}

    # (a client's mixed model depends on the global adapter too: no part is cached)
    evaluate = lambda state, data, ids=None: {**rows(state, data, ids), **rest(state, data, ids)}
    return engine.algorithm("feddpa", init, round_fn, evaluate, host_state=True)


register(AlgorithmSpec(
    name="feddpa",
    factory=feddpa,
    summary="FedDPA: a global adapter averaged, a local adapter per client, mixed (1−λ, λ)",
    hparams=(
        HParam("lam", float, 0.5,
               "λ, the local adapter's weight in the mixture (1 − λ) ΔW_g + λ ΔW_l",
               check=Check(lambda v: 0.0 <= v <= 1.0, "in [0, 1]"), flag="--feddpa-lambda"),
    ),
    test_hparams={},
    private_uplink="each client's update of the global adapter; its local adapter stays on the "
                   "client",
))
