"""FedALA (Zhang, Hua, Wang, Song, Xue, Ma & Guan, "FedALA: Adaptive Local Aggregation for
Personalized Federated Learning", AAAI 2023, arXiv:2212.01197, Algorithm 1 lines 6–16);
docs/algorithms/fedala.md (readings R1–R9 cited below).

Each client i keeps its local model θ_i and element-wise aggregation weights W_i ∈ [0, 1] for the
top p layers of the model (R1). Per round t, each sampled client i, given the global model θ:

  ALA (adaptive local aggregation), on a random s % of its training data D_i^s (R3):
    θ̂_i(W) = θ_i + (θ − θ_i) ⊙ W   on the top p layers,   θ̂_i = θ   on the lower layers   (eq. 4)
    W ← clip(W − η ∇_W L(θ̂_i(W); B), 0, 1)   for the minibatches B of D_i^s                 (eq. 5)
      ∇_W L = ∇_θ̂ L ⊙ (θ − θ_i)   (chain rule through eq. 4; what jax.grad of W gives)
    one pass over D_i^s, except in the client's first ALA (its "start phase"), where passes
    repeat until the losses settle: the std of the last --fedala-patience pass losses
    < --fedala-threshold, or --fedala-max-epochs passes (R4, R5)
  local training: the engine's local SGD on F_i from θ̂_i(W_i)  → θ_i
server: θ ← Σ_{i∈S_t} (n_i / Σ_{k∈S_t} n_k) θ_i   (FedAvg's sample weights, as the authors' code)

W_i starts at ones (θ̂_i = θ) and persists across rounds (R2). A client's first participation
skips ALA: it has no local model yet and starts from θ (R6). Unsampled clients keep θ_i, W_i.
The W steps of a client are one `core.ClientLoop` (`ala_loop`) that the engine maps over the
sampled clients (`Engine.run_loop`: vmapped, chunked or looped like local training), never a
Python loop over clients.
Evaluated: each client's θ_i after its last local training ("client"; the shared initial model
for clients never sampled) and θ ("global"). Communication: θ down and θ_i up, d floats each.
"""

from __future__ import annotations

import re
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_pfl import core, ops
from fedjax_pfl.algorithms.engine import Engine, EngineConfig, client_keys
from fedjax_pfl.algorithms.interface import Algorithm
from fedjax_pfl.algorithms.registry import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, AlgorithmSpec, Check, HParam, register
from fedjax_pfl.data.federated import ClientSplits
from fedjax_pfl.models import split as split_lib
from fedjax_pfl.models.model import Model

Params = Any


class State(NamedTuple):
    params: Params        # local models θ_i (after their last local training)   leaves [N, ...]
    weights: Params       # ALA weights W_i on the top layers (None on lower)     leaves [N, ...]
    started: jax.Array    # client i has trained before (has a local model)       [N] bool
    warm: jax.Array       # client i's start-phase ALA is done                    [N] bool
    opt_state: Any        # per-client optimizer states (momentum_buffer=persist) [N, ...], else None
    global_params: Params  # global model θ                                        leaves [...]
    server: Any           # the server chain's state (Engine.init_server)
    round: jax.Array      # rounds completed; shape=(), int32
    CLIENT_FIELDS = ("params", "weights", "started", "warm", "opt_state")  # rows [N, ...]


# ----------------------------------------------------------------------------------------------
# Which parameters are "the top p layers" (R1)


