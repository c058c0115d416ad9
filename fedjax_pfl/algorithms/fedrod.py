"""FedRoD (Chen & Chao, "On Bridging Generic and Personalized Federated Learning for Image
Classification", ICLR 2022, arXiv:2107.00778), the variant with a linear personal head trained
locally (no hypernetwork).

The model splits by path (`models/split.py`) into a body θ (features z = f(x; θ)) and a head
(--fedrod-head, default the last dense layer). The server holds the generic model (θ, ψ): body
and generic head, both federated. Client i also holds a personal head φ_i shaped like ψ. With
g(z; ψ) and p(z; φ_i) the two heads' logits:

    generic loss   L_BSM(θ, ψ) = −log softmax(g(z; ψ) + log π_i)_y     (balanced softmax, eq. 5;
                                                   π_i,c = n_i,c / n_i, client i's class prior)
    personal loss  L_P(φ_i)    = −log softmax(sg[g(z; ψ)] + p(sg[z]; φ_i))_y       sg = stop-gradient
    prediction of client i:      g(z; ψ) + p(z; φ_i)

Per round, each sampled client starts from (θ, ψ, φ_i) and runs E epochs of minibatch SGD on
L_BSM + L_P: (θ, ψ) get the balanced-softmax gradient only and φ_i the personal gradient only,
both at the same pre-step parameters, as the reference code's two optimizer steps per batch
(both from one forward pass, the body features detached for the personal head). The server
averages (θ, ψ) with FedAvg's weights n_i / Σ_{k∈S_t} n_k; unsampled clients keep φ_i.

Evaluated: "client" is g(z; ψ) + p(z; φ_i) on client i's test split; "global" is the generic
model g(f(x; θ); ψ) alone. Communication: (θ, ψ), down to and up from each sampled client.

Readings:
  * Personal head: trained on the detached features AND with the generic logits added
    (detached), as the paper's "personalized prediction = generic + personal logits" and the
    reference code (`out_g.detach() + head(rep.detach())`); the body never sees L_P.
  * The prior π_i is over client i's TRAINING labels. A class the client has no training
    sample of has log π_i,c = −∞: it leaves the client's balanced softmax (its probability is 0,
    its logit gets no gradient), as the reference's log(sample_per_class) does. Its labels never
    occur in that client's batches, so the loss stays finite.
  * φ_i starts as a copy of the initial generic head ψ0 (the reference's deepcopy).
  * Two forward passes evaluate g + p: the model's head is not assumed linear. (For a linear head
    g(z; ψ) + p(z; φ) is the head with parameters ψ + φ; the tests check the identity.)
  * The optimizer is the common client optimizer (the reference FedRoD runs plain SGD).
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
from fedjax_pfl.core.evaluate import Evaluator
from fedjax_pfl.models import split as split_lib
from fedjax_pfl.models.model import Model  # noqa: F401  (type hints)

Params = Any


class State(NamedTuple):
    params: Params        # generic model (θ, ψ)                                    leaves [...]
    heads: Params         # personal heads φ_i (None on body leaves)                 leaves [N, ...]
    class_counts: jax.Array  # n_i,c, training labels per client and class           [N, C] int32
    opt_state: Any        # per-client optimizer states [N, ...] (momentum_buffer=persist), else None
    server: Any           # the server chain's state (Engine.init_server)
    round: jax.Array      # rounds completed; shape=(), int32
    CLIENT_FIELDS = ("heads", "class_counts", "opt_state")  # per-client rows [N, ...]
    # On the devices under --state-placement host: each client's counts differ from the start
    # (the host store shares one initial row), and they are small (N × C int32).
    DEVICE_CLIENT_FIELDS = ("class_counts",)


def log_prior(counts: jax.Array) -> jax.Array:
    """log π_c = log(n_c / Σ_k n_k), and −∞ for a class with n_c = 0; [C] -> [C]."""
    counts = jnp.asarray(counts)
    total = jnp.maximum(jnp.sum(counts), 1).astype(jax.dtypes.canonicalize_dtype(jnp.float64))
    safe = jnp.maximum(counts, 1).astype(total.dtype)
    return jnp.where(counts > 0, jnp.log(safe / total), -jnp.inf)


def balanced_softmax_loss(logits: jax.Array, labels: jax.Array, log_prior_: jax.Array) -> jax.Array:
    """Per-example −log softmax(logits + log π)_y (Ren et al. 2020, FedRoD eq. 5); [B, C], [B], [C]
    -> [B]. Classes with log π = −∞ drop out of the softmax. Per token for a sequence task:
    [B, T, V], [B, T] -> [B, T] (the caller sums the real tokens)."""
    adjusted = logits + log_prior_.astype(logits.dtype)
    return jax.nn.logsumexp(adjusted, axis=-1) - jnp.take_along_axis(
        adjusted, labels[..., None], axis=-1)[..., 0]


def train_label_counts(data) -> jax.Array:
    """[N, C] int32: how many training samples of each class every client holds (jit-able).

    Row r of the dataset belongs to client i's training split iff train_start[i] ≤ r <
    train_start[i] + train_count[i]; the splits are disjoint, so a running sum of +(i+1) at each
    split's start and −(i+1) at its end labels every row with its owner + 1 (0: no train split).
    """
    c = data.clients
    n, num_clients = data.y.shape[0], data.num_clients
    if data.task is not None and data.task.kind == "multilabel":
        raise ValueError("fedrod's balanced softmax needs one label per sample or per token; "
                         f"{data.name} is a multi-label task")
    tag = jnp.arange(1, num_clients + 1, dtype=jnp.int32)
    marks = (jnp.zeros(n + 1, jnp.int32).at[c.train_start].add(tag)
             .at[c.train_start + c.train_count].add(-tag))
    owner = jnp.cumsum(marks)[:n] - 1                                   # −1: not a train row
    y = data.y
    if y.ndim > 1:    # a sequence task: every real token counts; padding (label 0) does not
        owner = jnp.where(y != 0, owner[:, None], -1).reshape(-1)
        y = y.reshape(-1)
    segment = jnp.where(owner >= 0, owner * data.num_classes + y, num_clients * data.num_classes)
    counts = jax.ops.segment_sum(jnp.ones(y.shape[0], jnp.int32), segment,
                                 num_segments=num_clients * data.num_classes + 1)
    return counts[:-1].reshape(num_clients, data.num_classes)


def fedrod(model: Model, config: EngineConfig, *, head: str) -> Algorithm:
    """FedRoD; see the module docstring."""
    template = jax.eval_shape(model.init, jax.random.key(0))
    mask = split_lib.personal_mask(template, head)                     # fails early on a bad regex
    tx = optax.sgd(config.lr, momentum=config.momentum or None)

    def personal_logits(generic: Params, phi: Params, x: jax.Array) -> jax.Array:
        """g(z; ψ) + p(z; φ): the generic model's logits plus the personal head's on the same body."""
        body, _ = split_lib.split(generic, mask)
        return model.apply(generic, x) + model.apply(split_lib.merge(body, phi, mask), x)

    def losses(params, x, y, mask_, prior):
        generic, phi = params
        g = model.apply(generic, x)                                                 # g(z; ψ)
        body = jax.lax.stop_gradient(split_lib.split(generic, mask)[0])             # sg[θ]
        p = model.apply(split_lib.merge(body, phi, mask), x)                        # p(sg[z]; φ)
        bsm = balanced_softmax_loss(g, y, prior)
        if bsm.ndim > 1:                  # per token: each example's sum over its real tokens
            bsm = jnp.sum(jnp.where(y != 0, bsm, 0.0), axis=tuple(range(1, bsm.ndim)))
        personal = model.loss(jax.lax.stop_gradient(g) + p, y)
        return core.masked_mean(model, bsm, y, mask_) + core.masked_mean(model, personal, y, mask_)

    grad_fn = jax.value_and_grad(losses)

    def step(params, opt_state, x, y, mask_, extra):
        """One minibatch: the BSM gradient on (θ, ψ) and the personal gradient on φ_i, one update."""
        loss, grads = grad_fn(params, x, y, mask_, extra["log_prior"])
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    engine = Engine(model, config, optimizer=tx, step_fn=step)
    combined = model._replace(init=model.init, apply=lambda pp, x: personal_logits(pp[0], pp[1], x),
                              name=f"{model.name}+personal head")
    evaluator = Evaluator(combined, batch_size=config.eval_batch_size,
                          mapper=engine.evaluator.mapper, backdoor=engine.evaluator.backdoor)
    generic_size = ops.tree_size(template)

    def init(key: jax.Array, data) -> State:
        params = model.init(key)                   # the same initial model as every algorithm
        phi0 = split_lib.split(params, mask)[1]                                     # φ_i ← ψ0
        n = data.num_clients
        return State(params, core.broadcast(phi0, n), train_label_counts(data),
                     engine.init_opt_rows((params, phi0), n), engine.init_server(params, data),
                     jnp.zeros((), jnp.int32))

    def round_fn(state: State, data, key: jax.Array) -> tuple[State, dict]:
        rnd = engine.begin(data, key)                                              # S_t
        start = (core.broadcast(state.params, rnd.m), core.gather(state.heads, rnd.idx))  # (θ, ψ, φ_i)
        prior = jax.vmap(log_prior)(core.gather(state.class_counts, rnd.idx))
        trained = engine.train(rnd, start, opt_rows=state.opt_state, extra={"log_prior": prior})
        generic, phi = trained.params
        generic_mean, server, agg = engine.aggregate(rnd, state.params, generic,   # (θ, ψ) average
                                                     rnd.train_counts, state.server)
        new_state = State(generic_mean, core.scatter(state.heads, rnd.idx, phi),
                          state.class_counts, trained.opt_rows, server, state.round + 1)
        metrics = engine.metrics(rnd, trained, up=generic_size, down=generic_size,  # train_loss:
                                 server=agg)                                        # L_BSM + L_P
        return new_state, metrics

    def evaluate(state: State, data, ids=None) -> dict[str, core.ClientEval]:
        global_eval = engine.evaluator.shared(data, state.params, ids)
        ids = evaluated_ids(data, ids)
        rows = (core.broadcast(state.params, ids.shape[0]), core.gather(state.heads, ids))
        return {"client": evaluator.rows(data, rows, ids), "global": global_eval}

    return engine.algorithm("fedrod", init, round_fn, evaluate, host_state=True)


register(AlgorithmSpec(
    name="fedrod",
    factory=fedrod,
    summary="FedRoD: a generic model trained with the balanced softmax, plus a personal head on "
            "its detached features; each client predicts with the sum of both heads",
    hparams=(
        HParam("head", str, "head",
                    "the head: the generic head ψ (federated) and each client's personal head "
                    "φ_i have its shape; 'head' (the last dense layer) or a regex searched in "
                    "each leaf path such as 'Dense_1/'",
                    check=Check(split_lib.is_pattern, "'head', 'all', 'none' or a regex")),
    ),
    # The tests' linear model {w, b}: its bias as the head, so both parts are non-empty.
    test_hparams={"head": "^b$"},
    private_uplink="each client's update of the generic model (body and generic head); its "
                   "personal head stays on the client, its class counts are never sent",
))
