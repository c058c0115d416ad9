"""The client-axis primitives: sampling, gather/scatter, reductions and the three backends."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfl import core


@pytest.mark.parametrize("n,rate,m", [(25, 0.25, 6), (50, 0.25, 12), (100, 0.25, 25), (25, 0.5, 12),
                                      (100, 0.2, 20), (100, 0.07, 7), (10, 1.0, 10), (3, 0.1, 1)])
def test_num_sampled_is_floor_of_rate(n, rate, m):
    # docs/algorithms/pgfed.md#t24: M = floor(rate·N): 6, 12, 25 at 25 %; at least one client.
    assert core.num_sampled_clients(n, rate) == m


@pytest.mark.parametrize("n,rate,ours,reference", [(100, 0.29, 29, 28), (100, 0.57, 57, 56),
                                                   (100, 0.58, 58, 57), (50, 0.58, 29, 28),
                                                   (25, 0.28, 7, 7)])
def test_num_sampled_differs_from_int_of_the_product_where_documented(n, rate, ours, reference):
    # The docstring of num_sampled_clients: the exact floor, which int(N * rate) (the PGFed
    # reference's join_clients) undercuts by one where the float product lands just below.
    assert int(n * rate) == reference
    assert core.num_sampled_clients(n, rate) == ours


def test_sampling_is_deterministic_distinct_and_uniform():
    key = jax.random.key(7)
    a = core.sample_clients(key, 100, 20)
    np.testing.assert_array_equal(a, core.sample_clients(key, 100, 20))
    assert len(set(np.asarray(a).tolist())) == 20
    counts = np.zeros(100)
    sample = jax.jit(lambda k: core.sample_clients(k, 100, 20))
    for r in range(500):
        counts[np.asarray(sample(jax.random.fold_in(key, r)))] += 1
    # Each client is sampled with probability 0.2: 100 expected, sd = sqrt(500·0.2·0.8) ≈ 8.9.
    assert counts.sum() == 500 * 20
    assert np.all(np.abs(counts - 100) < 5 * 8.95)
    assert not np.array_equal(np.asarray(sample(jax.random.fold_in(key, 0))),
                              np.asarray(sample(jax.random.fold_in(key, 1))))


def test_scatter_leaves_other_rows_bitwise_unchanged():
    tree = {"a": jnp.arange(12.0).reshape(6, 2) / 3, "b": jnp.arange(6)}
    idx = jnp.array([1, 4])
    rows = {"a": jnp.full((2, 2), -1.0), "b": jnp.array([10, 40])}
    out = core.scatter(tree, idx, rows)
    keep = np.array([0, 2, 3, 5])
    np.testing.assert_array_equal(np.asarray(out["a"])[keep], np.asarray(tree["a"])[keep])
    np.testing.assert_array_equal(out["b"], [0, 10, 2, 3, 40, 5])
    np.testing.assert_array_equal(core.gather(out, idx)["a"], rows["a"])


def test_weighted_mean_and_where():
    x = {"w": jnp.array([[1.0, 2.0], [3.0, 6.0]])}
    # weights 1 and 3: (1·[1,2] + 3·[3,6]) / 4 = [2.5, 5].
    np.testing.assert_allclose(core.mean_over_clients(x, jnp.array([1.0, 3.0]))["w"], [2.5, 5.0])
    np.testing.assert_allclose(core.mean_over_clients(x)["w"], [2.0, 4.0])
    np.testing.assert_allclose(core.sum_over_clients(x)["w"], [4.0, 8.0])
    picked = core.where_clients(jnp.array([True, False]), x, {"w": jnp.zeros((2, 2))})
    np.testing.assert_array_equal(picked["w"], [[1, 2], [0, 0]])
    np.testing.assert_array_equal(core.broadcast({"v": jnp.array([1, 2])}, 3)["v"], [[1, 2]] * 3)


@pytest.mark.parametrize("backend", ["vmap", "chunked", "loop"])
def test_backends_agree_and_keep_order(backend):
    mapper = core.client_mapper(backend, chunk_size=2)
    fn = _row_fn
    rows = {"x": jnp.arange(5.0), "y": jnp.arange(10.0).reshape(5, 2)}
    out = mapper(fn, rows, shared=(jnp.asarray(10.0),), cost=jnp.array([3, 1, 4, 1, 5]))
    np.testing.assert_allclose(out, 10.0 * np.arange(5) + np.arange(10).reshape(5, 2).sum(1))


def _row_fn(scale, row):
    return scale * row["x"] + row["y"].sum()


def test_bad_backend_and_chunk_size_are_rejected():
    with pytest.raises(ValueError, match="--backend"):
        core.client_mapper("pmap")
    with pytest.raises(ValueError, match="--chunk-size"):
        core.client_mapper("chunked", -1)


def test_automatic_chunk_size_follows_the_working_set():
    # One client's output here is a [64, 64] float32 array (16 KB): a 16 KB memory budget allows
    # one client per chunk, a 1 MB one at most 64 (fewer if XLA keeps temporaries).
    fn = lambda row: jnp.tanh(row[:, None] * row[None, :])
    spec = jax.ShapeDtypeStruct((64,), jnp.float32)
    assert core.chunking.auto_chunk_size(fn, spec, memory_budget_bytes=16 * 1024) == 1
    assert 8 <= core.chunking.auto_chunk_size(fn, spec, memory_budget_bytes=2**20) <= 64
    # A function with a large temporary (a [64, 64, 64] intermediate reduced away) is limited by
    # the temporaries budget instead. (The barrier keeps the intermediate a buffer: XLA from
    # jaxlib 0.11 fuses the reduction into its producer otherwise.)
    big = lambda row: jnp.sum(jax.lax.optimization_barrier(
        jnp.sin(row[:, None, None] * row[None, :, None] * row)), axis=0)
    limited = core.chunking.auto_chunk_size(big, spec, temp_budget_bytes=2**20)
    assert 1 <= limited <= 2**20 // (64 * 64 * 4)
    # An automatic mapper gives the same result as plain vmap.
    rows = jnp.arange(20.0).reshape(5, 4)
    out = core.client_mapper("chunked", 0)(lambda r: r.sum() * r, rows)
    np.testing.assert_allclose(out, jax.vmap(lambda r: r.sum() * r)(rows))


def test_on_an_accelerator_only_memory_limits_a_chunk(monkeypatch):
    """Accelerators want the widest chunk, so there only a quarter of the device's memory bounds
    it: chunk · (temporaries + outputs) ≤ bytes_limit / 4. A function of one client returning a
    [1000] float32 row (4,000 bytes, no temporaries) on a device of 4 · 7 · 4,000 + 100 bytes
    gets chunks of 7, which the automatic mapper then runs; with no memory reported, the whole
    vmap as before."""
    from fedjax_pfl.core import chunking

    fn = lambda row: row * 2.0
    spec = jax.ShapeDtypeStruct((1000,), jnp.float32)
    big = lambda row: jnp.sum(jax.lax.optimization_barrier(
        jnp.sin(row[:, None, None] * row[None, :, None] * row)), axis=0)
    small = jax.ShapeDtypeStruct((64,), jnp.float32)
    if chunking.on_cpu():
        assert chunking.auto_chunk_size(big, small) <= 16             # the CPU's budgets
    monkeypatch.setattr(chunking, "on_cpu", lambda: False)
    monkeypatch.setattr(chunking, "device_memory_limit", lambda: 4 * 7 * 4000 + 100)
    assert chunking.auto_chunk_size(fn, spec) == 7
    assert 1 <= chunking.traced_chunk_size(fn, spec) <= 7          # (an upper bound of the bytes)
    rows = jnp.arange(20 * 1000, dtype=jnp.float32).reshape(20, 1000)
    mapper = core.client_mapper("chunked", 0)
    assert mapper.resolved(fn, (), (rows,)).chunk_size == 7
    np.testing.assert_array_equal(mapper(fn, rows), 2.0 * np.arange(20 * 1000).reshape(20, 1000))
    # Speed budgets (temporaries near the cache, flops per step) are the CPU's alone: a function
    # with 1 MB of temporaries per client, one client per chunk under the CPU's 16 MB budget at
    # most 16, gets chunks of about 1 GB / 1 MB on a 4 GB device.
    monkeypatch.setattr(chunking, "device_memory_limit", lambda: 4 << 30)
    assert 512 <= chunking.auto_chunk_size(big, small) <= 1024
    monkeypatch.setattr(chunking, "device_memory_limit", lambda: 0)
    assert chunking.auto_chunk_size(fn, spec) == chunking.traced_chunk_size(fn, spec) == 1 << 30


def test_sparse_sampling_is_uniform_over_subsets():
    """The O(M log M) path (first M distinct ids of iid draws): all C(6, 3) = 20 subsets of 6
    clients equally likely over 8,000 keys (chi-square, 19 degrees of freedom)."""
    from itertools import combinations

    sample = jax.jit(jax.vmap(lambda k: core.clients._sample_sparse(k, 6, 3)))
    subsets = np.asarray(sample(jax.random.split(jax.random.key(0), 8000)))
    assert np.all(np.diff(subsets, axis=1) > 0)                     # distinct, sorted
    code = {c: i for i, c in enumerate(combinations(range(6), 3))}
    counts = np.bincount([code[tuple(s)] for s in subsets], minlength=20)
    chi2 = ((counts - 400) ** 2 / 400).sum()
    assert chi2 < 43.8                                               # p ≈ 0.001


def test_large_n_sampling_takes_the_sparse_path_and_covers_clients_evenly():
    n, m = 20_000, 100                                               # n > 4m + 4096: sparse path
    sample = jax.jit(lambda k: core.sample_clients(k, n, m))
    draws = np.concatenate([np.asarray(sample(jax.random.key(r))) for r in range(400)])
    assert draws.min() >= 0 and draws.max() < n
    counts = np.bincount(draws // 1000, minlength=20)               # 2,000 per block expected
    assert ((counts - 2000) ** 2 / 2000).sum() < 43.8


def _counting_loop():
    """A client's loop: `n` steps, each adding the row's value; the result is (sum, steps)."""
    return core.ClientLoop(
        init=lambda shared, row: (row["v"], jnp.zeros(()), jnp.zeros((), jnp.int32)),
        step=lambda shared, c, t: (c[0], c[1] + c[0] * shared[0], c[2] + 1),
        finish=lambda shared, c: {"total": c[1], "steps": c[2]},
        length=lambda row: row["n"])


COUNTING = _counting_loop()


@pytest.mark.parametrize("backend,width", [("loop", 0), ("vmap", 0), ("chunked", 1),
                                           ("chunked", 2), ("chunked", 3), ("chunked", 9)])
@pytest.mark.slow
def test_client_loops_take_each_clients_own_steps(backend, width):
    """Every client takes exactly its own number of steps in any chunk width (chunks of sorted
    clients, stages for the longest, masked lanes), zero-step clients included; results come
    back in row order."""
    lengths = np.array([3, 0, 7, 1, 12, 0, 2, 5, 9, 4, 1])
    rows = {"v": jnp.arange(1.0, 12.0), "n": jnp.asarray(lengths, jnp.int32)}
    mapper = core.ClientMapper(backend, width)
    out = mapper.run(COUNTING, rows, shared=(jnp.asarray(2.0),))
    np.testing.assert_array_equal(out["steps"], lengths)
    np.testing.assert_allclose(out["total"], 2.0 * np.arange(1, 12) * lengths)


@pytest.mark.parametrize("width", [1, 3, 4])
def test_a_large_carry_loop_keeps_each_clients_own_steps(width):
    """`large_carry` (an evaluation's carry holds the client's model): stage 1 keeps only the
    results and the k = m/16 longest clients' carries, which go on to stages 2 and 3 (width 1:
    one client after another, each reading its own row, unsorted). Each
    client still takes exactly its own steps (m = 45: k = 2 long clients, ties at the cap,
    zero-step clients), and the results come back in row order."""
    lengths = np.array([3, 0, 7, 1, 12, 0, 2, 5, 9, 4, 1, 30, 6, 6, 6, 8, 2, 0, 1, 3, 7, 25, 8,
                        8, 4, 2, 9, 9, 1, 5, 0, 3, 11, 2, 6, 4, 7, 1, 2, 40, 3, 5, 9, 2, 1])
    m = len(lengths)
    rows = {"v": jnp.arange(1.0, m + 1.0), "n": jnp.asarray(lengths, jnp.int32),
            "model": jnp.ones((m, 64))}              # (a carry much larger than the result)
    loop = COUNTING._replace(
        init=lambda shared, row: (row["v"], jnp.zeros(()), jnp.zeros((), jnp.int32), row["model"]),
        step=lambda shared, c, t: (c[0], c[1] + c[0] * shared[0], c[2] + 1, c[3]),
        large_carry=True)
    out = jax.jit(lambda r: core.ClientMapper("chunked", width).run(
        loop, r, shared=(jnp.asarray(2.0),)))(rows)
    np.testing.assert_array_equal(out["steps"], lengths)
    np.testing.assert_allclose(out["total"], 2.0 * np.arange(1, m + 1) * lengths)


@pytest.mark.parametrize("backend,width,m,batched", [("chunked", 1, 4, False), ("chunked", 2, 4, True),
                                                     ("vmap", 0, 1, False), ("vmap", 0, 4, True)])
def test_chunks_of_one_client_run_unbatched(backend, width, m, batched):
    """A chunk of one client (or the one row of a vmap) is traced without vmap: a one-lane vmap
    would still batch the client's while-loop predicate (per-step selects of the whole carry)
    and give every matmul a batch dimension, which XLA:CPU serves with transposed weight copies
    (docs/decisions/cnn-step.md, "Step kernels"). The results are the same either way (test above)."""
    from jax._src.interpreters.batching import BatchTracer  # jax is pinned below 0.11
    seen = []

    def init(shared, row):
        seen.append(isinstance(row["v"], BatchTracer))
        return COUNTING.init(shared, row)

    loop = COUNTING._replace(init=init)
    lengths = [3, 1, 4, 2][:m]
    rows = {"v": jnp.arange(1.0, m + 1.0), "n": jnp.asarray(lengths, jnp.int32)}
    mapper = core.ClientMapper(backend, width)
    out = jax.jit(lambda r: mapper.run(loop, r, shared=(jnp.asarray(2.0),)))(rows)
    np.testing.assert_array_equal(out["steps"], lengths)
    np.testing.assert_allclose(out["total"], 2.0 * np.arange(1, m + 1) * np.array(lengths))
    assert seen and all(s == batched for s in seen)


@pytest.mark.parametrize("lengths,width", [
    ([2000] + [2] * 99, 50),           # the skewed client among 99 small ones
    ([100] + [1] * 99, 100),
    ([10] * 64, 64),                   # equal clients: no waste
    ([300, 250] + [5] * 40, 8),
])
def test_long_clients_do_not_hold_up_the_rest(lengths, width):
    """Lane-steps (masked lanes included) stay within 3× the clients' own steps, where one
    vectorised block would take m × longest (200,000 vs ~2,300 in the first case)."""
    work = core.execution.capped_work(lengths, width)
    assert work <= 3 * sum(lengths)
    if len(set(lengths)) > 1:
        assert work < 0.15 * len(lengths) * max(lengths)


def _best_split(costs: np.ndarray, devices: int) -> int:
    """Brute force: the least busiest-device load over every assignment of rows to devices that
    fills the positional blocks (⌈m/D⌉ rows each, the last ones short)."""
    m = len(costs)
    block = -(-m // devices)
    room = [min(block, max(0, m - d * block)) for d in range(devices)]

    def best_from(rows: tuple[int, ...], d: int) -> int:
        if d == devices - 1:
            return int(costs[list(rows)].sum())
        return min(max(int(costs[list(chosen)].sum()),
                       best_from(tuple(r for r in rows if r not in chosen), d + 1))
                   for chosen in itertools.combinations(rows, room[d]))

    return best_from(tuple(range(m)), 0)


def _blocks(costs: np.ndarray, order: np.ndarray, devices: int) -> list[np.ndarray]:
    block = -(-len(costs) // devices)
    return [costs[order[d * block:(d + 1) * block]] for d in range(devices)]


@pytest.mark.slow
def test_balanced_order_gives_every_device_a_near_equal_share():
    """The busiest device's load against the brute-force best split: exact on PGFed's Dirichlet
    protocol example, where the snake order (0, 1, 1, 0, 0, 1 by decreasing size) leaves one
    device 5,930 of 11,004 steps; within 1 % of the best on average over random cases, where
    the snake order is 2.8 % above it."""
    order = jax.jit(core.balanced_order, static_argnums=1)
    example = np.array([1000, 3430, 574, 2500, 1500, 2000])
    got = [int(b.sum()) for b in _blocks(example, np.asarray(order(jnp.asarray(example), 2)), 2)]
    assert max(got) == _best_split(example, 2) == 5504
    rng = np.random.default_rng(1)
    ratios = []
    for devices, sizes in ((2, (2, 3, 4, 6, 7, 9)), (3, (4, 5, 7)), (4, (5, 7))):
        for m in sizes:
            for _ in range(12):
                costs = rng.integers(1, 4000, m)
                perm = np.asarray(order(jnp.asarray(costs), devices))
                np.testing.assert_array_equal(np.sort(perm), np.arange(m))
                blocks = _blocks(costs, perm, devices)
                assert all(np.all(np.diff(b) <= 0) for b in blocks)    # longest first per device
                ratios.append(max(b.sum() for b in blocks) / _best_split(costs, devices))
    assert min(ratios) >= 1.0 and np.mean(ratios) <= 1.01, np.mean(ratios)


def test_balanced_order_of_many_rows_balances_them():
    costs = jnp.arange(2000.0)
    perm = np.asarray(core.balanced_order(costs, 2))
    loads = [b.sum() for b in _blocks(np.asarray(costs), perm, 2)]
    assert sorted(perm.tolist()) == list(range(2000)) and loads[0] == loads[1]