def _natural_key(name: str) -> list:
    """Digit runs compared as numbers: Dense_2 < Dense_10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def layer_of(path: str) -> str:
    """The layer a leaf belongs to: its path without the last component ("Dense_1/kernel" →
    "Dense_1"); a top-level leaf ("w") is a layer of its own."""
    return path.rsplit("/", 1)[0] if "/" in path else path


def top_layers_mask(params: Params, p: int) -> Params:
    """A pytree of bools shaped like `params`: True on the leaves of the top p layers.

    Layers (`layer_of`) are ordered by their paths with digits compared as numbers, which is the
    forward order of this package's models (Conv2D_0 < Conv2D_1 < Dense_0 < Dense_1; the ResNets'
    ConvNormReLU_k < Dense_0); the top p are the last p. p = 1 is the classifier head, the
    authors' layer_idx = 2 (the last linear layer's weight and bias). p ≥ the number of layers
    puts every parameter under ALA (no lower layers).
    """
    if p < 1:
        raise ValueError(f"--fedala-layers must be >= 1, got {p}")
    paths = split_lib.leaf_paths(params)
    layers = sorted({layer_of(path) for path in paths}, key=_natural_key)
    top = set(layers[-p:])
    return jax.tree.unflatten(jax.tree.structure(params), [layer_of(path) in top for path in paths])


# ----------------------------------------------------------------------------------------------
# The local aggregation (eq. 4) and one ALA step (eq. 5), for ONE client


def local_aggregation(global_params: Params, local_top: Params, weights: Params,
                      top: Params) -> Params:
    """θ̂ (eq. 4): θ_i + (θ − θ_i) ⊙ W on the leaves where `top` is True, θ on the others.

    `local_top` and `weights` hold the top leaves (None on the lower ones, `split_lib.split`'s
    holes). W = 1 gives θ, W = 0 gives θ_i."""
    return jax.tree.map(
        lambda t, g, l, w: (l + (g - l) * w).astype(g.dtype) if t else g,
        top, global_params, local_top, weights)


def ala_step(model: Model, top: Params, eta, global_params: Params, local_top: Params,
             weights: Params, x: jax.Array, y: jax.Array, mask: jax.Array
             ) -> tuple[Params, jax.Array]:
    """(W ← clip(W − η ∇_W L(θ̂(W); B), 0, 1), L(θ̂(W); B)) for one minibatch B (eq. 5).

    L is the masked mean loss of the batch (`core.masked_mean_loss`); ∇_W L = ∇_θ̂ L ⊙ (θ − θ_i)
    by the chain rule through `local_aggregation`."""

    def loss_of(w):
        return core.masked_mean_loss(model, local_aggregation(global_params, local_top, w, top),
                                     x, y, mask)

    loss, grad = jax.value_and_grad(loss_of)(weights)
    new = jax.tree.map(lambda w, g: jnp.clip(w - eta * g, 0.0, 1.0).astype(w.dtype), weights, grad)
    return new, loss


# ----------------------------------------------------------------------------------------------
# The ALA weight learning of one client, as a ClientLoop the engine maps over the clients


class AlaRow(NamedTuple):
    """One client's inputs to ALA (a row of the mapped arguments)."""

    local_top: Params     # θ_i on the top layers
    weights: Params       # W_i on entry
    client: ClientSplits  # where its samples are
    key: jax.Array        # picks the s % subset D_i^s
    passes: jax.Array     # passes over D_i^s at most: 0 (skip), 1, or the start phase's cap


class AlaCarry(NamedTuple):
    row: AlaRow           # (its weights the current W)
    epoch_loss: jax.Array  # Σ of this pass's minibatch losses so far; shape=()
    history: jax.Array     # the last `patience` pass losses (ring buffer); [patience]
    epochs: jax.Array      # passes completed while still learning; shape=() int32
    done: jax.Array        # W has settled (or its pass budget is spent); shape=() bool


class AlaResult(NamedTuple):
    weights: Params       # W_i after ALA
    epochs: jax.Array     # passes that updated W (0 for a skipped client); int32
    loss: jax.Array       # mean minibatch loss of the last pass (0 if none); float32


def subset_size(count: jax.Array, rand_percent: float) -> jax.Array:
    """|D_i^s| = max(1, ⌊s/100 · n_i⌋) for a client with data, else 0 (the authors' int(s·n) can
    be 0 for a tiny client, which their loop cannot handle)."""
    count = jnp.asarray(count, jnp.int32)
    k = jnp.floor(count.astype(jnp.float32) * (rand_percent / 100.0)).astype(jnp.int32)
    return jnp.where(count > 0, jnp.clip(k, 1, count), 0)


