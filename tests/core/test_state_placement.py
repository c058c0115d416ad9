"""Client state off the devices (`--state-placement host`, `core.state_placement`).

- the copy-on-write store, checked by hand: a client never written reads the initial row; a
  written one its own rows; only written clients take memory; its arrays round-trip (bfloat16
  included);
- `ClientRows`: `core.gather` / `core.scatter` by client id equal the same operations on a dense
  [N, ...] array written here; an id outside the rows present is reported; direct indexing of a
  client leaf fails at trace time;
- a world dealt to two devices (`core.world`): its blocks worked by hand; reads and writes in
  the mapper's order and in others (the ring), repeated ids (the last write wins) and absent ids
  against a dense array; each device holds exactly its dealt clients' rows; the calls whose rows
  cross devices counted;
- host state placement gives the rounds and evaluations of device placement bit for bit (state,
  metrics, evaluation, cached evaluation) for EVERY algorithm that declares `host_state` (the
  quick suite runs ditto and fedrep, the full suite all of them), with the data on the devices
  and on the host; on two devices with two rounds per call;
- the rows prefetched for the next call are used only for that call's keys and rounds, with the
  rows the previous call wrote read again;
- algorithms that touch other clients' rows (or start them differently) refuse with a message;
- the memory plan, and resume across state placements through the runner.
"""

import os
import subprocess
import sys
import textwrap

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import linear_model, make_data

from fedjax_pfl import algorithms, core
from fedjax_pfl.algorithms.interface import Algorithm
from fedjax_pfl.core import checks
from fedjax_pfl.core import store as store_lib
from fedjax_pfl.core import world as world_lib

SIZES = [12, 30, 7, 19, 25, 3, 40, 11, 9, 22]
HOST_STATE = [n for n in algorithms.names()
              if algorithms.get(n, model=linear_model(),
                                **algorithms.spec(n).test_hparams).host_state]
QUICK = ("fedrep",)          # (ditto: the prefetch and host-data tests, also quick)


def _algo(name, **extra):
    hp = {"participation": 0.3, "batch_size": 4, "lr": 0.05,
          **algorithms.spec(name).test_hparams, **extra}
    return algorithms.get(name, model=linear_model(), **hp)


