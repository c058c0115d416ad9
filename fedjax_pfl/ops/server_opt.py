"""The server optimisers of FedOpt (Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar &
McMahan, "Adaptive Federated Optimization", ICLR 2021, arXiv:2003.00295, Algorithm 2) as optax
`GradientTransformation`s over the server model.

The server treats the round's mean update Δ_t = mean_i(θ_i) − x_t as a pseudo-gradient (its
negative: Δ_t points downhill) and steps along it:

    FedAvg / FedAvgM   x_{t+1} = x_t + η Δ_t        (optax.sgd: with momentum, a heavy ball
                                                      or Nesterov's, on −Δ_t)
    FedAdagrad   m_t = β1 m_{t−1} + (1 − β1) Δ_t,  v_t = v_{t−1} + Δ_t²
    FedAdam      m_t = …,                         v_t = β2 v_{t−1} + (1 − β2) Δ_t²
    FedYogi      m_t = …,                         v_t = v_{t−1} − (1 − β2) Δ_t² sign(v_{t−1} − Δ_t²)
                 x_{t+1} = x_t + η m_t / (√v_t + τ)                  m_{−1} = 0, v_{−1} = τ²

Algorithm 2 corrects no bias and starts v at τ² (the paper requires v_{−1} ≥ τ²; τ² is its
smallest value, the one `scale_by_fedopt` takes): optax's `scale_by_adam` divides m and v by
1 − β^t and starts v at 0, a different first step (FedAdam's first step is about ±η per coordinate in optax's
reading, η (1 − β1) Δ / (√(β2 τ² + (1 − β2) Δ²) + τ) in the paper's), so the paper's reading is written
here and optax's bias-corrected Adam is the option (`server_transform(bias_correction=True)`).

Everything follows optax's convention that updates are added to parameters after a descent
step: the caller passes the gradient g = −Δ_t and adds the returned update to x_t.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

Params = Any

# The optimisers of --server-opt (docs/server-optimisers.md).
SERVER_OPTIMISERS = ("sgd", "momentum", "nesterov", "adam", "yogi", "adagrad")
ADAPTIVE = ("adam", "yogi", "adagrad")


class FedOptState(NamedTuple):
    """Algorithm 2's moments: m (the first, m_{−1} = 0) and v (the second, v_{−1} = τ²)."""

    m: Params
    v: Params


def scale_by_fedopt(kind: str, *, b1, b2, tau) -> optax.GradientTransformation:
    """m_t / (√v_t + τ) of Reddi et al.'s Algorithm 2 for `kind` 'adam', 'yogi' or 'adagrad'
    (module docstring): no bias correction, v_{−1} = τ². The hyperparameters may be traced
    (a sweep vmaps over them). `b2` is not read by Adagrad."""
    if kind not in ADAPTIVE:
        raise ValueError(f"kind must be one of {list(ADAPTIVE)}, got {kind!r}")

    def init(params: Params) -> FedOptState:
        return FedOptState(jax.tree.map(jnp.zeros_like, params),
                           jax.tree.map(lambda p: jnp.full_like(p, tau * tau), params))

    def update(grads: Params, state: FedOptState, params: Params | None = None):
        del params
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.m, grads)
        if kind == "adagrad":
            second = lambda v, g2: v + g2
        elif kind == "adam":
            second = lambda v, g2: b2 * v + (1 - b2) * g2
        else:                          # yogi: v moves towards g² by at most (1 − β2) g²
            second = lambda v, g2: v - (1 - b2) * g2 * jnp.sign(v - g2)
        v = jax.tree.map(lambda v, g: second(v, g * g), state.v, grads)
        step = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + tau), m, v)
        return step, FedOptState(m, v)

    return optax.GradientTransformation(init, update)


def server_transform(kind: str, *, lr, momentum=0.0, b1=0.9, b2=0.99, eps=1e-3,
                     bias_correction: bool = False) -> optax.GradientTransformation:
    """The server optimiser `kind` (one of SERVER_OPTIMISERS) with learning rate η = `lr`:
    'sgd' optax.sgd(η); 'momentum' / 'nesterov' optax.sgd(η, momentum, nesterov); 'adam',
    'yogi', 'adagrad' Algorithm 2 (`scale_by_fedopt`, τ = `eps`) scaled by −η, or with
    `bias_correction` ('adam' only) optax.adam(η, b1, b2, eps): bias-corrected, v_{−1} = 0."""
    if kind not in SERVER_OPTIMISERS:
        raise ValueError(f"kind must be one of {list(SERVER_OPTIMISERS)}, got {kind!r}")
    if bias_correction and kind != "adam":
        raise ValueError(f"bias_correction applies to kind 'adam' (optax.adam), not {kind!r}")
    if kind == "sgd":
        return optax.sgd(lr)
    if kind in ("momentum", "nesterov"):
        return optax.sgd(lr, momentum=momentum, nesterov=kind == "nesterov")
    if bias_correction:
        return optax.adam(lr, b1=b1, b2=b2, eps=eps)
    return optax.chain(scale_by_fedopt(kind, b1=b1, b2=b2, tau=eps),
                       optax.scale_by_learning_rate(lr))
