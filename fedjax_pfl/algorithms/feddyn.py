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

Under --dp-clip (docs/privacy.md): lines 9–10 use the updates only through their sum, so both
read DP-FedAvg's noisy mean update Δ̃ = (Σ_k clip_C(θ_k − θ^{t−1}) + N(0, z²C²))/M:
h^t = h^{t−1} − α(M/N)Δ̃, θ^t = θ^{t−1} + Δ̃ − h^t/α (without clipping or noise: lines 9–10).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_pfl import core, ops
from fedjax_pfl.algorithms import _prox
from fedjax_pfl.algorithms.engine import Engine, EngineConfig, train_metrics
from fedjax_pfl.algorithms.interface import Algorithm
from fedjax_pfl.algorithms.registry import AlgorithmSpec, HParam, POSITIVE, register
from fedjax_pfl.core.local import add_aux_gradient
from fedjax_pfl.models.model import Model

Params = Any


class State(NamedTuple):
    params: Params     # server model θ^{t−1}                                 leaves [...]
    h: Params          # server state h^{t−1}                                  leaves [...]
    grad_corr: Params  # g_k = ∇L_k(θ_k), each client's linear correction      leaves [N, ...]
    opt_state: Any     # per-client optimizer states (momentum_buffer=persist) [N, ...], else None
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
                     engine.init_client_opt_states(params, data.num_clients),
                     jnp.zeros((), jnp.int32))

    def round_fn(state: State, data, key: jax.Array) -> tuple[State, dict]:
        sample_key, train_key = jax.random.split(key)
        idx = engine.sample(sample_key, data)                                      # P_t
        m = idx.shape[0]
        g = core.gather(state.grad_corr, idx)
        opt = engine.opt_states_for(state.opt_state, idx, state.params)
        extra = {"neg_corr": ops.tree_scale(-1.0, g), "anchor": core.broadcast(state.params, m)}
        result = engine.train(data, idx, state.params, opt, train_key, extra=extra,
                              shared_start=True)                                   # line 5
        moved = jax.tree.map(lambda t, p: t - p, result.params, state.params)      # θ_k − θ^{t−1}
        g = jax.tree.map(lambda gk, dk: gk - alpha * dk, g, moved)                 # line 6
        if engine.private:
            # Both server lines use only Σ_k (θ_k − θ^{t−1}) = M·(mean − θ^{t−1}): under
            # --dp-clip they read it from DP-FedAvg's noisy mean update Δ̃ (post-processing).
            noisy, dp_metrics = engine.private_update(state.params, result.params, key, data, idx=idx)
            update = jax.tree.map(jnp.subtract, noisy, state.params)               # Δ̃
            share = engine.expected_clients(data) / data.num_real_clients
            h = jax.tree.map(lambda hs, u: hs - (alpha * share) * u, state.h, update)  # line 9
            params = jax.tree.map(lambda mean, hs: mean - hs / alpha, noisy, h)   # line 10
        else:
            dp_metrics = {}
            h = jax.tree.map(lambda hs, s: hs - alpha / data.num_real_clients * s,  # line 9
                             state.h, core.sum_over_clients(moved))
            params = jax.tree.map(lambda mean, hs: mean - hs / alpha,              # line 10
                                  core.mean_over_clients(result.params), h)
        new_state = State(params, h, core.scatter(state.grad_corr, idx, g),
                          engine.store_opt_states(state.opt_state, idx, result.opt_state),
                          state.round + 1)
        metrics = {**train_metrics(result, idx), **dp_metrics}
        d = ops.tree_size(params)
        metrics.update(engine.communication(idx, data, up_floats_per_client=d,
                                            down_floats_per_client=d))
        metrics["h_norm"] = ops.tree_norm(h)
        return new_state, metrics

    def evaluate(state: State, data, ids=None) -> dict[str, core.ClientEval]:
        return {"client": engine.evaluator.shared(data, state.params, ids)}

    return Algorithm("feddyn", init, round_fn, evaluate, {}, host_state=True)


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
