"""pFedMe (Dinh, Tran & Nguyen, "Personalized Federated Learning with Moreau Envelopes",
NeurIPS 2020, arXiv:2006.08848), Algorithm 1, as TDPFed compares against it
(docs/algorithms/pfedme.md).

Per round t, with global model w_t:
  every client k (all K train, as in the authors' code and TDPFed's Algorithm 1):
     w_k ← w_t;  θ_k ← w_t
     R local rounds (--local-steps), one minibatch B each:
        K times:  θ_k ← θ_k − η_p [∇f(θ_k; B) + λ(θ_k − w_k)]     inner problem (eq. 7), GD as
                                                                   the authors' pFedMeOptimizer
        w_k ← w_k − η λ (w_k − θ_k)                                local update (Algorithm 1 l. 8)
  S clients sampled (after training); w_{t+1} = (1 − β) w_t + β Σ_{k∈S} p_k w_k    (Algorithm 1
  l. 12) with p_k = n_k / Σ_{j∈S} n_j (`weights="data_size"`, the default: the authors' code
  weights the local models by their training-sample counts) or p_k = 1/S (`weights="uniform"`:
  the paper's Algorithm 1 writes the plain mean over the sampled clients); TDPFed offers both

Under --dp-clip (docs/privacy.md) the server step is DP-FedAvg's on the updates w_k − w_t, with
uniform weights and the fixed denominator M: w_{t+1} = w_t + β·(Σ_k clip_C(w_k − w_t) +
N(0, z²C²))/M.

θ_k carries over between local rounds within a round and restarts at w_t every round. The
personalised θ_k after training is evaluated ("client"); the global w as "global". `--momentum`
> 0 turns the inner GD into Nesterov's method (TDPFed's inner solver); 0 is the pFedMe code.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_pfl import core, ops
from fedjax_pfl.algorithms.engine import Engine, EngineConfig
from fedjax_pfl.algorithms.interface import Algorithm
from fedjax_pfl.algorithms.registry import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, AlgorithmSpec, HParam, register
from fedjax_pfl.core.local import masked_mean_loss
from fedjax_pfl.models.model import Model

Params = Any


class State(NamedTuple):
    theta: Params       # θ_k, personalised models after this round's training   leaves [K, ...]
    params: Params      # w, the global model                                     leaves [...]
    opt_state: Any      # per-client inner-optimizer states (--momentum-buffer persist), else None
    server: Any         # the server chain's state (Engine.init_server)
    round: jax.Array    # shape=(), int32
    CLIENT_FIELDS = ("theta", "opt_state")  # per-client rows [N, ...]


def pfedme(model: Model, config: EngineConfig, *, lam: float, personal_lr: float,
           personal_steps: int, beta: float, weights: str = "data_size") -> Algorithm:
    """pFedMe; see the module docstring. `config.lr` is η, the local model's learning rate."""
    if config.local_steps is None:
        raise ValueError("pfedme runs --local-steps R local rounds of one minibatch each; set it")
    eta, momentum = config.lr, config.momentum
    persist = config.momentum_buffer == "persist" and momentum > 0
    inner = optax.sgd(personal_lr, momentum=momentum or None, nesterov=momentum > 0)

    def local_round(params, opt_state, x, y, mask, extra):
        """One local round: K inner steps on θ toward w_k, then w_k's step toward θ."""
        del extra
        theta, w = params
        grad_fn = jax.value_and_grad(lambda p: masked_mean_loss(model, p, x, y, mask))

        def inner_step(i, carry):
            theta, state, first_loss = carry
            loss, g = grad_fn(theta)
            g = jax.tree.map(lambda gi, ti, wi: gi + lam * (ti - wi), g, theta, w)
            updates, state = inner.update(g, state, theta)
            return optax.apply_updates(theta, updates), state, jnp.where(i == 0, loss, first_loss)

        theta, opt_state, loss = jax.lax.fori_loop(0, personal_steps, inner_step,
                                                   (theta, opt_state, jnp.zeros(())))
        w = jax.tree.map(lambda wi, ti: wi - eta * lam * (wi - ti), w, theta)
        return (theta, w), opt_state, loss

    init_opt = lambda params: inner.init(params[0])
    engine = Engine(model, config, step_fn=local_round, trains="all",
                    optimizer=optax.GradientTransformation(init_opt, _unused))

    def init(key: jax.Array, data) -> State:
        w = model.init(key)
        k = data.num_clients
        opt = core.broadcast(inner.init(w), k) if persist else None
        return State(core.broadcast(w, k), w, opt, engine.init_server(w, data),
                     jnp.zeros((), jnp.int32))

    def round_fn(state: State, data, key: jax.Array) -> tuple[State, dict]:
        rnd = engine.begin(data, key)                                        # S clients
        everyone = engine.everyone(data)
        trained = engine.train(rnd, (state.params, state.params), idx=everyone,   # θ_k, w_k ← w_t
                               opt_state=state.opt_state if persist else None, shared_start=True)
        theta, local = trained.params
        p = rnd.train_counts if weights == "data_size" else None
        # Σ p_k w_k; under --dp-clip DP-FedAvg's noisy mean of the clipped w_k − w_t instead.
        mean, server, agg = engine.aggregate(rnd, state.params, core.gather(local, rnd.idx), p,
                                             state.server)
        params = ops.tree_lerp(state.params, mean, beta)                     # β-mixing
        d = ops.tree_size(state.params)
        metrics = engine.metrics(rnd, trained, up=d, down=d, down_clients=data.num_clients,
                                 server=agg)
        return State(theta, params, trained.opt_state if persist else None, server,
                     state.round + 1), metrics

    def evaluate(state: State, data, ids=None) -> dict[str, core.ClientEval]:
        return {"client": engine.evaluator.personal(data, state.theta, ids),
                "global": engine.evaluator.shared(data, state.params, ids)}

    return engine.algorithm("pfedme", init, round_fn, evaluate)


def _unused(updates, state, params=None):
    raise NotImplementedError("pFedMe's local step is its own step_fn")


register(AlgorithmSpec(
    name="pfedme", factory=pfedme,
    private_uplink="each sampled client's local-model update w_k − w_t; β then scales the noisy "
                   "mean update; the personalised θ_k and the optimizer states stay on the client",
    summary="pFedMe: personalised models from a Moreau-envelope inner problem around local models",
    hparams=(
        HParam("lam", float, 12.0, "λ, strength of the pull λ/2‖θ − w‖²",
                    check=NON_NEGATIVE),
        HParam("personal_lr", float, 0.08, "η_p, learning rate of the inner steps on θ",
                    check=POSITIVE),
        HParam("personal_steps", int, 5, "K, inner steps on θ per local round (one minibatch)",
                    check=AT_LEAST_ONE),
        HParam("beta", float, 1.0, "β, server mixing w ← (1−β)w + β·mean",
                    check=NON_NEGATIVE),
        HParam("weights", str, "data_size",
                    "weights p_k of the server mean: 'data_size' (n_k/Σn_j, the authors' code) or "
                    "'uniform' (1/S, the paper's Algorithm 1)", choices=("data_size", "uniform")),
    ),
    # TDPFed's comparison (Section VII-D): local lr 0.05, the rest as TDPFed's MNIST setting.
    defaults={"lr": 0.05, "batch_size": 20, "local_steps": 23, "participation": 1.0},
    traceable=('lr', 'lam', 'personal_lr', 'beta'),
    test_hparams={"local_steps": 2},
))
