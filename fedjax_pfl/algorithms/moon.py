"""MOON (Li, He & Song, "Model-Contrastive Federated Learning", CVPR 2021, arXiv:2103.16257),
Algorithm 1; docs/algorithms/moon.md (readings M1–M9 cited below).

State: the global model w and, per client i, its previous local model w_i^prev (the model it
ended its last round with; the initial global model w⁰ until it first trains, M3). Per round
with sampled clients S_t:

  each i ∈ S_t, from w_i ← w (frozen copies of w and w_i^prev alongside):
    E epochs of minibatch SGD on  ℓ = ℓ_sup(w_i) + μ ℓ_con(w_i)                  (eq. 3)
      ℓ_con = −log( e^{sim(z, z_glob)/τ} / (e^{sim(z, z_glob)/τ} + e^{sim(z, z_prev)/τ}) )  (eq. 2)
      z = R_{w_i}(x), z_glob = R_w(x), z_prev = R_{w_i^prev}(x)
      sim(a, b) = a·b / (max(‖a‖, ε) max(‖b‖, ε)), ε = 1e-8 (cosine similarity, as torch's)
    w_i^prev ← w_i (what it trained);  unsampled clients keep theirs                     (M4)
  w ← Σ_{i∈S_t} (n_i / Σ_{k∈S_t} n_k) w_i                      FedAvg's weighted mean

R_w(x) is the representation: the input of the head, the model's last Dense layer
(`Model.features`, the engine's split), not a projection head (M1). Both ℓ_sup and ℓ_con are
the engine's masked mean over a minibatch's real examples (padded ones never count); for a
per-token model (z [B, T, H]) ℓ_con is computed at every position and averaged over the real
target tokens, as the supervised loss is (M2). μ = 0 is FedAvg (same sampling, keys, batches).
Evaluated: the global model on every client's test split, as FedAvg. Communication: d floats
down to and up from each sampled client (w_i^prev never leaves the client).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_pfl import core, ops
from fedjax_pfl.algorithms.engine import Engine, EngineConfig
from fedjax_pfl.algorithms.interface import Algorithm
from fedjax_pfl.algorithms.registry import NON_NEGATIVE, POSITIVE, AlgorithmSpec, HParam, register
from fedjax_pfl.data.natural import PAD
from fedjax_pfl.models.model import Model

Params = Any
COSINE_EPS = 1e-8


class State(NamedTuple):
    params: Params        # global model w                                         leaves [...]
    prev: Params          # previous local models w_i^prev (w⁰ before the first round)  [N, ...]
    opt_state: Any        # per-client optimizer states (momentum_buffer=persist) [N, ...], else None
    server: Any           # the server chain's state (Engine.init_server)
    round: jax.Array      # rounds completed; shape=(), int32
    CLIENT_FIELDS = ("prev", "opt_state")  # per-client rows [N, ...]


def cosine_similarity(a: jax.Array, b: jax.Array, eps: float = COSINE_EPS) -> jax.Array:
    """a·b / (max(‖a‖, ε) max(‖b‖, ε)) over the last axis; [..., H], [..., H] -> [...].

    The norm is sqrt(max(Σ a², ε²)), so a zero representation (a dead ReLU layer) has a finite
    gradient."""
    norm = lambda v: jnp.sqrt(jnp.maximum(jnp.sum(v * v, axis=-1), eps * eps))
    return jnp.sum(a * b, axis=-1) / (norm(a) * norm(b))


def contrastive_loss(z: jax.Array, z_glob: jax.Array, z_prev: jax.Array, tau: float) -> jax.Array:
    """MOON eq. 2 per unit: −log softmax([sim(z, z_glob), sim(z, z_prev)] / τ)₀; [..., H]³ -> [...].

    The positive pair (the global model's representation) is class 0 of a two-way softmax, the
    negative (the previous local model's) class 1, as the reference's cross-entropy with label 0.
    """
    logits = jnp.stack([cosine_similarity(z, z_glob), cosine_similarity(z, z_prev)], axis=-1) / tau
    return jax.nn.logsumexp(logits, axis=-1) - logits[..., 0]


def _as_float(z: jax.Array) -> jax.Array:
    # A head whose input is the raw input (tag_logreg's token ids): compare it as floats (M6).
    return z if jnp.issubdtype(z.dtype, jnp.floating) else z.astype(jnp.float32)


def per_example_contrastive(z: jax.Array, z_glob: jax.Array, z_prev: jax.Array, y: jax.Array,
                            tau: float) -> jax.Array:
    """[B]: each example's ℓ_con, summed over the units it counts, like `Model.loss` (M2).

    z [B, H] (one representation per example): eq. 2 on it. z [B, T, H] with per-token labels
    y [B, T]: eq. 2 at every position, summed over the real targets (y ≠ PAD), so that the
    engine's masked mean divides by the batch's real tokens (`Model.weight`). Any other
    per-position shape is refused (it would have no defined weight)."""
    z, z_glob, z_prev = _as_float(z), _as_float(z_glob), _as_float(z_prev)
    b = z.shape[0]
    if z.ndim > 2 and y.ndim >= 2 and z.shape[:-1] == y.shape:            # per token
        per_unit = contrastive_loss(z, z_glob, z_prev, tau)
        return jnp.sum(jnp.where(y != PAD, per_unit, 0.0), axis=tuple(range(1, y.ndim)))
    if z.ndim > 2:
        raise ValueError(f"moon: the representation has shape {tuple(z.shape)} and the labels "
                         f"{tuple(y.shape)}; a per-position representation needs per-position "
                         "labels of shape z.shape[:-1] (a sequence task)")
    return contrastive_loss(z.reshape(b, -1), z_glob.reshape(b, -1), z_prev.reshape(b, -1), tau)


def moon_loss(model: Model, params: Params, global_params: Params, prev_params: Params,
              x: jax.Array, y: jax.Array, mask: jax.Array, *, mu: float, tau: float
              ) -> tuple[jax.Array, jax.Array]:
    """(ℓ_sup + μ ℓ_con, ℓ_con) on one padded minibatch (eq. 3), each the engine's masked mean
    over the real examples (tokens). Gradients flow through `params` only: the global and the
    previous model are frozen (their representations are constants, M5)."""
    z_glob = jax.lax.stop_gradient(model.features(global_params, x))
    z_prev = jax.lax.stop_gradient(model.features(prev_params, x))
    both = getattr(model.features, "with_outputs", None)     # one forward pass (model.head_input)
    outputs, z = (both(params, x) if both is not None
                  else (model.apply(params, x), model.features(params, x)))
    sup = core.masked_mean(model, model.loss(outputs, y), y, mask)
    con = core.masked_mean(model, per_example_contrastive(z, z_glob, z_prev, y, tau), y, mask)
    return sup + mu * con, con


class _Carry(NamedTuple):
    """What local training carries per client: the model and the running Σ ℓ_con (a metric)."""

    params: Params
    con_sum: jax.Array    # shape=()


def moon(model: Model, config: EngineConfig, *, mu: float = 1.0, tau: float = 0.5
         ) -> Algorithm:
    """MOON; see the module docstring. μ weighs the model-contrastive loss, τ its temperature."""
    if model.features is None:
        raise ValueError(
            f"moon needs the model's representation (Model.features, the input of its head); "
            f"{model.name!r} has none: build it with models.from_flax / models.get, or pass "
            "features=(params, x) -> z to Model")
    tx = optax.sgd(config.lr, momentum=config.momentum or None)
    grad_fn = jax.value_and_grad(
        lambda p, g, pv, x, y, m: moon_loss(model, p, g, pv, x, y, m, mu=mu, tau=tau), has_aux=True)

    def step(carry: _Carry, opt_state, x, y, mask, extra):
        """One minibatch of eq. 3; the frozen models arrive per client in `extra`."""
        w = carry.params
        as_w = lambda tree: jax.tree.map(lambda a, b: a.astype(b.dtype), tree, w)  # bf16 rows
        (loss, con), grads = grad_fn(w, as_w(extra["global"]), as_w(extra["prev"]), x, y, mask)
        updates, opt_state = tx.update(grads, opt_state, w)
        return _Carry(optax.apply_updates(w, updates), carry.con_sum + con), opt_state, loss

    engine = Engine(model, config, optimizer=tx, step_fn=step)

    def init(key: jax.Array, data) -> State:
        params = model.init(key)          # the same initial model as every algorithm from this key
        n = data.num_clients
        return State(params, core.broadcast(params, n),                           # w_i^prev ← w⁰ (M3)
                     engine.init_opt_rows(params, n), engine.init_server(params, data),
                     jnp.zeros((), jnp.int32))

    def round_fn(state: State, data, key: jax.Array) -> tuple[State, dict]:
        rnd = engine.begin(data, key)                                              # S_t
        w = state.params
        extra = {"global": core.broadcast(w, rnd.m), "prev": core.gather(state.prev, rnd.idx)}
        result = engine.train(rnd, _Carry(w, jnp.zeros(())), opt_rows=state.opt_state,  # w_i ← w,
                              opt_like=w, extra=extra, shared_start=True)          # E epochs, eq. 3
        trained = result.params.params
        params, server, agg = engine.aggregate(rnd, w, trained, rnd.train_counts,  # Σ (n_i/n) w_i
                                               state.server)
        prev = core.scatter(state.prev, rnd.idx, trained)                          # w_i^prev (M4)
        new_state = State(params, prev, result.opt_rows, server, state.round + 1)
        d = ops.tree_size(params)
        metrics = engine.metrics(rnd, result, up=d, down=d, server=agg)            # ℓ_sup + μ ℓ_con
        took_steps = result.num_steps > 0
        per_client = result.params.con_sum / jnp.maximum(result.num_steps, 1)      # mean ℓ_con
        metrics["contrastive_loss"] = (jnp.sum(jnp.where(took_steps, per_client, 0.0))
                                       / jnp.maximum(jnp.sum(took_steps), 1))
        return new_state, metrics

    def evaluate(state: State, data, ids=None) -> dict[str, core.ClientEval]:
        return {"client": engine.evaluator.shared(data, state.params, ids)}

    return engine.algorithm("moon", init, round_fn, evaluate, host_state=True)


register(AlgorithmSpec(
    name="moon", factory=moon,
    summary="MOON: local loss + μ · model-contrastive loss pulling the representation towards "
            "the global model's and away from the client's previous model's; global model evaluated",
    hparams=(
        HParam("mu", float, 1.0,
                    "μ, weight of the model-contrastive loss in each client's local objective; 0 "
                    "is FedAvg. Default 1: the reference code's default and the paper's choice "
                    "for CIFAR-100 and Tiny-ImageNet (5 for CIFAR-10; grid {0.1, 1, 5, 10})",
                    check=NON_NEGATIVE),
        HParam("tau", float, 0.5,
                    "τ, temperature of the contrastive two-way softmax (the paper's 0.5)",
                    check=POSITIVE),
    ),
    traceable=("lr", "mu", "tau"),
    test_hparams={"momentum": 0.9, "momentum_buffer": "persist"},
    private_uplink="each client's model update; its previous model (the contrastive anchor) "
                   "stays on the client",
))
