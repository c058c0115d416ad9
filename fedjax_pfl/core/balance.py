"""Load balance of a round's clients over the devices: which contiguous block of rows each
device runs, so that the devices finish together."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Above this many rows balanced_order deals them in snake order (vectorised): with many rows
# it is within a fraction of a percent of even, and the greedy pass costs O(m²) a swap (0.8 ms
# at 300 rows, 6 ms at 1,000 on one core; the snake order 0.1 and 0.5 ms).
_GREEDY_MAX_ROWS = 256


def balanced_order(costs: jax.Array, num_devices: int) -> jax.Array:
    """A permutation of m rows such that contiguous blocks of ⌈m/D⌉ rows (one per device, the
    last blocks short by the padding) carry about equal total cost; within a block, rows stay in
    decreasing cost. With one device, the identity.

    Longest processing time first: rows by decreasing cost, each to the least-loaded device with
    room left; then, while a swap of one row between the most and the least loaded device brings
    their loads closer, the best such swap. A device runs its clients one after another, so the
    round lasts as long as its busiest device: on PGFed's Dirichlet split (6 of 25 clients with
    828–3,724 samples, 2 devices) the busiest holds 1.8 % more than half the steps on average,
    the best equal-count split, against 5.8 % for the snake order (0, 1, …, D−1, D−1, …, 0, …)
    used above _GREEDY_MAX_ROWS rows."""
    m = costs.shape[0]
    if num_devices <= 1 or m <= 1:
        return jnp.arange(m)
    if m > _GREEDY_MAX_ROWS:
        return _snake_order(costs, num_devices)
    block = -(-m // num_devices)
    room = jnp.asarray([min(block, max(0, m - d * block)) for d in range(num_devices)], jnp.int32)
    by_cost = jnp.argsort(-costs, stable=True)
    sorted_costs = costs[by_cost]
    if not jnp.issubdtype(sorted_costs.dtype, jnp.floating):
        sorted_costs = sorted_costs.astype(jnp.int32)
    loads = jnp.zeros(num_devices, sorted_costs.dtype)

    def deal(i, carry):
        loads, counts, device = carry
        d = jnp.argmin(jnp.where(counts < room, loads, jnp.max(loads) + sorted_costs[0] + 1))
        return loads.at[d].add(sorted_costs[i]), counts.at[d].add(1), device.at[i].set(d)

    loads, _, device = jax.lax.fori_loop(
        0, m, deal, (loads, jnp.zeros(num_devices, jnp.int32), jnp.zeros(m, jnp.int32)))

    # Each swap moves 0 < δ < gap from the busiest to the idlest device, so the sum of squared
    # loads falls strictly and the loop ends; the bound only guards against float rounding.
    delta = sorted_costs[:, None] - sorted_costs[None, :]        # row i leaves, row j arrives

    def swap(carry):
        loads, device, _, it = carry
        hi = jnp.argmax(loads)
        lo = jnp.argmin(jnp.where(room > 0, loads, loads[hi]))      # (a device without rows)
        gap = loads[hi] - loads[lo]
        allowed = (device == hi)[:, None] & (device == lo)[None, :] & (delta > 0)
        new_gap = jnp.where(allowed, jnp.abs(gap - 2 * delta), gap)
        flat = jnp.argmin(new_gap)
        i, j = flat // m, flat % m
        better = new_gap[i, j] < gap
        moved = jnp.where(better, delta[i, j], 0)
        device = jnp.where(better, device.at[i].set(lo).at[j].set(hi), device)
        return loads.at[hi].add(-moved).at[lo].add(moved), device, better, it + 1

    loads, device, _, _ = jax.lax.while_loop(
        lambda c: c[2] & (c[3] < 4 * m), swap,
        (loads, device, jnp.ones((), bool), jnp.zeros((), jnp.int32)))
    # Swaps of one row can stop short of the best split; then the snake order may be the better
    # one (a few percent of small random cases): take whichever leaves the busiest device less.
    # Its labels are the positional blocks it fills (for D > 2 they need not be its devices).
    snake_block = jnp.zeros(m, jnp.int32).at[_snake_order(costs, num_devices)].set(
        jnp.arange(m, dtype=jnp.int32) // block)[by_cost]
    snake_loads = jax.ops.segment_sum(sorted_costs, snake_block, num_segments=num_devices)
    device = jnp.where(jnp.max(loads) <= jnp.max(snake_loads), device, snake_block)
    # Grouped by device, longest first within each block, so that a chunk of several clients
    # holds clients of similar length.
    return by_cost[jnp.argsort(device * m + jnp.arange(m), stable=True)]


def _snake_order(costs: jax.Array, num_devices: int) -> jax.Array:
    """balanced_order for many rows: rows dealt longest first in snake order (0, 1, …, D−1,
    D−1, …, 0, …), then grouped by device."""
    m = costs.shape[0]
    by_cost = jnp.argsort(-costs, stable=True)
    rank = jnp.arange(m)
    lap, pos = rank // num_devices, rank % num_devices
    device = jnp.where(lap % 2 == 0, pos, num_devices - 1 - pos)
    # The blocks are ⌈m/D⌉ rows with the padding in the last: the devices that receive the
    # partial lap's extra rows must be the first ones, so mirror the labels when that lap runs
    # backwards (an odd number of full laps before it).
    if (m // num_devices) % 2 == 1:
        device = num_devices - 1 - device
    return by_cost[jnp.argsort(device * m + rank, stable=True)]
