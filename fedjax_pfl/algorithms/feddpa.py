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

λ. The local step trains with a fixed λ (--feddpa-lambda, default 0.5; the authors' code trains
the local adapter at 0.5). At evaluation the paper weighs the adapters per test instance by the
similarity of the instance to the client's training data (its instance-wise dynamic weighting,
--feddpa-weighting instance, the default); our reading of it:

    e(x) = the representation of x by the model with the local adapter alone (the base's
           `features`, averaged over positions for a sequence), ê = e / ‖e‖
    c_i  = (1/K) Σ_j ê(x_j) over K training examples x_j of client i (--feddpa-refs, default 5,
           evenly spaced through its training split)
    λ(x) = clip(w · ê(x)·c_i, 0, 1) = clip(w · mean_j cos(e(x), e(x_j)), 0, 1)
           (w: --feddpa-scale, default 0.5, the code's `half`)

and the instance's model is the mixture above at λ(x) on the local adapter: the closer x is to
the client's own data, the more its personal adapter counts. (The authors' code multiplies the
global adapter by this weight and draws the K examples afresh per instance; we give it to the
local adapter, as the paper's motivation reads, clip it to [0, 1] and keep one reference set
per client so that an evaluation is deterministic.) --feddpa-weighting fixed evaluates at λ.
On a model without adapters (no `apply.mix`, `models.lora`), the mixture is of the two models'
outputs, (1 − λ) f(θ_g, x) + λ f(θ_l,i, x), and e(x) is its `features`.
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
from fedjax_pfl.errors import OptionError, arg
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


def representation(model: Model, params: Params, x: jax.Array) -> jax.Array:
    """ê(x) [B, D]: `model`'s representation of x under `params` (an adapted model's base
    features under its adapters, `apply.features`; else `features`), averaged over the positions
    of a sequence, divided by its norm."""
    features = getattr(model.apply, "features", None) or model.features
    e = features(params, x)
    e = e.reshape(e.shape[0], -1, e.shape[-1]).mean(axis=1).astype(jnp.float32)
    return e / jnp.maximum(jnp.linalg.norm(e, axis=-1, keepdims=True), 1e-12)


def centroid(model: Model, local: Params, data, client, refs: int) -> jax.Array:
    """c_i [D]: the mean of ê over `refs` training examples of one client (`client`, its row
    of data.clients), evenly spaced through its training split; zeros for a client with none."""
    positions = (jnp.arange(refs) * client.train_count) // refs
    rows = client.train_start + jnp.minimum(positions, jnp.maximum(client.train_count - 1, 0))
    c = representation(model, local, data.inputs(rows)).mean(axis=0)
    return jnp.where(client.train_count > 0, c, 0.0)


def mixture(model: Model, lam, scale: float = 0.5) -> Model:
    """The model of params {"global": θ_g, "local": θ_l}: the adapters' outputs mixed with
    weights (1 − λ, λ) in one forward pass of the base (`apply.mix`), or the two models'
    outputs so mixed for a model without adapters. With a "centroid" c [D] among the params,
    λ is per example: clip(scale · ê(x)·c, 0, 1) (the module docstring)."""
    mix = getattr(model.apply, "mix", None)

    def apply(params: Params, x: jax.Array) -> jax.Array:
        weight = lam
        if "centroid" in params:
            e = representation(model, params["local"], x)
            weight = jnp.clip(scale * (e @ params["centroid"].astype(jnp.float32)), 0.0, 1.0)
        if mix is not None:
            return mix([(1.0 - weight, params["global"]), (weight, params["local"])], x)
        g, loc = model.apply(params["global"], x), model.apply(params["local"], x)
        w = jnp.asarray(weight, g.dtype)
        w = w.reshape(w.shape + (1,) * (g.ndim - w.ndim)) if w.ndim else w
        return (1.0 - w) * g + w * loc

    def init(key: jax.Array) -> Params:
        p = model.init(key)
        return {"global": p, "local": p}

    return model._replace(init=init, apply=apply, name=f"{model.name}+feddpa", features=None)


def feddpa(model: Model, config: EngineConfig, *, lam: float, weighting: str, refs: int,
           scale: float) -> Algorithm:
    """FedDPA (FedDPA-T); see the module docstring."""
    instance = weighting == "instance"
    if instance and getattr(model.apply, "features", None) is None and model.features is None:
        raise OptionError(f"{arg('weighting', 'hparams')} instance compares representations, "
                          f"and model {model.name!r} gives none (no features): use "
                          f"{arg('weighting', 'hparams')} fixed")
    engine = Engine(model, config, streams=("train", "local"))
    mixed = mixture(model, lam, scale)
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
        if instance:                                  # c_i of each evaluated client
            clients = jax.tree.map(lambda a: a[ids], data.clients)
            params["centroid"] = jax.lax.map(
                lambda row: centroid(model, row[0], data, row[1], refs),
                (params["local"], clients), batch_size=8)
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
        HParam("weighting", str, "instance",
               "evaluation's mixture: 'instance' (the paper's instance-wise weighting: λ(x) = "
               "clip(w·mean cos(e(x), e(x_j)), 0, 1) over K training examples x_j of the "
               "client) or 'fixed' (λ)", choices=("instance", "fixed")),
        HParam("refs", int, 5, "K: the training examples a client's similarity is taken to "
               "(--feddpa-weighting instance)", check=Check(lambda v: v >= 1, ">= 1")),
        HParam("scale", float, 0.5, "w: the scale of the similarity (--feddpa-weighting "
               "instance; the authors' code's 0.5)", check=Check(lambda v: v > 0, "> 0")),
    ),
    test_hparams={},
    private_uplink="each client's update of the global adapter; its local adapter stays on the "
                   "client",
))
