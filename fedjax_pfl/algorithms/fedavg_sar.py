"""FedAvg (s.a.r.): FedAvg whose transmissions carry a random 1/CR of the coordinates, TDPFed's
compression baseline ("selected at random", Wang et al. arXiv:2208.12959 Section VII-D;
docs/algorithms/fedavg_sar.md).

Per round, with global model w and sampled clients S:
  downlink: client i receives m_i ⊙ w + (1 − m_i) ⊙ fill_i,   m_i a fresh random mask
  local training from that model (as FedAvg);                  gives w_i
  uplink:   the server receives m'_i ⊙ w_i + (1 − m'_i) ⊙ fill'_i, m'_i another fresh mask
  w ← Σ_{i∈S} (n_i / Σ_S n) · received_i

Unsent coordinates (`mask_fill`): "keep" (default: the receiver's old value, the client's own
model from its last round and the server's current w; it trains: 0.89 best mean accuracy on the
embedded digits in the default 50 rounds) or "zero" (they arrive as 0: the paper's remark that
zeroed positions still need encoding, which explains FedAvg (s.a.r.)'s collapse on CIFAR-10; with
CR = 2 half of every model is zeroed each way, and on digits it stays at chance, 0.13 best).
Use "zero" to reproduce the paper's baseline numbers.
Under --dp-clip (docs/privacy.md) the server step is DP-FedAvg's on received_i − w (uniform
weights, the fixed denominator M): w ← w + (Σ_i clip_C(received_i − w) + N(0, z²C²))/M; with
"keep" that is the masked update m'_i ⊙ (w_i − w), and the noise covers every coordinate.
Masks (`mask`): "bernoulli" (default: each coordinate sent with probability 1/CR, a fresh mask per
transmission) or "fixed" (exactly round(d/CR) coordinates). Only the values of sent coordinates
count as communicated floats (`comm_up_floats`, `comm_down_floats`); their positions could be
sent as a shared seed and are not counted.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_pfl import core, ops
from fedjax_pfl.algorithms.engine import Engine, EngineConfig, client_keys, communication
from fedjax_pfl.algorithms.interface import Algorithm
from fedjax_pfl.algorithms.registry import AT_LEAST_ONE, AlgorithmSpec, HParam, register
from fedjax_pfl.models.model import Model

Params = Any


class State(NamedTuple):
    params: Params         # global model w                                            leaves [...]
    client_params: Params  # mask_fill="keep": each client's own model from its last round [N, ...]
    opt_state: Any         # per-client optimizer states (--momentum-buffer persist), else None
    server: Any            # the server chain's state (Engine.init_server)
    round: jax.Array       # shape=(), int32
    CLIENT_FIELDS = ("client_params", "opt_state")  # per-client rows [N, ...]


def random_mask(key: jax.Array, like: Params, cr: float, kind: str) -> Params:
    """A 0/1 pytree shaped like `like`: each coordinate 1 with probability 1/CR ("bernoulli") or
    exactly round(d/CR) ones over all coordinates together ("fixed")."""
    leaves, treedef = jax.tree.flatten(like)
    if kind == "bernoulli":
        keys = jax.random.split(key, len(leaves))
        masks = [jax.random.bernoulli(k, 1.0 / cr, x.shape).astype(x.dtype)
                 for k, x in zip(keys, leaves)]
        return jax.tree.unflatten(treedef, masks)
    sizes = [x.size for x in leaves]
    total = sum(sizes)
    keep = int(round(total / cr))
    rank = jnp.argsort(jnp.argsort(jax.random.uniform(key, (total,))))   # a random permutation
    flat = (rank < keep)
    out, start = [], 0
    for x, n in zip(leaves, sizes):
        out.append(flat[start:start + n].reshape(x.shape).astype(x.dtype))
        start += n
    return jax.tree.unflatten(treedef, out)


def fedavg_sar(model: Model, config: EngineConfig, *, cr: float, mask_fill: str, mask: str
               ) -> Algorithm:
    """FedAvg (s.a.r.); see the module docstring."""
    engine = Engine(model, config, streams=("train", "down", "up"))
    keep = mask_fill == "keep"

    def send(key, value, fill):
        """One transmission: the sent coordinates of `value`, `fill` elsewhere; floats sent."""
        m = random_mask(key, value, cr, mask)
        received = jax.tree.map(lambda v, f, mi: mi * v + (1 - mi) * f, value, fill, m)
        return received, sum(jnp.sum(mi) for mi in jax.tree.leaves(m))

    def downlink(w, key, own):
        return send(key, w, own if keep else ops.tree_zeros_like(w))

    def uplink(w, key, trained):
        return send(key, trained, w if keep else ops.tree_zeros_like(w))

    def init(key: jax.Array, data) -> State:
        params = model.init(key)
        n = data.num_clients
        own = core.broadcast(params, n) if keep else None
        return State(params, own, engine.init_opt_rows(params, n),
                     engine.init_server(params, data), jnp.zeros((), jnp.int32))

    def round_fn(state: State, data, key: jax.Array) -> tuple[State, dict]:
        rnd = engine.begin(data, key)
        idx = rnd.idx
        own = core.gather(state.client_params, idx) if keep else ops.tree_zeros_like(state.params)
        own_rows = own if keep else core.broadcast(own, rnd.m)
        start, down_floats = engine.mapper(downlink, client_keys(rnd.keys["down"], idx), own_rows,
                                           shared=(state.params,))
        trained = engine.train(rnd, start, opt_rows=state.opt_state)
        received, up_floats = engine.mapper(uplink, client_keys(rnd.keys["up"], idx),
                                            trained.params, shared=(state.params,))
        # Under --dp-clip DP-FedAvg's noisy mean of the clipped received_i − w instead (the
        # masked update m'_i ⊙ (w_i − w) with mask_fill="keep").
        params, server, agg = engine.aggregate(rnd, state.params, received, rnd.train_counts,
                                               state.server)
        client_params = core.scatter(state.client_params, idx, trained.params) if keep else None
        metrics = engine.metrics(rnd, trained, server=agg)
        if engine.poisson:                        # a Poisson round's empty slots send nothing
            sent = engine.participating(idx, data)
            up_floats, down_floats = (jnp.where(sent, f, 0) for f in (up_floats, down_floats))
        # Floats sent vary per client (random masks): the round's totals.
        metrics.update(communication(up_clients=1, up_floats_per_client=jnp.sum(up_floats),
                                     down_clients=1, down_floats_per_client=jnp.sum(down_floats)))
        return (State(params, client_params, trained.opt_rows, server, state.round + 1), metrics)

    def evaluate(state: State, data, ids=None) -> dict[str, core.ClientEval]:
        return {"client": engine.evaluator.shared(data, state.params, ids)}

    return engine.algorithm("fedavg_sar", init, round_fn, evaluate, host_state=True)


register(AlgorithmSpec(
    name="fedavg_sar", factory=fedavg_sar,
    private_uplink="what the server receives minus its model, received_i − w: the masked update "
                   "m'_i ⊙ (w_i − w) with mask_fill 'keep' (with 'zero' also −(1 − m'_i) ⊙ w); the "
                   "client's own model and optimizer state stay on the client",
    flag_prefix="sar",
    summary="FedAvg (s.a.r.): FedAvg sending a random 1/CR of the coordinates each way",
    hparams=(
        HParam("cr", float, 2.0, "compression rate: a random 1/CR of the coordinates is sent",
                    check=AT_LEAST_ONE),
        HParam("mask_fill", str, "keep",
                    "unsent coordinates: 'keep' the receiver's old value (trains; 0.89 on digits) "
                    "or arrive as 'zero' (the paper's baseline, which collapses: at CR 2 half of "
                    "each model is zeroed each way; use it to reproduce the paper's numbers)",
                    choices=("zero", "keep")),
        HParam("mask", str, "bernoulli",
                    "'bernoulli': each coordinate sent with probability 1/CR; 'fixed': exactly "
                    "round(d/CR) coordinates; a fresh mask per transmission",
                    choices=("bernoulli", "fixed")),
    ),
    traceable=('lr',),
    test_hparams={"mask_fill": "keep"},
))
