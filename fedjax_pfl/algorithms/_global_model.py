"""The state of an algorithm that keeps one global model (FedAvg(-FT), FedProx(-FT),
Per-FedAvg): a private helper module, shared by them (no algorithm imports a sibling)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax


class GlobalModelState(NamedTuple):
    """The state of an algorithm that keeps one global model and nothing else per client but
    optimizer states: FedAvg(-FT), FedProx(-FT), Per-FedAvg."""

    params: Any        # global model θ                                  leaves [...]
    opt_state: Any     # per-client optimizer states (momentum_buffer=persist) [N, ...], else None
    server: Any        # the server chain's state (Engine.init_server); () when it keeps none
    round: jax.Array   # rounds completed; shape=(), int32
    rng: jax.Array     # base key for evaluation-time randomness (fine-tuning batch order)
    CLIENT_FIELDS = ("opt_state",)  # per-client rows [N, ...]
