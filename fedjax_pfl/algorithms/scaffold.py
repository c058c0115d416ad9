"""SCAFFOLD (Karimireddy, Kale, Mohri, Reddi, Stich & Suresh, "SCAFFOLD: Stochastic Controlled
Averaging for Federated Learning", ICML 2020, arXiv:1910.06378), Algorithm 1
(line numbers of arXiv v2); docs/algorithms/scaffold.md (readings A1–A10 cited below).

State: the server model x, the server control variate c and, per client i, its control variate
c_i (all zero at the start, A5). Per round with sampled clients S (|S| = M of N real clients),
local learning rate η_l (`--lr`) and global step size η_g (`--scaffold-server-lr`):

  each i ∈ S, from y_i ← x:                                            (line 6)
    K_i local minibatch steps on the corrected gradient
        y_i ← y_i − η_l (g_i(y_i) − c_i + c)                            (lines 7–10)
    c_i⁺ ← c_i − c + (x − y_i) / (K_i η_l)      option II (default)     (line 11, A1)
    c_i⁺ ← ∇f_i(x), all of i's training data    option I                (line 11, A4)
    Δy_i = y_i − x,  Δc_i = c_i⁺ − c_i;  c_i ← c_i⁺                    (lines 12–13)
  x ← x + η_g Σ_{i∈S} w_i Δy_i    w_i = 1/M (the paper), or n_i/Σ_S n  (lines 15–16, A2)
  c ← c + (|S|/N) (1/M) Σ_{i∈S} Δc_i = c + (1/N) Σ_{i∈S} Δc_i          (lines 15–16, A2)

Readings (docs/algorithms/scaffold.md):
  * K_i is the number of steps client i actually took this round: E·⌈n_i/B⌉ under
    `--local-epochs` (so it differs between clients), K under `--local-steps` (A1).
  * The correction c − c_i is added to every minibatch gradient (`core.add_aux_gradient`) before
    sgd(lr, momentum); with momentum, option II still divides by K_i η_l (A3).
  * A client without training data takes no step and keeps its c_i (A7).
  * Unsampled clients keep c_i and their optimizer state (A8). Δc_i is taken from the c_i⁺ as
    stored (`--state-dtype`), so c stays the mean of the stored c_i (A9).
Under --dp-clip (docs/privacy.md): DP-FedAvg on the joint upload u_i = (Δy_i, Δc_i), one L2 norm
over both, uniform weights and the fixed denominator M: (Δ̃y, Δ̃c) = (Σ_i clip_C(u_i) +
N(0, z²C²))/M, x ← x + η_g Δ̃y, c ← c + (M/N) Δ̃c. Each client keeps its unclipped c_i⁺, so c is
then no longer the mean of the stored c_i (A9 holds without privacy only).
Evaluated: the server model x on every client's test split, as FedAvg (A6).
Communication per sampled client: x and c down, Δy_i and Δc_i up (2d floats each way, A10).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_pfl import core, ops
from fedjax_pfl.algorithms.engine import Engine, EngineConfig, first_row, require_choices
from fedjax_pfl.algorithms.interface import Algorithm
from fedjax_pfl.algorithms.registry import POSITIVE, AlgorithmSpec, HParam, register
from fedjax_pfl.core.local import FullPass, add_aux_gradient
from fedjax_pfl.models.model import Model

Params = Any


class State(NamedTuple):
    params: Params          # server model x                                    leaves [...]
    control: Params         # server control variate c = (1/N) Σ_i c_i          leaves [...]
    client_control: Params  # client control variates c_i                      leaves [N, ...]
    opt_state: Any          # per-client optimizer states (momentum_buffer=persist) [N, ...], else None
    server: Any             # the server chain's state (Engine.init_server)
    round: jax.Array        # rounds completed; shape=(), int32
    CLIENT_FIELDS = ("client_control", "opt_state")  # per-client rows [N, ...]


def scaffold(model: Model, config: EngineConfig, *, server_lr: float = 1.0,
             variant: str = "ii", weights: str = "uniform") -> Algorithm:
    """SCAFFOLD; see the module docstring. `variant` 'ii' or 'i' picks the control-variate
    update (Algorithm 1 line 11), `weights` 'uniform' or 'data_size' the mean of Δy_i."""
    require_choices(variant=(variant, ("ii", "i")), weights=(weights, ("uniform", "data_size")))
    engine = Engine(model, config, client_transform=add_aux_gradient("correction"))
    full_pass = (FullPass(model, batch_size=config.eval_batch_size, mapper=engine.mapper)
                 if variant == "i" else None)

    def init(key: jax.Array, data) -> State:
        params = model.init(key)          # the same initial model as every algorithm from this key
        zeros = ops.tree_zeros_like(params)
        return State(params, zeros, core.broadcast(zeros, data.num_clients),       # c = c_i = 0
                     engine.init_opt_rows(params, data.num_clients),
                     engine.init_server((zeros, zeros), data), jnp.zeros((), jnp.int32))

    def round_fn(state: State, data, key: jax.Array) -> tuple[State, dict]:
        rnd = engine.begin(data, key)                                               # S
        idx, m = rnd.idx, rnd.m
        x, c = state.params, state.control
        c_i = core.gather(state.client_control, idx)
        correction = jax.tree.map(lambda ci, cs: cs - ci, c_i, core.broadcast(c, m))  # c − c_i
        result = engine.train(rnd, x, opt_rows=state.opt_state, shared_start=True,  # lines 6–10
                              extra={"correction": correction})
        delta_y = jax.tree.map(lambda y, xs: y - xs, result.params, core.broadcast(x, m))  # Δy_i
        took_steps = result.num_steps > 0
        if variant == "ii":                                                         # line 11, II
            steps = jnp.maximum(result.num_steps, 1)             # K_i (A1; 0 steps: A7 below)

            def option_ii(ci, cs, dy):                           # c_i − c + (x − y_i)/(K_i η_l)
                k = steps.astype(dy.dtype).reshape((-1,) + (1,) * (dy.ndim - 1))
                return ci - cs - dy / (k * config.lr)

            c_plus = jax.tree.map(option_ii, c_i, core.broadcast(c, m), delta_y)
        else:                                                                       # line 11, I
            _, c_plus = full_pass(data, core.broadcast(x, m), core.gather(data.clients, idx),
                                  ids=idx)
        c_plus = core.where_clients(took_steps, c_plus, c_i)                        # A7
        c_plus = jax.tree.map(lambda new, old: new.astype(old.dtype), c_plus, c_i)  # as stored, A9
        wide = lambda a: a.astype(jnp.promote_types(a.dtype, jnp.float32))        # bfloat16 rows
        delta_c = jax.tree.map(lambda new, old: wide(new) - wide(old), c_plus, c_i)  # Δc_i
        # Lines 15–16 on the server chain's mean of the joint upload (Δy_i, Δc_i): Δy's mean
        # with `weights`, Δc's uniform; under --dp-clip DP-FedAvg's noisy mean of the upload
        # under one L2 norm (uniform, the fixed denominator M).
        w = rnd.train_counts if weights == "data_size" else None
        zero = ops.tree_zeros_like(first_row((delta_y, delta_c)))
        (mean_dy, mean_dc), server, agg = engine.aggregate(rnd, zero, (delta_y, delta_c),
                                                           (w, None), state.server)
        share = engine.expected_clients(data) / data.num_real_clients                # |S|/N
        params = jax.tree.map(lambda xs, dy: xs + server_lr * dy, x, mean_dy)       # l. 15–16
        control = jax.tree.map(lambda cs, dc: cs + (share * dc).astype(cs.dtype), c, mean_dc)
        new_state = State(params, control, core.scatter(state.client_control, idx, c_plus),
                          result.opt_rows, server, state.round + 1)
        d = ops.tree_size(params)
        metrics = engine.metrics(rnd, result, up=2 * d, down=2 * d, server=agg)
        metrics.update(control_norm=ops.tree_norm(control),
                       client_control_norm_mean=jnp.mean(jax.vmap(ops.tree_norm)(c_plus)),
                       correction_norm_mean=jnp.mean(jax.vmap(ops.tree_norm)(correction)))
        return new_state, metrics

    def evaluate(state: State, data, ids=None) -> dict[str, core.ClientEval]:
        return {"client": engine.evaluator.shared(data, state.params, ids)}            # A6

    return engine.algorithm("scaffold", init, round_fn, evaluate, host_state=True)


register(AlgorithmSpec(
    name="scaffold", factory=scaffold,
    private_uplink="each sampled client's joint upload (Δy_i, Δc_i) under one L2 norm; its own "
                   "control variate c_i and optimizer state stay on the client",
    summary="SCAFFOLD: local steps corrected by control variates (c − c_i); server model evaluated",
    hparams=(
        HParam("server_lr", float, 1.0,
                    "η_g, the global step size: x ← x + η_g · mean_i (y_i − x). Default 1: the "
                    "paper's experiments (η_g = 1 is FedAvg's averaging of the models)",
                    check=POSITIVE),
        HParam("variant", str, "ii",
                    "client control-variate update (Algorithm 1 line 11): 'ii' c_i ← c_i − c + "
                    "(x − y_i)/(K_i·lr), K_i the steps client i took (the paper's choice, no extra "
                    "cost); 'i' c_i ← the gradient of the client's loss at x over all its training "
                    "data (one more pass)", choices=("ii", "i")),
        HParam("weights", str, "uniform",
                    "mean of the clients' model updates: 'uniform' over the sampled clients (the "
                    "paper's Algorithm 1) or 'data_size' (n_i/Σn, FedAvg's); the control variate "
                    "c is always updated with (1/N) Σ Δc_i", choices=("uniform", "data_size")),
    ),
    traceable=("lr", "server_lr"),
    test_hparams={"momentum": 0.9, "momentum_buffer": "persist"},
))
