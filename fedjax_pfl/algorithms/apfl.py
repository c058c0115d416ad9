"""APFL (Deng, Kamani & Mahdavi, "Adaptive Personalized Federated Learning", arXiv:2003.13461,
2020), Algorithm 1 with the adaptive mixing weight of eq. (10).

Each client k keeps a local model v_k and a mixing weight α_k ∈ [0, 1]; the server keeps the
global model w. Its personalised model is the mixture

    v̄_k = α_k v_k + (1 − α_k) w.

Per round, each sampled client starts its copy w_k from w and, at every local minibatch step
with batch B (all gradients at the pre-step point, the same batch):

    w_k ← w_k − η ∇f_k(w_k; B)                                   (Algorithm 1, line 6)
    v_k ← v_k − η ∇_v f_k(v̄; B) = v_k − η α_k ∇f_k(v̄; B)          (line 7), v̄ = α_k v_k + (1−α_k) w_k
    α_k ← Π_[0,1](α_k − η_α ⟨∇f_k(v̄; B), v_k − w_k⟩)              (eq. 10: ∂f(v̄)/∂α)

and the server takes FedAvg's sample-weighted mean of the w_k. Unsampled clients keep v_k, α_k.

Readings:
  * ∇_v and ∂/∂α come from one reverse pass through f_k(α v + (1 − α) w_k) with respect to
    (v, α) (tests check them against the closed forms α∇f(v̄) and ⟨∇f(v̄), v − w⟩).
  * w and v share one optimizer, sgd(η, momentum) on the pair; α takes plain projected SGD with
    --apfl-alpha-lr (0: α fixed at --apfl-alpha, the PGFed code's APFL, whose α is a tuned constant).
  * Aggregation is FedAvg's sample-weighted mean (the paper's Algorithm 1 averages uniformly;
    the authors' code weights by samples).
  * Evaluated: v̄_k = α_k v_k + (1 − α_k) w with the current global w (what client k would use
    on receiving w), as "client"; w as "global". train_loss is f_k(w_k; B).
Communication: w down and w_k up for each sampled client (d floats each way).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_pfl import core, ops
from fedjax_pfl.algorithms.engine import Engine, EngineConfig
from fedjax_pfl.algorithms.interface import Algorithm, evaluated_ids
from fedjax_pfl.algorithms.registry import NON_NEGATIVE, UNIT_CLOSED, AlgorithmSpec, HParam, register
from fedjax_pfl.core.local import masked_mean_loss
from fedjax_pfl.models.model import Model

Params = Any


class State(NamedTuple):
    params: Params     # global model w                                       leaves [...]
    local: Params      # local models v_k                                     leaves [N, ...]
    alpha: jax.Array   # mixing weights α_k                                   [N]
    opt_state: Any     # per-client optimizer states of (w_k, v_k) (persist), else None
    server: Any        # the server chain's state (Engine.init_server)
    round: jax.Array   # rounds completed; shape=(), int32
    CLIENT_FIELDS = ("local", "alpha", "opt_state")  # per-client rows [N, ...]
    # On the devices under --state-placement host: the α statistics read every client's α.
    DEVICE_CLIENT_FIELDS = ("alpha",)


def mixed_gradients(loss_fn, w: Params, v: Params, alpha: jax.Array):
    """(f(v̄), ∇_v f(v̄), ∂f(v̄)/∂α) at v̄ = α v + (1 − α) w, one reverse pass."""
    return jax.value_and_grad(lambda v_, a_: loss_fn(ops.tree_lerp(w, v_, a_)), argnums=(0, 1))(
        v, alpha)


def apfl(model: Model, config: EngineConfig, *, alpha: float, alpha_lr: float
         ) -> Algorithm:
    """APFL; see the module docstring."""
    inner = optax.sgd(config.lr, momentum=config.momentum or None)

    def apfl_step(params, opt_state, x, y, mask, extra):
        """One minibatch: SGD on w_k and v_k, projected SGD on α_k (module docstring)."""
        del extra
        w, v, a = params
        loss_fn = lambda p: masked_mean_loss(model, p, x, y, mask)
        loss, g_w = jax.value_and_grad(loss_fn)(w)
        _, (g_v, g_a) = mixed_gradients(loss_fn, w, v, a)
        updates, opt_state = inner.update((g_w, g_v), opt_state, (w, v))
        w, v = optax.apply_updates((w, v), updates)
        a = jnp.clip(a - alpha_lr * g_a, 0.0, 1.0).astype(a.dtype)
        return (w, v, a), opt_state, loss

    engine = Engine(
        model, config, step_fn=apfl_step,
        optimizer=optax.GradientTransformation(lambda p: inner.init((p[0], p[1])), _unused))

    def init(key: jax.Array, data) -> State:
        params = model.init(key)
        n, dtype = data.num_clients, jax.tree.leaves(params)[0].dtype
        alphas = jnp.full((n,), alpha, dtype)                      # α_k in the model's precision
        return State(params, core.broadcast(params, n), alphas,
                     engine.init_opt_rows((params, params, alphas[0]), n),
                     engine.init_server(params, data), jnp.zeros((), jnp.int32))

    def round_fn(state: State, data, key: jax.Array) -> tuple[State, dict]:
        rnd = engine.begin(data, key)
        idx = rnd.idx
        start = (core.broadcast(state.params, rnd.m), core.gather(state.local, idx),
                 core.gather(state.alpha, idx))                                  # w_k ← w
        trained = engine.train(rnd, start, opt_rows=state.opt_state)
        w_k, v_k, a_k = trained.params
        params, server, agg = engine.aggregate(rnd, state.params, w_k, rnd.train_counts,
                                               state.server)
        new_state = State(params, core.scatter(state.local, idx, v_k),
                          core.scatter(state.alpha, idx, a_k), trained.opt_rows, server,
                          state.round + 1)
        d = ops.tree_size(params)
        metrics = engine.metrics(rnd, trained, up=d, down=d, server=agg)
        real = data.num_real_clients
        metrics.update(alpha_mean=jnp.mean(new_state.alpha[:real]),
                       alpha_min=jnp.min(new_state.alpha[:real]),
                       alpha_max=jnp.max(new_state.alpha[:real]))
        return new_state, metrics

    def evaluate(state: State, data, ids=None) -> dict[str, core.ClientEval]:
        ids = evaluated_ids(data, ids)
        mixed = jax.vmap(ops.tree_lerp, in_axes=(None, 0, 0))(
            state.params, core.gather(state.local, ids), core.gather(state.alpha, ids))
        return {"client": engine.evaluator.rows(data, mixed, ids),
                "global": engine.evaluator.shared(data, state.params, ids)}

    return engine.algorithm("apfl", init, round_fn, evaluate, host_state=True)


def _unused(updates, state, params=None):
    raise NotImplementedError("APFL's local step is its own step_fn")


register(AlgorithmSpec(
    name="apfl", factory=apfl,
    summary="APFL: per-client mixture α v + (1−α) w of a local and the global model, α learned",
    hparams=(
        HParam("alpha", float, 0.5,
                    "initial mixing weight α_k of every client's local model (the paper's and "
                    "the middle of the PGFed code's grid {0.25, 0.5, 0.75})",
                    check=UNIT_CLOSED),
        HParam("alpha_lr", float, 0.05,
                    "η_α, step size of the projected SGD on α_k (0 keeps α fixed, as in the PGFed "
                    "code). Default 0.05: the default lr, as the paper uses one step size",
                    check=NON_NEGATIVE),
    ),
    traceable=("lr", "alpha_lr"),
    test_hparams={},
    private_uplink="each client's update of the global model w; its local model v and mixing "
                   "weight α stay on the client",
))
