"""Poisson sampling of clients in fixed-shape rounds.

Each real client takes part in a round independently with probability q (the sampling that
DP-FedAvg's add-or-remove-one accounting assumes: `privacy.accounting`, sampling="poisson"). The
number of participants is then Binomial(N, q), but a jitted round has fixed shapes, so the round
holds K slots:

    K = min{k : P(Binomial(N, q) > k) ≤ p},     p = OVERFLOW_PROBABILITY = 1e-12

The participants fill the first slots (ids ascending); the other slots hold `pad_id`, an empty
padding client (no samples, never evaluated: `FederatedData.pad_clients`), whose rows a round may
write freely and whose uploads the server masks out (the server chain's `noised_mean`, `core.server`). When more than K
clients are drawn (probability ≤ p a round), K of them, chosen uniformly, take part and the rest
are dropped. A run of T rounds with truncation differs from the untruncated mechanism only on an
event of probability ≤ T·p, so an (ε, δ) guarantee of the untruncated mechanism holds with
δ + T·p·(1 + e^ε) (`truncation_delta`); the privacy record reports it.

K exceeds the expected count q·N by several standard deviations (K = 36 for q·N = 10, N = 100;
182 for q·N ≈ 103, N = 342,477), and the round trains all K slots: the empty ones take no steps.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

OVERFLOW_PROBABILITY = 1e-12


def poisson_capacity(num_clients: int, rate: float,
                     overflow: float = OVERFLOW_PROBABILITY) -> int:
    """K = min{k : P(Binomial(N, q) > k) ≤ overflow}, at least 1 and at most N (static)."""
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"Poisson sampling needs a rate in (0, 1], got {rate!r}")
    if rate == 1.0:
        return int(num_clients)
    from scipy.stats import binom  # (a dependency of jax)

    k = int(binom.isf(overflow, num_clients, rate))
    # isf is the smallest k with sf(k) ≤ overflow up to scipy's rounding: settle it exactly.
    while k < num_clients and binom.sf(k, num_clients, rate) > overflow:
        k += 1
    while k > 0 and binom.sf(k - 1, num_clients, rate) <= overflow:
        k -= 1
    return max(1, min(int(num_clients), k))


def truncation_delta(rounds: int, epsilon: float | None,
                     overflow: float = OVERFLOW_PROBABILITY) -> float | None:
    """T·p·(1 + e^ε): what truncating to K slots adds to δ (None where ε is unbounded)."""
    if epsilon is None or not math.isfinite(epsilon):
        return None
    try:
        return rounds * overflow * (1.0 + math.exp(epsilon))
    except OverflowError:
        return math.inf


def sample_poisson(key: jax.Array, num_clients: int, rate: float, capacity: int,
                   pad_id: int) -> jax.Array:
    """[K] slot ids: every client of 0 … N−1 independently with probability `rate`, ascending,
    then `pad_id` in the unused slots. Beyond K participants, a uniformly chosen K take part.

    The inclusion draws are one uniform per client (u_i < q); the choice among an overflow is a
    second, independent uniform per client (the K smallest among those included)."""
    include_key, order_key = jax.random.split(key)
    included = jax.random.uniform(include_key, (num_clients,)) < rate
    ids = jnp.arange(num_clients, dtype=jnp.int32)
    if capacity >= num_clients:
        return jnp.sort(jnp.where(included, ids, pad_id)).astype(jnp.int32)
    priority = jnp.where(included, jax.random.uniform(order_key, (num_clients,)), 2.0)
    neg, chosen = jax.lax.top_k(-priority, capacity)
    slots = jnp.where(neg > -2.0, chosen.astype(jnp.int32), pad_id)
    return jnp.sort(slots).astype(jnp.int32)