def ala_loop(model: Model, top: Params, *, eta, rand_percent: float, batch_size: int,
             threshold: float, patience: int) -> tuple[core.ClientLoop, Callable]:
    """ALA's weight learning for one client (R3–R5), as a `core.ClientLoop` over the shared
    (data, θ), and one step of it (the probe of the automatic chunk size).

    Client i draws D_i^s: the first |D_i^s| positions of a keyed random permutation of its n_i
    training samples (`core.epoch_permutation`), fixed for the round, visited in that order in
    ⌈|D_i^s|/B⌉ minibatches per pass (the last one masked). A pass ends with its mean minibatch
    loss recorded; a client with `passes` = P stops updating W after P passes, or earlier once it
    has more than `patience` pass losses and the std of the last `patience` is < `threshold`
    (population std, as np.std). Steps after that leave W unchanged (the loop's length is fixed
    per client up front: P passes)."""
    percent, batch = float(rand_percent), int(batch_size)

    def per_pass(count):
        return core.steps_per_epoch(subset_size(count, percent), batch)

    def init(shared, row: AlaRow) -> AlaCarry:
        return AlaCarry(row, jnp.zeros(()), jnp.zeros((patience,)), jnp.zeros((), jnp.int32),
                        row.passes <= 0)

    def step(shared, carry: AlaCarry, t) -> AlaCarry:
        data, global_params = shared
        row = carry.row
        client = row.client
        k = subset_size(client.train_count, percent)
        batches = jnp.maximum(per_pass(client.train_count), 1)
        b = t % batches
        positions = b * batch + jnp.arange(batch)
        mask = positions < k                                       # D_i^s: the first k positions
        rows = client.train_start + core.epoch_permutation(row.key, client.train_count, positions)
        new_w, loss = ala_step(model, top, eta, global_params, row.local_top, row.weights,
                               data.inputs(rows), data.labels(rows), mask)
        weights = jax.tree.map(lambda n, o: jnp.where(carry.done, o, n), new_w, row.weights)
        epoch_loss = carry.epoch_loss + jnp.where(carry.done, 0.0, loss)
        # End of a pass: record its mean loss, then stop after the budget or on convergence.
        last = (b == batches - 1) & ~carry.done
        mean = epoch_loss / batches
        history = jnp.where(last, jnp.roll(carry.history, -1).at[-1].set(mean), carry.history)
        epochs = carry.epochs + last.astype(jnp.int32)
        settled = (epochs > patience) & (jnp.std(history) < threshold)
        done = carry.done | (last & ((epochs >= row.passes) | settled))
        return AlaCarry(row._replace(weights=weights), jnp.where(last, 0.0, epoch_loss), history,
                        epochs, done)

    def finish(shared, carry: AlaCarry) -> AlaResult:
        loss = jnp.where(carry.epochs > 0, carry.history[-1], 0.0)
        return AlaResult(carry.row.weights, carry.epochs, loss.astype(jnp.float32))

    def length(row: AlaRow):
        return row.passes * per_pass(row.client.train_count)

    def probe(data, global_params, row):
        shared = (data, global_params)
        return step(shared, init(shared, row), jnp.zeros((), jnp.int32))

    return core.ClientLoop(init, step, finish, length), probe


def weight_statistics(weights: Params) -> dict[str, jax.Array]:
    """The sampled clients' W after ALA, summarised as PGFed summarises its α: mean, min, and the
    fractions of entries at 0 (take θ_i) and at 1 (take θ)."""
    flat = jnp.concatenate([w.reshape(-1) for w in jax.tree.leaves(weights)])
    return {"ala_w_mean": jnp.mean(flat), "ala_w_min": jnp.min(flat),
            "ala_w_frac_zero": jnp.mean(flat <= 0.0), "ala_w_frac_one": jnp.mean(flat >= 1.0)}


# ----------------------------------------------------------------------------------------------
# The algorithm


