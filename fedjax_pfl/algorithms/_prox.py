"""Client-optimizer pieces shared by the regularised baselines (FedProx, FedDyn, Ditto).

Each is an optax transformation placed before the client optimizer, so a local objective
f(w) + (μ/2)‖w − w_anchor‖² runs on the engine's ordinary minibatch loop (STYLE.md §6):

    client_tx = optax.chain(add_proximal_term(mu), optax.sgd(lr))   # anchor= passed per client
"""

from __future__ import annotations

import jax
import optax


def add_proximal_term(mu: float, name: str = "anchor") -> optax.GradientTransformationExtraArgs:
    """g ← g + μ(w − w_anchor), the gradient of (μ/2)‖w − w_anchor‖² (FedProx, Li et al. 2020).

    The anchor is a per-client model passed to `update` as keyword `name` (in the engine: an
    entry of `extra`). μ = 0 adds exactly zero, so the update is the plain gradient's bit for bit.
    """

    def update_fn(updates, state, params=None, **extra_args):
        anchor = extra_args[name]
        return jax.tree.map(lambda g, w, a: g + mu * (w - a.astype(w.dtype)), updates, params,
                            anchor), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


def local_sgd(lr: float, momentum: float) -> optax.GradientTransformation:
    """The engine's default client optimizer, sgd(lr, momentum), for a second trainer."""
    return optax.sgd(lr, momentum=momentum or None)
