"""Ditto (Li, Hu, Beirami & Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021, arXiv:2012.04221), Algorithm 1.

A global model w trained by FedAvg, and a personal model v_k per client. Per round t, each
sampled client k ∈ S_t, both from the global model w^t it receives:

    w_k ← E epochs of local SGD on F_k from w^t                      (UPDATE_GLOBAL, FedAvg)
    v_k ← E epochs of local SGD on F_k(v) + (λ/2)‖v − w^t‖² from v_k (Algorithm 1 lines 6–8)
  w^{t+1} = Σ_{k∈S_t} (n_k / Σ_{j∈S_t} n_j) w_k                      (FedAvg's weighted mean)

Readings:
  * The anchor of the personal objective is the received w^t (Algorithm 1), not the client's
    freshly trained w_k.
  * The personal solver runs the same local schedule as the global one (E epochs or
    --local-steps K, batch B, lr η, momentum), with its own minibatch order; the authors' code
    also uses the same number of local iterations. Its optimizer state persists across a
    client's rounds exactly when the global one does (--momentum-buffer).
  * --ditto-prox-step: 'explicit' (the paper) steps on ∇F_k(v; B) + λ(v − w^t); 'implicit'
    treats the quadratic exactly (forward–backward): v ← (v − η∇F_k(v; B) + ηλ w^t)/(1 + ηλ),
    the same fixed points, stable for any λ, and v = w^t in the limit λ → ∞. It is the explicit
    step with the gradient scaled by 1/(1 + ηλ) (so with momentum, the scaled gradient enters
    the buffer).
  * Every personal model starts from the common initialisation; unsampled clients keep theirs.
  * The global model is trained exactly as FedAvg (same sampling and keys): Ditto's w is
    FedAvg's, bit for bit.
Evaluated: each client's personal v_k ("client", stale for unsampled clients) and w ("global").
Communication: as FedAvg, d floats each way per sampled client.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_pfl import core, ops
from fedjax_pfl.algorithms import _prox
from fedjax_pfl.algorithms.engine import Engine, EngineConfig, require_choices
from fedjax_pfl.algorithms.interface import Algorithm
from fedjax_pfl.algorithms.registry import NON_NEGATIVE, AlgorithmSpec, HParam, register
from fedjax_pfl.models.model import Model

Params = Any


class State(NamedTuple):
    params: Params          # global model w                                           leaves [...]
    personal: Params        # personal models v_k                                      leaves [N, ...]
    opt_state: Any          # per-client optimizer states of w_k's training (persist), else None
    personal_opt_state: Any  # per-client optimizer states of v_k's training (persist), else None
    server: Any             # the server chain's state (Engine.init_server)
    round: jax.Array        # rounds completed; shape=(), int32
    CLIENT_FIELDS = ("personal", "opt_state", "personal_opt_state")  # per-client rows [N, ...]


def ditto(model: Model, config: EngineConfig, *, lam: float, prox_step: str
          ) -> Algorithm:
    """Ditto; see the module docstring."""
    require_choices(**{"--ditto-prox-step": (prox_step, ("explicit", "implicit"))})
    engine = Engine(model, config)                                    # w_k: plain FedAvg
    personal_tx = _prox.add_proximal_term(lam)
    if prox_step == "implicit":
        personal_tx = optax.chain(personal_tx, optax.scale(1.0 / (1.0 + config.lr * lam)))
    personal = Engine(model, config, client_transform=personal_tx)    # v_k: prox objective

    def init(key: jax.Array, data) -> State:
        params = model.init(key)
        n = data.num_clients
        return State(params, core.broadcast(params, n), engine.init_opt_rows(params, n),
                     personal.init_opt_rows(params, n), engine.init_server(params, data),
                     jnp.zeros((), jnp.int32))

    def round_fn(state: State, data, key: jax.Array) -> tuple[State, dict]:
        rnd = engine.begin(data, key)                                              # S_t
        trained = engine.train(rnd, state.params, opt_rows=state.opt_state, shared_start=True)  # w_k
        mine = personal.train(rnd, core.gather(state.personal, rnd.idx),           # v_k, anchor w^t
                              opt_rows=state.personal_opt_state,
                              key=jax.random.fold_in(rnd.keys["train"], 1),
                              extra={"anchor": core.broadcast(state.params, rnd.m)})
        params, server, agg = engine.aggregate(rnd, state.params, trained.params,  # w^{t+1}
                                               rnd.train_counts, state.server)
        new_state = State(params, core.scatter(state.personal, rnd.idx, mine.params),
                          trained.opt_rows, mine.opt_rows, server, state.round + 1)
        d = ops.tree_size(params)
        metrics = engine.metrics(rnd, trained, up=d, down=d, server=agg)
        metrics["client_steps"] = metrics["client_steps"] + jnp.sum(mine.num_steps)
        metrics["personal_train_loss"] = mine.loss
        return new_state, metrics

    evaluate, parts = engine.evaluation(personal=lambda state: state.personal,
                                        shared=lambda state: state.params)
    return engine.algorithm("ditto", init, round_fn, evaluate, parts, host_state=True)


register(AlgorithmSpec(
    name="ditto", factory=ditto,
    summary="Ditto: FedAvg global model plus per-client personal models pulled toward it by "
            "(λ/2)‖v − w‖²; personal models evaluated",
    hparams=(
        HParam("lam", float, 1.0,
                    "λ, strength of the personal models' pull (λ/2)‖v − w_global‖². Default 1: "
                    "the largest of pFedSOP's grid {1, 0.1, 0.01} for Ditto; on digits (50 "
                    "rounds) λ = 1 reaches 95 %, λ = 0.1 only 86 % (rarely sampled clients' "
                    "personal models lag)",
                    check=NON_NEGATIVE),
        HParam("prox_step", str, "explicit",
                    "how the personal step treats λ/2‖v − w‖²: 'explicit' gradient step (the "
                    "paper) or 'implicit' (exact prox; stable for any λ, v = w as λ → ∞)",
                    choices=("explicit", "implicit")),
    ),
    test_hparams={"momentum": 0.5, "momentum_buffer": "persist"},
    private_uplink="each client's update of the global model w; its personal model v stays "
                   "on the client",
))