def fedala(model: Model, config: EngineConfig, *, layers: int, rand_percent: float,
           eta: float, threshold: float, patience: int, max_epochs: int) -> Algorithm:
    """FedALA; see the module docstring."""
    if max_epochs <= patience:
        raise ValueError(f"--fedala-max-epochs must be > --fedala-patience ({patience}): the start "
                         f"phase needs more than {patience} pass losses to test them, "
                         f"got {max_epochs}")
    engine = Engine(model, config)
    template = jax.eval_shape(model.init, jax.random.key(0))
    top = top_layers_mask(template, layers)
    loop, probe = ala_loop(model, top, eta=eta, rand_percent=rand_percent,
                           batch_size=config.batch_size, threshold=threshold, patience=patience)
    run_ala = engine.run_loop(loop, probe=probe, stage="adaptive local aggregation")

    def init(key: jax.Array, data) -> State:
        params = model.init(key)
        n = data.num_clients
        ones = jax.tree.map(jnp.ones_like, split_lib.split(params, top)[1])          # W_i = 1 (R2)
        return State(core.broadcast(params, n), core.broadcast(ones, n), jnp.zeros(n, bool),
                     jnp.zeros(n, bool), engine.init_opt_rows(params, n), params,
                     engine.init_server(params, data), jnp.zeros((), jnp.int32))

    def round_fn(state: State, data, key: jax.Array) -> tuple[State, dict]:
        rnd = engine.begin(data, key)                                                # S_t
        idx, theta = rnd.idx, state.global_params
        local_top = split_lib.split(core.gather(state.params, idx), top)[1]          # θ_i, top
        started = core.gather(state.started, idx)
        warm = core.gather(state.warm, idx)
        # Passes over D_i^s: none on a first participation (R6), the start phase's budget on
        # the first ALA (R4), one afterwards (R5).
        passes = jnp.where(~started, 0, jnp.where(warm, 1, max_epochs)).astype(jnp.int32)
        ala_key = jax.random.fold_in(rnd.keys["train"], 1)
        rows = AlaRow(local_top, core.gather(state.weights, idx), core.gather(data.clients, idx),
                      client_keys(ala_key, idx), passes)
        result = run_ala((data, theta), rows, idx)                                   # eq. 5
        start = jax.vmap(lambda l, w: local_aggregation(theta, l, w, top))(
            local_top, result.weights)                                               # eq. 4
        start = core.where_clients(started, start, core.broadcast(theta, rnd.m))     # R6
        trained = engine.train(rnd, start, opt_rows=state.opt_state)                 # θ_i
        theta_next, server, agg = engine.aggregate(rnd, theta, trained.params,       # θ, FedAvg
                                                   rnd.train_counts, state.server)
        new_state = State(core.scatter(state.params, idx, trained.params),
                          core.scatter(state.weights, idx, result.weights),
                          core.scatter(state.started, idx, jnp.ones(rnd.m, bool)),
                          core.scatter(state.warm, idx, started),                   # R4
                          trained.opt_rows, theta_next, server, state.round + 1)
        d = ops.tree_size(theta)
        metrics = engine.metrics(rnd, trained, up=d, down=d, server=agg)
        metrics.update(weight_statistics(result.weights))
        ran = result.epochs > 0
        metrics["ala_epochs"] = jnp.mean(result.epochs.astype(jnp.float32))
        metrics["ala_loss"] = (jnp.sum(jnp.where(ran, result.loss, 0.0))
                               / jnp.maximum(jnp.sum(ran), 1))          # over clients that ran ALA
        return new_state, metrics

    evaluate, parts = engine.evaluation(personal=lambda state: state.params,
                                        shared=lambda state: state.global_params)
    return engine.algorithm("fedala", init, round_fn, evaluate, parts, host_state=True)


register(AlgorithmSpec(
    name="fedala", factory=fedala,
    summary="FedALA: each client starts local training from θ_i + (θ − θ_i) ⊙ W_i on the top "
            "layers (θ below), W_i ∈ [0, 1] learned element-wise on a fraction of its data; "
            "FedAvg of the local models; local models evaluated",
    hparams=(
        HParam("layers", int, 1,
                    "p, the top layers under adaptive aggregation (a layer: the module holding "
                    "a parameter, e.g. Dense_1; ordered by path, the last p); the lower layers "
                    "take the global model. 1 = the classifier head, the authors' layer_idx 2",
                    check=AT_LEAST_ONE),
        HParam("rand_percent", float, 80.0,
                    "s, the percentage of each client's training samples (drawn at random each "
                    "round) that ALA learns W on (the authors' default 80)",
                    check=Check(lambda v: 0 < v <= 100, "in (0, 100]")),
        HParam("eta", float, 1.0,
                    "η, the step size of W ← clip(W − η ∇_W L, 0, 1) (the authors' default 1)",
                    check=POSITIVE),
        HParam("threshold", float, 0.1,
                    "start phase (a client's first ALA): W is trained until the std of the last "
                    "--fedala-patience pass losses is below this (the authors' ALA default 0.1)",
                    check=NON_NEGATIVE),
        HParam("patience", int, 10,
                    "number of recent pass losses whose std is tested in the start phase (the "
                    "authors' num_pre_loss 10)",
                    check=AT_LEAST_ONE),
        HParam("max_epochs", int, 20,
                    "start phase cap: at most this many passes over the subset (ours; the "
                    "authors loop until convergence); must be > --fedala-patience",
                    check=AT_LEAST_ONE),
    ),
    traceable=("lr", "eta"),
    # The tests' linear model {w, b}: layers b < w, so p = 1 puts w under ALA and b below.
    test_hparams={"momentum": 0.5, "momentum_buffer": "persist", "patience": 2,
                  "max_epochs": 3},
    private_uplink="each client's trained model minus the global model θ; its local model and "
                   "ALA weights stay on the client",
))