def _bits(x):
    x = jnp.asarray(x) if not isinstance(x, np.ndarray) else x
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def _leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) and la
    for x, y in zip(la, lb):
        x, y = _bits(x), _bits(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def _whole(program, state):
    """The full state pytree of a HostState (every client's rows from the store)."""
    if not isinstance(state, core.StoredState):
        return jax.device_get(state)
    host = state.store.gather(np.arange(program.num_clients))
    split = program.placements.state.host
    return split.treedef.unflatten(split.join(jax.device_get(state.device), host))


def _run(algo, *, state_placement, data_placement="device", schedule=None, dtype="float32",
         prefetch=True, cached=True):
    program = core.Program(algo, make_data(SIZES), mesh=None, state_placement=state_placement,
                           data_placement=data_placement, state_dtype=dtype)
    program.placements.state.prefetch_rows = prefetch       # (off by default on CPU: exercised here)
    state = program.init(jax.random.key(0))
    schedule = schedule or [(jax.random.key(1), r) for r in range(4)]
    use_cached, cached = cached, core.CachedEvaluation(program)
    metrics = []
    for keys, r in schedule:
        state, m = program.run_rounds(state, keys, r, 1)
        metrics += m
        cached.changed(m[0]["sampled"])
    evals = (program.evaluate(state),)
    if use_cached:          # (two more compiled evaluations where the algorithm splits its own)
        evals += (cached(state, np.array([1, 4, 7])), cached(state))
    return program, _whole(program, state), metrics, evals


# ------------------------------------------------------------------------------------------------
# The store and the rows


def test_a_store_of_client_blocks_starts_each_block_from_its_own_rows():
    """B blocks of N/B clients (a sweep's runs): client i reads initial row ⌊i·B/N⌋ until it is
    written; the padding id N reads the last block's; a checkpoint's arrays round-trip."""
    initial = [np.arange(3 * 2, dtype=np.float32).reshape(3, 2)]       # 3 blocks, rows of [2]
    store = store_lib.ClientStore(initial, num_clients=12, blocks=3)
    ids = np.array([0, 3, 4, 7, 8, 11, 12])
    dense = np.stack([initial[0][min(i // 4, 2)] for i in ids])        # the blocks, by hand
    np.testing.assert_array_equal(store.gather(ids)[0], dense)
    assert store.row_bytes() == 8 and store.page_rows == 12
    store.put(np.array([5, 9]), [np.array([[10.0, 11.0], [20.0, 21.0]], np.float32)])
    got = store.gather(np.array([4, 5, 6, 9, 10]))[0]
    np.testing.assert_array_equal(got, [[2, 3], [10, 11], [2, 3], [20, 21], [4, 5]])
    back = store_lib.ClientStore.from_arrays(store.to_arrays(), store)
    np.testing.assert_array_equal(back.gather(np.arange(13))[0], store.gather(np.arange(13))[0])
    with pytest.raises(ValueError, match="a store of 3 blocks needs N a multiple of them"):
        store_lib.ClientStore(initial, num_clients=10, blocks=3)
    with pytest.raises(ValueError, match="initial rows \\[3, \\.\\.\\.\\]"):
        store_lib.ClientStore([np.zeros(2, np.float32)], num_clients=12, blocks=3)


def test_the_store_is_copy_on_write_and_round_trips():
    init = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array(True)]
    store = store_lib.ClientStore(init, num_clients=1000)
    rows = store.gather(np.array([5, 999, 1000]))            # 1000: the padding id N
    for r in rows[0]:
        np.testing.assert_array_equal(r, init[0])
    assert rows[1].tolist() == [True, True, True] and store.touched == 0
    store.put(np.array([999, 5]), [np.stack([init[0] + 1, init[0] + 2]), np.array([False, True])])
    store.put(np.array([5]), [init[0][None] * 10, np.array([False])])
    a, b = store.gather(np.array([0, 5, 999]))
    np.testing.assert_array_equal(a, np.stack([init[0], init[0] * 10, init[0] + 1]))
    assert b.tolist() == [True, False, False]
    # Only the two written clients hold rows.
    assert store.touched == 2 and sorted(store.ids.tolist()) == [5, 999]
    # Pages of P rows are added as clients are first written (never past N, nothing copied):
    # rows of 25 bytes (6 float32 + a bool) in pages of 1,000 bytes hold 40 clients each.
    paged = store_lib.ClientStore(init, num_clients=1000, page_bytes=1000)
    assert paged.page_rows == 40 and paged.nbytes() == 1001 * 8 + 25
    ids = np.arange(100, 300)[::-1]                     # 200 clients: 5 pages
    values = np.arange(200 * 6, dtype=np.float32).reshape(200, 2, 3)
    paged.put(ids, [values, np.arange(200) % 2 == 0])
    assert len(paged.pages[0]) == 5 and paged.nbytes() == 5 * 40 * 25 + 1001 * 8 + 25
    a, b = paged.gather(np.array([299, 100, 7, 150]))
    np.testing.assert_array_equal(a, np.stack([values[0], values[199], init[0], values[149]]))
    assert b.tolist() == [True, False, True, False]
    # bfloat16 rows survive the checkpoint's arrays (NumPy's .npz has no bfloat16).
    half = store_lib.ClientStore([np.full(3, 1.5, jnp.bfloat16)], num_clients=10)
    half.put(np.array([7]), [np.array([[0.1, 2.0, -3.0]], jnp.bfloat16)])
    back = store_lib.ClientStore.from_arrays(half.to_arrays(), half)
    assert back.touched == 1 and back.initial[0].dtype == jnp.bfloat16
    np.testing.assert_array_equal(back.gather(np.array([7, 0]))[0].view(np.uint16),
                                  half.gather(np.array([7, 0]))[0].view(np.uint16))
    arrays = half.to_arrays()
    arrays["store/0/values"] = arrays["store/0/values"][:, :2]          # a truncated row
    with pytest.raises(ValueError, match="holds rows"):
        store_lib.ClientStore.from_arrays(arrays, half)
    with pytest.raises(ValueError, match="outside"):
        store.put(np.array([1000]), [np.zeros((1, 2, 3), np.float32), np.zeros(1, bool)])


class _Reads(dict):
    """A dict that records which arrays were read."""

    def __init__(self, arrays):
        super().__init__(arrays)
        self.asked = []

    def __getitem__(self, key):
        self.asked.append(key)
        return super().__getitem__(key)


def test_each_process_keeps_its_range_of_rows_and_a_checkpoint_merges_the_parts():
    """Several processes: client i's rows belong to process ⌊i·P/N⌋ (contiguous ranges);
    each process saves its part under its own prefix, and a store restored from all the parts
    keeps the rows of the clients asked for (`keep`), from whichever part holds them."""
    assert store_lib.row_owners(10, 3).tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert store_lib.row_owners(7, 1).tolist() == [0] * 7
    assert store_lib.store_prefix(0, 1) == "store" and store_lib.store_prefix(2, 3) == "store.p2"
    init = [np.zeros(2, np.float32)]
    parts = {}
    for k, ids in ((0, [1, 3]), (1, [6, 5])):
        part = store_lib.ClientStore(init, num_clients=8)
        part.put(np.array(ids), [np.array([[i, -i] for i in ids], np.float32)])
        parts.update(part.to_arrays(store_lib.store_prefix(k, 2)))
    assert store_lib.saved_prefixes({**parts, "sampled": np.zeros(1)}) == ["store.p0", "store.p1"]
    whole = store_lib.ClientStore.from_arrays(parts, store_lib.ClientStore(init, 8))
    assert sorted(whole.ids.tolist()) == [1, 3, 5, 6]
    np.testing.assert_array_equal(whole.gather(np.array([5, 3, 0]))[0],
                                  [[5, -5], [3, -3], [0, 0]])
    keep = store_lib.row_owners(8, 2) == 1                   # process 1 of 2: clients 4-7
    read = _Reads(parts)
    mine = store_lib.ClientStore.from_arrays(read, store_lib.ClientStore(init, 8), keep=keep)
    assert sorted(mine.ids.tolist()) == [5, 6]
    # Of the part holding none of them only the ids (and, as the first part, the shared initial
    # rows) were read, as `checkpoint.HostArrays` reads them lazily.
    assert sorted(k for k in read.asked if k.startswith("store.p0")) == ["store.p0/0/initial",
                                                                       "store.p0/ids"]
    read = _Reads(parts)
    store_lib.ClientStore.from_arrays(read, store_lib.ClientStore(init, 8), keep=~keep)
    assert sorted(k for k in read.asked if k.startswith("store.p1")) == ["store.p1/ids"]
    np.testing.assert_array_equal(mine.gather(np.array([6, 1]))[0], [[6, -6], [0, 0]])


def test_gather_and_scatter_by_client_id_match_a_dense_array():
    rng = np.random.default_rng(0)
    dense = rng.normal(size=(50, 4)).astype(np.float32)
    world = np.array([3, 17, 20, 41, 50, 50], np.int32)              # padded with N = 50
    rows = dense[np.minimum(world, 49)]
    idx = np.array([41, 3, 20], np.int32)
    new = rng.normal(size=(3, 4)).astype(np.float32)

    @jax.jit
    def f(rows, world, idx, new):
        with checks.collecting() as found:
            held = {"w": core.ClientRows(world, rows)}
            got = core.gather(held, idx)["w"]
            after = core.scatter(held, idx, {"w": new})["w"].rows
        return got, after, checks.combined(found)["rows"]

    got, after, miss = f(rows, world, idx, new)
    np.testing.assert_array_equal(got, dense[idx])
    want = dense.copy()
    want[idx] = new
    np.testing.assert_array_equal(np.asarray(after)[:4], want[world[:4]])
    assert not bool(miss)
    _, _, miss = f(rows, world, np.array([41, 4, 20], np.int32), new)   # 4 is not held
    assert bool(miss)
    with pytest.raises(TypeError):
        jax.jit(lambda r, w: core.ClientRows(w, r)[0])(rows, world)


def test_a_world_is_dealt_as_the_mapper_deals_its_rows():
    """`world.world`, worked by hand: blocks of ceil(M/D) of each round's order, sorted and
    padded with N; a call that writes holds each client on the first device dealt it, an
    evaluation group wherever it is asked for."""

    n = 10
    # M = 5 on 2 devices: positions 0-2 to device 0, 3-4 to device 1.
    np.testing.assert_array_equal(world_lib.world([[5, 2, 9, 7, 1]], 2, 3, n),
                                  [2, 5, 9, 1, 7, n])
    # Two rounds: round 2 deals 7 to device 0 and 5 to device 1, which already hold them
    # elsewhere: they stay where round 1 put them.
    np.testing.assert_array_equal(world_lib.world([[5, 2, 9, 7], [7, 3, 5, 8]], 2, 4, n),
                                  [2, 3, 5, n, 7, 8, 9, n])
    # An evaluation group (nothing written): the repeated padding id 4 on both devices.
    np.testing.assert_array_equal(world_lib.world([4, 6, 1, 4], 2, 2, n, distinct=False),
                                  [4, 6, 1, 4])
    with pytest.raises(RuntimeError, match="4 clients dealt to device 0"):
        world_lib.world([[1, 2, 3, 4]], 1, 3, n)


# ------------------------------------------------------------------------------------------------
# Host placement equals device placement


@pytest.mark.matrix
@pytest.mark.parametrize("name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow)
                                  for n in HOST_STATE])
@pytest.mark.slow
def test_host_state_equals_device_state_bit_for_bit(name):
    """Every algorithm that declares host_state, at the suite's fast-compile XLA settings
    (tests/conftest.py)."""
    algo = _algo(name)
    cached = name in QUICK           # (the cached evaluation of the others: same code, ditto's)
    _, ref_state, ref_m, ref_e = _run(algo, state_placement="device", cached=cached)
    program, state, m, e = _run(algo, state_placement="host", cached=cached)
    assert program.state_placement == "host"
    _leaves_equal(state, ref_state)
    _leaves_equal(m, ref_m)
    helpers.assert_evaluations_equal(e, ref_e)


@pytest.mark.slow
def test_host_state_and_host_data_together_equal_device_placement():
    algo = _algo("ditto")
    _, ref_state, ref_m, ref_e = _run(algo, state_placement="device", data_placement="device")
    program, state, m, e = _run(algo, state_placement="host", data_placement="host")
    assert program.placements.data.needs_participants and program.state_placement == "host"
    _leaves_equal(state, ref_state)
    _leaves_equal(m, ref_m)
    helpers.assert_evaluations_equal(e, ref_e)


@pytest.mark.slow
def test_bfloat16_client_state_on_the_host_equals_it_on_the_devices():
    algo = _algo("ditto")
    _, ref_state, ref_m, _ = _run(algo, state_placement="device", dtype="bfloat16")
    _, state, m, _ = _run(algo, state_placement="host", dtype="bfloat16")
    assert any(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state))
    _leaves_equal(state, ref_state)
    _leaves_equal(m, ref_m)


@pytest.mark.slow
def test_only_sampled_clients_hold_rows_and_the_prefetch_matches_its_call():
    """The store holds exactly the clients some round sampled. The rows gathered for the next
    call in the background are used only for exactly that call (a changed key schedule or a
    jump discards them), and a client sampled in two consecutive calls gets the rows the first
    call wrote: the results equal device placement's on the same schedule."""
    algo = _algo("ditto")
    schedule = [(jax.random.key(1), 0), (jax.random.key(2), 1), (jax.random.key(2), 2),
                (jax.random.key(2), 4), (jax.random.key(2), 5), (jax.random.key(2), 6)]
    _, ref_state, ref_m, ref_e = _run(algo, state_placement="device", schedule=schedule)
    program, state, m, e = _run(algo, state_placement="host", schedule=schedule)
    _leaves_equal(state, ref_state)
    _leaves_equal(m, ref_m)
    helpers.assert_evaluations_equal(e, ref_e)
    # Prefetched after each call for (k1, 1), (k2, 2), (k2, 3), (k2, 5), (k2, 6), (k2, 7).
    assert (program.placements.state.rows_hits, program.placements.state.rows_misses) == (3, 3)
    sampled = [set(np.asarray(r["sampled"]).tolist()) for r in m]
    assert any(a & b for a, b in zip(sampled[2:], sampled[3:]))   # a client sampled twice in a row
    # (the state compared above comes from the store: every sampled client's rows, others initial)
    probe = core.Program(algo, make_data(SIZES), mesh=None, state_placement="host")
    assert not probe.placements.state.prefetch_rows                     # the default on CPU
    s = probe.init(jax.random.key(0))
    for keys, r in schedule:
        s, _ = probe.run_rounds(s, keys, r, 1)
    assert sorted(s.store.ids.tolist()) == sorted(set().union(*sampled))


@pytest.mark.slow
def test_a_round_reading_rows_outside_its_participants_stops_with_an_error(monkeypatch):
    program = core.Program(_algo("ditto"), make_data(SIZES), mesh=None, state_placement="host")
    state = program.init(jax.random.key(0))
    real = program._probe
    monkeypatch.setattr(program, "_probe", lambda *a: (real(*a) + 1) % len(SIZES))
    with pytest.raises(RuntimeError, match="not among the participants"):
        program.run_rounds(state, jax.random.key(1), 0, 1)


def test_algorithms_that_touch_other_rows_refuse_host_state():
    data = make_data(SIZES)
    for name, words in (("fedamp", "fedamp does not declare"), ("pfedme", "pfedme does not"),
                        ("fedpc", "init that can be traced")):
        with pytest.raises(ValueError, match=words):
            core.Program(_algo(name), data, mesh=None, state_placement="host")
        assert core.Program(_algo(name), data, mesh=None,
                            state_placement="auto").state_placement == "device"
    with pytest.raises(ValueError, match="--state-placement must be"):
        core.Program(_algo("fedavg"), data, mesh=None, state_placement="disk")

    # An algorithm that declares host_state but starts clients from different rows is caught.
    inner = _algo("local")

    def init(key, d):
        s = inner.init(key, d)
        return s._replace(params=jax.tree.map(
            lambda a: a + jnp.arange(a.shape[0], dtype=a.dtype).reshape((-1,) + (1,) * (a.ndim - 1)),
            s.params))

    odd = Algorithm("odd", init, inner.round_fn, inner.evaluate, {}, host_state=True,
                    participants=inner.participants)
    program = core.Program(odd, data, mesh=None, state_placement="host")
    with pytest.raises(ValueError, match="different initial rows of .*params"):
        program.init(jax.random.key(0))


@pytest.mark.slow
def test_the_memory_plan_of_host_state():
    data = make_data(SIZES)
    algo = _algo("ditto")                       # personal model + two momentum rows per client
    device = core.Program(algo, data, mesh=None)
    host = core.Program(algo, data, mesh=None, state_placement="host", rounds_per_call=2)
    host.compile(jax.random.key(1))
    plan, whole = host.memory_plan(), device.memory_plan()
    row = whole.state_per_client                # bytes of one client's rows
    params = 5 * 3 + 3                          # the linear model's w and b, float32
    assert row == 3 * params * 4
    assert plan.state_placement == "host" and plan.host_row_bytes == row
    assert plan.state_per_client == 0           # nothing on the devices grows with N
    # On the device: one call's world, 2 rounds × M = 3 clients, or an evaluation group of 4.
    assert plan.world_rows == 6 and plan.client_state_per_device == 6 * row
    assert "client state on the host" in plan.describe()


@pytest.mark.slow
def test_resume_across_state_placements(tmp_path):
    """--resume may change --state-placement: a checkpoint written with the client rows on the
    devices restores into a host store holding exactly those rows, and one written from a host
    store restores into the device state exactly."""
    from fedjax_pfl import checkpoint, runner
    from fedjax_pfl.runner import checkpoints

    quiet = lambda *_: None
    cfg = lambda out, rounds, placement, *more: helpers.default_config(
        "ditto", out, rounds, "--state-placement", placement, *more, checkpoint_every=2)
    runner.run(cfg(tmp_path / "device", 2, "device"), log=quiet)
    runner.run(cfg(tmp_path / "host", 2, "host"), log=quiet)
    saved = {p: str(tmp_path / p / "checkpoints" / "round_000002") for p in ("device", "host")}
    assert "store/ids" in checkpoint.read_host(saved["host"])
    programs = {p: runner.prepare(cfg(tmp_path / "x", 2, p)) for p in ("device", "host")}
    device_state = checkpoints.load(saved["device"], None, programs["device"])[0]
    for written in ("device", "host"):
        for reading, prep in programs.items():
            state = checkpoints.load(saved[written], None, prep)[0]
            assert isinstance(state, core.StoredState) == (reading == "host")
            if reading == "host":
                touched = state.store.touched
                assert touched == (20 if written == "device" else len(np.unique(np.concatenate(
                    checkpoint.read_host(saved["host"])["sampled"]))))
            if written == "device":
                _leaves_equal(_whole(prep.program, state), device_state)
    # host → device and device → host agree with each other once both are whole
    a = _whole(programs["host"].program,
               checkpoints.load(saved["host"], None, programs["host"])[0])
    b = jax.device_get(checkpoints.load(saved["host"], None, programs["device"])[0])
    _leaves_equal(a, b)
    # (a host-state run stopped and resumed equals one that never stopped: over two processes
    # in tests/system/test_multiprocess.py)


SCRIPT = textwrap.dedent('''
    import sys
    sys.path.insert(0, "tests/support")
    import fedjax_pfl
    assert fedjax_pfl.use_cpu_cores(2) == 2
    import jax, numpy as np
    from fedjax_pfl import algorithms, core
    from fedjax_pfl.core import transfer
    from fedjax_pfl.core import world as world_lib
    import helpers
    from helpers import linear_model, make_data

    def whole(program, state):
        if isinstance(state, core.StoredState):
            rows = state.store.gather(np.arange(program.num_clients))
            split = program.placements.state.host
            return split.treedef.unflatten(split.join(jax.device_get(state.device), rows))
        return jax.device_get(state)

    def run(algo, data, mesh, per_call, placement, data_placement, worlds=None, dtype="float32",
            prefetch=None):
        program = core.Program(algo, data, mesh=mesh, rounds_per_call=per_call,
                               state_placement=placement, data_placement=data_placement,
                               state_dtype=dtype)
        if prefetch is not None:
            program.placements.state.prefetch_rows = prefetch       # (off by default on CPU)
        if worlds is not None:   # each call's world, and the devices and lengths of its rows' shards
            put = program.placements.state.put_rows

            def recorded(rows, world):
                rows = put(rows, world)
                shards = sorted(rows[0].addressable_shards, key=lambda s: s.index[0].start or 0)
                worlds.append((world, [(s.device, s.data.shape[0]) for s in shards]))
                return rows

            program.placements.state.put_rows = recorded
        state = program.init(jax.random.key(0))
        ms = []
        for r in range(0, 4, per_call):
            state, m = program.run_rounds(state, jax.random.key(1), r, per_call)
            ms += m
        return jax.tree.leaves((whole(program, state), ms)), program.evaluate(state), program

    def same(a, b):
        for x, y in zip(a[0], b[0], strict=True):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                x, y = jax.random.key_data(x), jax.random.key_data(y)
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        helpers.assert_evaluations_equal(a[1], b[1])

    two = make_data([12, 30, 7, 19, 25, 3, 40, 11, 9])      # N = 9, padded to 10
    mesh = core.client_mesh()
    for name, data_placement, dtype in (("ditto", "device", "float32"),
                                        ("pgfedmo", "host", "float32"),
                                        ("ditto", "device", "bfloat16")):
        # (M = 5: each device's block of the sample is padded, and clients cross in both calls;
        # the bfloat16 rows also with the next call's rows prefetched)
        hp = {"participation": 0.6, "batch_size": 4, **algorithms.spec(name).test_hparams}
        algo = algorithms.get(name, model=linear_model(), **hp)
        host = run(algo, two, mesh, 2, "host", data_placement, dtype=dtype,
                   prefetch=True if dtype == "bfloat16" else None)
        if dtype == "bfloat16":      # rows stored in bfloat16 on the host too; prefetched rows used
            assert any(x.dtype == jax.numpy.bfloat16 for x in host[0]), name
            rows = host[2].placements.state
            assert rows.rows_hits > 0, rows.rows_misses
        same(run(algo, two, mesh, 2, "device", data_placement, dtype=dtype), host)
        # The calls in which a client is trained by one device in the first round and by the
        # other in the second (the mapper deals blocks of ceil(M/2)): its rows cross between the
        # devices (core.world's ring), with the same bits as above.
        program, crossing = host[2], 0
        for first in (0, 2):
            ids = np.asarray(program._participants(jax.random.key(1), first, 2))
            r = -(-ids.shape[1] // 2)
            device = [{int(c): j // r for j, c in enumerate(row)} for row in ids]
            crossing += any(device[1][c] != d for c, d in device[0].items() if c in device[1])
        assert crossing > 0 and program.world_crossings == crossing, (name, crossing)

    # One round per call: each device holds only the rows of the clients the mapper deals it
    # (contiguous blocks of ceil(M/D) of the sampled order), no row crosses, same bits; M = 3
    # (odd: the second device's block is padded).

    for participation in (0.3,):
        hp = {"participation": participation, "batch_size": 4, **algorithms.spec("ditto").test_hparams}
        algo = algorithms.get("ditto", model=linear_model(), **hp)
        worlds = []
        host = run(algo, two, mesh, 1, "host", "device", worlds)
        same(run(algo, two, mesh, 1, "device", "device"), host)
        program = host[2]
        assert program.world_crossings == 0
        m = int(program.placements.state.per_round)
        r = -(-m // 2)
        for call, (world, shards) in enumerate(worlds[:4]):      # (then the evaluation's)
            assert world.size == 2 * r
            assert shards == [(mesh.devices.flat[d], r) for d in range(2)]
            sampled = np.asarray(program._participants(jax.random.key(1), call, 1))[0]
            for d in range(2):
                want = np.sort(sampled[d * r:(d + 1) * r])
                held = world[d * r:(d + 1) * r]
                np.testing.assert_array_equal(held[:want.size], want)
                assert (held[want.size:] == program.num_clients).all()

    # world.take / world.put against a dense array: the mapper's order (no crossing), other
    # orders (the ring: same values), repeated ids (the last write wins, as a scatter in order),
    # an odd count (padding), and an id no device holds. ([13, 2, 13, 7]: device 1 holds 13 and
    # writes its own slot 2 first; device 0's earlier slot 0 arrives after it and must lose.)
    rng = np.random.default_rng(3)
    n = 20
    dense = rng.normal(size=(n, 3)).astype(np.float32)
    world = np.array([2, 5, 11, 20, 0, 7, 13, 19], np.int32)       # block 0 | block 1, padded
    rows = dense[np.minimum(world, n - 1)]
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("clients"))
    ids_d, rows_d = jax.device_put(world, sharding), jax.device_put(rows, sharding)
    take = jax.jit(lambda i, r, idx: (lambda o: (o[0][0],) + o[1:])(world_lib.take(mesh, i, [r], idx)))
    put = jax.jit(lambda i, r, idx, v: (lambda o: (o[0][0],) + o[1:])(world_lib.put(mesh, i, [r], idx, [v])))
    for idx, crossed in (([5, 2, 11, 0, 13, 19], False), ([2, 5, 7, 13], False),
                         ([13, 19, 0, 2, 5, 11], True), ([7, 2, 5], True), ([0, 5, 2, 5, 7], True),
                         ([11, 7, 11], True), ([13, 2, 13, 7], True), ([5, 5, 13, 13], False)):
        idx = np.array(idx, np.int32)
        got, miss, cross = take(ids_d, rows_d, idx)
        np.testing.assert_array_equal(np.asarray(got), dense[idx])
        assert not bool(miss) and bool(cross) == crossed, idx
        values = rng.normal(size=(idx.size, 3)).astype(np.float32)
        new, miss, cross = put(ids_d, rows_d, idx, values)
        want = dense.copy()
        for i, v in zip(idx, values):               # a scatter in order: the last write wins
            want[i] = v
        new = np.asarray(new)
        held = world < n
        np.testing.assert_array_equal(new[held], want[world[held]])
        assert not bool(miss) and bool(cross) == crossed, idx
    # Ids of any shape, and values broadcast to the slots, as x[idx] and x.at[idx].set(v) take them.
    square = np.array([[5, 2], [13, 0]], np.int32)
    np.testing.assert_array_equal(np.asarray(take(ids_d, rows_d, square)[0]), dense[square])
    ones = np.asarray(put(ids_d, rows_d, np.array([2, 13], np.int32), np.ones(3, np.float32))[0])
    assert (ones[[0, 6]] == 1).all() and np.array_equal(ones[[1, 2, 4, 5, 7]], rows[[1, 2, 4, 5, 7]])
    for idx in ([5, 3], [13, 3, 2], [-2, 5]):       # 3 is held by no device, nor is -2
        idx = np.array(idx, np.int32)
        assert bool(take(ids_d, rows_d, idx)[1])
        assert bool(put(ids_d, rows_d, idx, np.zeros((idx.size, 3), np.float32))[1])

    # Rows moved between host and devices per process (resume across state placements), each
    # device pretended to be its own process: rows 0-2 on "process" 0's device, 3-5 on 1's.

    mesh = core.client_mesh()
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("clients"))
    dense = np.arange(6 * 3, dtype=np.float32).reshape(6, 3)
    a = jax.device_put(dense, sharding)
    process_of = {d: i for i, d in enumerate(mesh.devices.flat)}.__getitem__
    assert transfer.rows_held(a.shape, sharding, 1, process_of).tolist() == [0, 0, 0, 1, 1, 1]
    for owners, exchanged in (([0, 0, 0, 1, 1, 1], []), ([0, 0, 1, 1, 1, 0], [2, 5])):
        owners = np.array(owners)
        assert transfer.rows_to_exchange(a.shape, sharding, owners, process_of).tolist() == exchanged
        for p in (0, 1):
            np.testing.assert_array_equal(transfer.owned_rows(a, owners, p, process_of),
                                          dense[owners == p])
    asked = []
    b = transfer.put_rows_from(dense.shape, np.float32, sharding,
                                lambda ids: asked.append(ids.tolist()) or dense[ids])
    assert sorted(asked) == [[0, 1, 2], [3, 4, 5]] and b.sharding == sharding
    np.testing.assert_array_equal(np.asarray(b), dense)
    print("OK")
''')


@pytest.mark.slow
def test_host_state_on_two_devices_with_two_rounds_per_call():
    """Host against device state placement bit for bit (state, metrics, evaluation) on two
    devices with two rounds per call (the device-balanced sample order, resident rows sharded,
    one world dealt to the devices for both rounds, rows crossing between them; pgfedmo with its
    data on the host too; ditto's rows in bfloat16, the next call's rows prefetched) and with
    one (no row crosses; each device holds exactly its dealt clients' rows); `core.world`'s
    reads and writes against a dense array; and the rows a process moves between host and
    devices, each device pretended to be its own process."""
    env = {**os.environ, "FEDJAX_PFL_CPU_DEVICES": "2"}
    env["XLA_FLAGS"] = helpers.without_device_count(env.get("XLA_FLAGS", ""))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True,
                          text=True, env=env, cwd=root, timeout=900)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr[-3000:]
