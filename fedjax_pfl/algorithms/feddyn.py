"""FedDyn (Acar, Zhao, Matas, Mattina, Whatmough & Saligrama, "Federated Learning Based on
Dynamic Regularization", ICLR 2021, arXiv:2111.04263), Algorithm 1.

State: the server model θ^{t−1}, the server's h^{t−1} (h^0 = 0) and, per client k, the linear
correction g_k = ∇L_k(θ_k^{t−1}) (g_k^0 = 0). Per round t with sampled clients P_t (|P_t| = M):

  each k ∈ P_t, from θ^{t−1}:
    θ_k^t ≈ argmin_θ  L_k(θ) − ⟨g_k, θ⟩ + (α/2)‖θ − θ^{t−1}‖²      (Algorithm 1, line 5)
             by E epochs of minibatch SGD on ∇L_k(θ; B) − g_k + α(θ − θ^{t−1})
    g_k ← g_k − α(θ_k^t − θ^{t−1})                                   (line 6)
  h^t = h^{t−1} − α (1/m) Σ_{k∈P_t} (θ_k^t − θ^{t−1})               (line 9; m = all N clients)
  θ^t = (1/M) Σ_{k∈P_t} θ_k^t − (1/α) h^t                           (line 10)

Readings:
  * The local argmin is E epochs of the engine's minibatch SGD (the paper's experiments and
    code do the same); −g_k is added to every minibatch gradient (`core.add_aux_gradient`), the
    prox gradient after it (`_prox.add_proximal_term`), then sgd(lr, momentum).
  * m in line 9 is the number of real clients N (padding clients excluded); the mean in line
    10 is the plain mean over P_t, not FedAvg's sample weights: the h-correction relies on it.
  * Evaluated: the server model θ^t on every client (FedDyn is a global method; the PGFed code
    evaluates it so). The authors' "cloud model" average of all client models is not kept.
  * Unsampled clients keep g_k (and their optimizer state).
Communication: θ down and θ_k up for each sampled client (d floats each way).

Lines 9–10 use the uploads only through their mean θ̄ = (1/M) Σ_k θ_k^t (Σ_k (θ_k^t − θ^{t−1}) =
M(θ̄ − θ^{t−1})), which the engine's server chain gives: h^t = h^{t−1} − α(M/N)(θ̄ − θ^{t−1}),
θ^t = θ̄ − h^t/α. Under --dp-clip (docs/privacy.md) θ̄ is DP-FedAvg's θ^{t−1} + Δ̃ with the noisy
mean update Δ̃ = (Σ_k clip_C(θ_k − θ^{t−1}) + N(0, z²C²))/M (post-processing).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_pfl import core, ops
from fedjax_pfl.algorithms import _prox
from fedjax_pfl.algorithms.engine import Engine, EngineConfig
from fedjax_pfl.algorithms.interface import Algorithm
from fedjax_pfl.algorithms.registry import POSITIVE, AlgorithmSpec, HParam, register
from fedjax_pfl.core.local import add_aux_gradient
from fedjax_pfl.models.model import Model

Params = Any


class State(NamedTuple):
    params: Params     # server model θ^{t−1}                                 leaves [...]
    h: Params          # server state h^{t−1}                                  leaves [...]
    grad_corr: Params  # g_k = ∇L_k(θ_k), each client's linear correction      leaves [N, ...]
    opt_state: Any     # per-client optimizer states (momentum_buffer=persist) [N, ...], else None
    server: Any        # the server chain's state (Engine.init_server)
    round: jax.Array   # rounds completed; shape=(), int32
    CLIENT_FIELDS = ("grad_corr", "opt_state")  # per-client rows [N, ...]


def feddyn(model: Model, config: EngineConfig, *, alpha: float) -> Algorithm:
    """FedDyn; see the module docstring."""
    engine = Engine(model, config, client_transform=optax.chain(
        add_aux_gradient("neg_corr"), _prox.add_proximal_term(alpha)))

    def init(key: jax.Array, data) -> State:
        params = model.init(key)
        zeros = ops.tree_zeros_like(params)
        return State(params, zeros, core.broadcast(zeros, data.num_clients),
                     engine.init_opt_rows(params, data.num_clients),
                     engine.init_server(params, data), jnp.zeros((), jnp.int32))

    def round_fn(state: State, data, key: jax.Array) -> tuple[State, dict]:
        rnd = engine.begin(data, key)                                              # P_t
        g = core.gather(state.grad_corr, rnd.idx)
        extra = {"neg_corr": ops.tree_scale(-1.0, g), "anchor": core.broadcast(state.params, rnd.m)}
        result = engine.train(rnd, state.params, opt_rows=state.opt_state, extra=extra,
                              shared_start=True)                                   # line 5
        moved = jax.tree.map(lambda t, p: t - p, result.params, state.params)      # θ_k − θ^{t−1}
        g = jax.tree.map(lambda gk, dk: gk - alpha * dk, g, moved)                 # line 6
        # Both server lines use only Σ_k (θ_k − θ^{t−1}) = M·(mean − θ^{t−1}): the server
        # chain's mean model (under --dp-clip DP-FedAvg's θ^{t−1} + Δ̃, post-processing).
        mean, server, agg = engine.aggregate(rnd, state.params, result.params, None, state.server)
        update = jax.tree.map(jnp.subtract, mean, state.params)                    # mean − θ^{t−1}
        share = engine.expected_clients(data) / data.num_real_clients              # M/N
        h = jax.tree.map(lambda hs, u: hs - (alpha * share) * u, state.h, update)  # line 9
        params = jax.tree.map(lambda m, hs: m - hs / alpha, mean, h)               # line 10
        new_state = State(params, h, core.scatter(state.grad_corr, rnd.idx, g), result.opt_rows,
                          server, state.round + 1)
        d = ops.tree_size(params)
        metrics = engine.metrics(rnd, result, up=d, down=d, server=agg)
        metrics["h_norm"] = ops.tree_norm(h)
        return new_state, metrics

    def evaluate(state: State, data, ids=None) -> dict[str, core.ClientEval]:
        return {"client": engine.evaluator.shared(data, state.params, ids)}

    return engine.algorithm("feddyn", init, round_fn, evaluate, host_state=True)


register(AlgorithmSpec(
    name="feddyn", factory=feddyn,
    private_uplink="each sampled client's model update θ_k − θ; the server's h and θ both follow "
                   "from the noisy mean update; the client's correction g_k and optimizer state "
                   "stay on the client",
    summary="FedDyn: dynamic regularisation (linear correction + (α/2)‖θ − θ_server‖²); server "
            "model evaluated",
    hparams=(
        HParam("alpha", float, 0.01,
                    "α, FedDyn's regulariser (α/2)‖θ − θ_server‖² and the step of the client "
                    "correction and server state h. Default 0.01: the middle of the PGFed "
                    "paper's grid {0.1, 0.01, 0.001}; it trains well at the default lr on digits",
                    check=POSITIVE),
    ),
    traceable=("lr", "alpha"),
    test_hparams={},
))
