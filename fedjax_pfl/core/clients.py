"""The client axis: the vocabulary an algorithm author uses to cross it.

Client state is one pytree whose leaves have a leading axis N (all clients; the fields an
algorithm's state declares in `CLIENT_FIELDS`). A round gathers the rows of the M sampled
clients, maps a one-client function over them, reduces across them, and scatters the rows back:

    sample_clients   ids of this round's M clients          gather    [N, ...] -> [M, ...]
    broadcast        [...] -> [M, ...]                      scatter   [M, ...] -> [N, ...]
    map_clients      one-client fn over the rows            where_clients  per-client select
    mean_over_clients / sum_over_clients   [M, ...] -> [...]

These are DrJAX's broadcast / map / reduce over a client placement. How a map runs (vmap,
chunks, a loop, several devices) is `core.execution`'s business; where rows live is the
placements' (`core.state_placement`, `core.data_placement`).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfl.core.rows import put_leaves, take_leaves

Params = Any


class Mapper(Protocol):
    """What `map_clients` calls: an execution strategy (`core.execution.ClientMapper`)."""

    def __call__(self, fn: Callable, *rows: Params, shared: tuple = (),
                 cost: jax.Array | None = None) -> Params: ...


def broadcast(tree: Params, n: int) -> Params:
    """[...] -> [n, ...]: the same value for every one of n clients."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), tree)


def gather(tree: Params, idx: jax.Array) -> Params:
    """[N, ...] -> [m, ...]: the rows of the clients in `idx`. Rows stored in bfloat16 (client
    state under --state-dtype bfloat16) come back as float32: computation stays in float32.
    A leaf held as `ClientRows` (client state on the host, `core.rows`) is indexed by client id."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([r.astype(jnp.float32) if r.dtype == jnp.bfloat16 else r
                              for r in take_leaves(leaves, idx)])


def scatter(tree: Params, idx: jax.Array, rows: Params) -> Params:
    """Write `rows` [m, ...] into `tree` [N, ...] at `idx`; all other rows are unchanged bit for bit."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten(put_leaves(leaves, idx, treedef.flatten_up_to(rows)))


def where_clients(mask: jax.Array, if_true: Params, if_false: Params) -> Params:
    """Per-client select: row i comes from `if_true` where mask[i], else from `if_false`."""

    def select(a, b):
        m = jnp.reshape(mask, mask.shape + (1,) * (a.ndim - mask.ndim))
        return jnp.where(m, a, b)

    return jax.tree.map(select, if_true, if_false)


def _sum_rows(x: jax.Array) -> jax.Array:
    # A dot with ones, not jnp.sum(x, axis=0): XLA:CPU's reduction across rows is 20–80x slower
    # (100 x 78,400 floats: 70–114 ms against 1.4–3.2 ms, jax 0.10.2; docs/decisions/client-sums.md).
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.sum(x, axis=0)
    return jnp.tensordot(jnp.ones(x.shape[0], x.dtype), x, axes=1)


def sum_over_clients(tree: Params) -> Params:
    """[m, ...] -> [...]: Σ over clients."""
    return jax.tree.map(_sum_rows, tree)


def mean_over_clients(tree: Params, weights: jax.Array | None = None) -> Params:
    """[m, ...] -> [...]: the (weighted) mean over clients; weights are normalised here."""
    if weights is None:
        return jax.tree.map(lambda x: _sum_rows(x) / x.shape[0], tree)

    def weighted(x):
        w = jnp.asarray(weights).astype(x.dtype)  # normalise in the leaf's precision
        return jnp.tensordot(w / jnp.sum(w), x, axes=1)

    return jax.tree.map(weighted, tree)


def sample_clients(key: jax.Array, num_clients: int, num_sampled: int) -> jax.Array:
    """M distinct client ids drawn uniformly without replacement, sorted ascending.

    Deterministic in `key`; every M-subset has the same probability. For N ≤ 4·M + 4096 the ids
    are the first M of a random permutation (O(N)); otherwise (M ≪ N, large-client-count runs)
    they are drawn in O(M log M) without touching all N: iid uniform draws, keeping the first
    occurrence of each id in draw order until M distinct ids are found. The first M distinct
    values of an iid uniform sequence are a uniformly random M-subset (sequential sampling with
    rejection of repeats), so both paths sample the same distribution. Sorting makes logs and
    scatters easier to read and changes nothing else (rows are keyed by client id).
    """
    if not 1 <= num_sampled <= num_clients:
        raise ValueError(f"cannot sample {num_sampled} of {num_clients} clients")
    if num_sampled == num_clients:
        return jnp.arange(num_clients, dtype=jnp.int32)
    if num_clients <= 4 * num_sampled + 4096:
        ids = jax.random.choice(key, num_clients, (num_sampled,), replace=False)
        return jnp.sort(ids).astype(jnp.int32)
    return _sample_sparse(key, num_clients, num_sampled)


def _sample_sparse(key: jax.Array, n: int, m: int) -> jax.Array:
    # Draws per attempt: the expected number of repeats among k draws is about k²/(2n) ≤ m/8
    # here, so m + m/4 + 16 draws almost always hold m distinct ids; otherwise draw again.
    k = m + m // 4 + 16

    def attempt(carry):
        i, _, _ = carry
        draws = jax.random.randint(jax.random.fold_in(key, i), (k,), 0, n, dtype=jnp.int32)
        order = jnp.argsort(draws, stable=True)          # equal ids: earliest draw first
        sorted_ids = draws[order]
        first = jnp.concatenate([jnp.ones(1, bool), sorted_ids[1:] != sorted_ids[:-1]])
        # The first occurrences, in draw order; the first m of them are the sample.
        position = jnp.where(first, order, k)            # draw index of each first occurrence
        chosen = jnp.sort(position)[:m]
        return i + 1, jnp.sum(first) >= m, draws[jnp.minimum(chosen, k - 1)]

    _, _, ids = jax.lax.while_loop(lambda c: ~c[1], attempt,
                                   (jnp.zeros((), jnp.int32), jnp.zeros((), bool),
                                    jnp.zeros(m, jnp.int32)))
    return jnp.sort(ids)


def num_sampled_clients(num_clients: int, participation: float) -> int:
    """M = ⌊N · rate + 1e-9⌋, at least 1: the exact floor of N · rate for a decimal rate.

    This is NOT always the reference codes' int(N * rate) (PGFed's `join_clients`): where the
    float product N * rate falls just below an integer, int() truncates to one client fewer.
    N = 100 at rate 0.29: 100 * 0.29 = 28.999999999999996, so int() gives 28 and we give 29;
    likewise N = 100 at 0.57 and 0.58 (56 vs 57, 57 vs 58) and N = 50 at 0.58 (28 vs 29). Where
    the product lands just above an integer (25 * 0.28 = 7.000000000000001) both give 7. To run
    with the reference's M in such a case, pass a rate a little below (0.2899 for 28 of 100).
    """
    return max(1, int(np.floor(num_clients * participation + 1e-9)))


def map_clients(mapper: Mapper, fn: Callable, *rows: Params, shared: tuple = (),
                cost: jax.Array | None = None) -> Params:
    """out[i] = fn(*shared, *(r[i] for r in rows)) for every client row i, run by `mapper`
    (the algorithm's execution strategy; `ClientMapper.__call__`)."""
    return mapper(fn, *rows, shared=shared, cost=cost)
