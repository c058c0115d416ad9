"""Client data on the host, streamed round by round (`--data-placement host`, `core.data_placement`).

- what a round's buffer holds, checked against the raw arrays by hand: exactly its participants'
  training samples, one client after another, zero padding after them, the participants'
  starts pointing into it; its size the M largest clients' samples together;
- the participants are the clients the round samples, recomputed here from the documented key
  schedule (`fold_in(round_keys, r)`, its first split, `core.sample_clients`);
- host placement gives the rounds and evaluations of device placement bit for bit (state,
  metrics, evaluation) for fedavg, pgfedmo, ditto, fedpc and fedrep (a split model); on two
  devices and with two rounds per call (`--rounds-per-call 2`) in a subprocess, where sharded
  placement (`core.sharded`: each device its own range of clients) gives them too;
- the prefetched buffer is used only for the keys and rounds it was made for: a changed key
  schedule or another first round discards it, and a round that trains clients outside its
  buffer stops with an error.
"""

import json
import os
import subprocess
import sys
import textwrap

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import linear_model, make_data, make_raw

from fedjax_pfl import algorithms, core

SIZES = [12, 30, 7, 19, 25, 3, 40, 11, 9, 22]


def _algo(name, **extra):
    hp = {"participation": 0.3, "batch_size": 4, "lr": 0.05,
          **algorithms.spec(name).test_hparams, **extra}
    return algorithms.get(name, model=linear_model(), **hp)


def _leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) and la
    for x, y in zip(la, lb):
        if jax.dtypes.issubdtype(jnp.asarray(x).dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def _run(algo, data, placement, *, rounds=4, per_call=1, keys=None):
    program = core.Program(algo, data, mesh=None, data_placement=placement,
                           rounds_per_call=per_call)
    if program.placements.data.needs_participants:   # (off by default on CPU; its bookkeeping is tested)
        program.placements.data.prefetch_enabled = True
    state = program.init(jax.random.key(0))
    keys = jax.random.key(1) if keys is None else keys
    program.compile(keys)
    metrics = []
    for r in range(0, rounds, per_call):
        state, m = program.run_rounds(state, keys, r, per_call)
        metrics += m
    return program, jax.device_get(state), metrics, program.evaluate(state)


def test_the_round_buffer_holds_exactly_the_participants_training_samples():
    x, y, train, test, _, _ = make_raw(SIZES)
    program = core.Program(_algo("fedavg"), make_data(SIZES), mesh=None, data_placement="host")
    data = program.data
    keys = jax.random.key(5)
    staged = program.placements.data.stage(keys, 2, 1)
    ids = staged.ids[0]
    # The participants: the round's own sampling, by the documented key schedule.
    sample_key, _ = jax.random.split(jax.random.fold_in(keys, 2))
    want_ids = np.asarray(core.sample_clients(sample_key, len(SIZES), 3))
    np.testing.assert_array_equal(ids, want_ids)
    # M = 3 clients: the buffer fits the 3 largest (40 + 30 + 25 samples), whichever are drawn.
    assert staged.data.x.shape[0] == 95 and program.placements.data.round_rows == 95
    bx, by = np.asarray(staged.data.x), np.asarray(staged.data.y)
    starts = np.asarray(staged.data.clients.train_start)
    at = 0
    for i in sorted(ids):
        assert starts[i] == at
        np.testing.assert_array_equal(bx[at:at + SIZES[i]], x[train[i]])
        np.testing.assert_array_equal(by[at:at + SIZES[i]], y[train[i]])
        at += SIZES[i]
    assert not bx[at:].any() and not by[at:].any()                       # zero padding after
    np.testing.assert_array_equal(np.asarray(staged.data.clients.train_count), SIZES)
    # The whole dataset stays on the host.
    assert isinstance(data.x, np.ndarray) and data.x.shape[0] == x.shape[0]


@pytest.mark.parametrize("name", ["fedavg"] + [
    pytest.param(n, marks=pytest.mark.slow) for n in ("pgfedmo", "ditto", "fedpc", "fedrep")])
@pytest.mark.slow
def test_host_placement_equals_device_placement_bit_for_bit(name):
    data = make_data(SIZES)
    algo = _algo(name)
    _, ref_state, ref_m, ref_ev = _run(algo, data, "device")
    program, state, m, ev = _run(algo, data, "host")
    assert program.data_placement == "host" and program.placements.data.hits == 3   # 3 of 4 prefetched
    _leaves_equal(state, ref_state)
    _leaves_equal(m, ref_m)
    helpers.assert_evaluations_equal(ev, ref_ev)


@pytest.mark.slow
def test_a_prefetch_for_other_keys_or_rounds_is_never_used():
    """The runner's key schedule changes between calls (another seed's keys, a jump to another
    round): the buffer prefetched for the old schedule is discarded and the rounds equal device
    placement's on the new schedule."""
    data = make_data(SIZES)
    algo = _algo("pgfedmo")
    schedule = [(jax.random.key(1), 0), (jax.random.key(2), 1), (jax.random.key(2), 3),
                (jax.random.key(2), 4)]

    def run(placement):
        program = core.Program(algo, data, mesh=None, data_placement=placement)
        if program.placements.data.needs_participants:     # (off by default on CPU)
            program.placements.data.prefetch_enabled = True
        state = program.init(jax.random.key(0))
        out = []
        for keys, r in schedule:
            state, m = program.run_rounds(state, keys, r, 1)
            out.append(m[0])
        return program, jax.device_get(state), out

    _, ref_state, ref_m = run("device")
    program, state, m = run("host")
    # Prefetched after each call: (key 1, round 1), (key 2, round 2), (key 2, round 4), (…, 5):
    # only the last call's rounds matched.
    assert (program.placements.data.hits, program.placements.data.misses) == (1, 3)
    _leaves_equal(state, ref_state)
    _leaves_equal(m, ref_m)


@pytest.mark.slow
def test_a_round_training_clients_outside_its_buffer_stops_with_an_error(monkeypatch):
    algo = _algo("fedavg")
    program = core.Program(algo, make_data(SIZES), mesh=None, data_placement="host")
    state = program.init(jax.random.key(0))
    real = program.placements.data._participants
    # The probe answers the next clients over: the buffer holds clients the round does not train.
    monkeypatch.setattr(program.placements.data, "_participants",
                        lambda *a: (real(*a) + 1) % len(SIZES))
    with pytest.raises(RuntimeError, match="not among the participants"):
        program.run_rounds(state, jax.random.key(1), 0, 1)


def test_auto_placement_and_the_memory_plan():
    data = make_data(SIZES)
    algo = _algo("fedavg")
    auto = core.Program(algo, data, mesh=None, data_placement="auto")
    assert auto.data_placement == "device"                  # a tiny dataset fits on the device
    host = core.Program(algo, data, mesh=None, data_placement="host")
    assert not host.placements.data.prefetch_enabled      # on CPU: the thread would compete for the cores
    early = host.memory_plan()                      # before compile: no working set yet, said so
    assert not early.compiled and early.working_set == 0
    assert "working set not known yet" in early.describe()
    host.compile(jax.random.key(1))
    plan = host.memory_plan()
    assert plan.compiled and "not known" not in plan.describe()
    x, y, *_ = make_raw(SIZES)
    row = x[0].nbytes + 4                                   # float32 features + an int32 label
    assert plan.data_placement == "host" and plan.data_whole == x.nbytes + y.size * 4
    # Two round buffers of 95 rows, or one evaluation group (4 clients: 40+30+25+22 train and
    # 13+10+8+7 test samples), plus the [N] start arrays.
    assert plan.data == row * max(2 * 95, 117 + 38) + 16 * len(SIZES)
    assert "data on the host" in plan.describe()
    with pytest.raises(ValueError, match="--data-placement"):
        core.Program(algo, data, mesh=None, data_placement="disk")
    with pytest.raises(ValueError, match="vectorised"):
        core.Program(algorithms.get("fedavg", model=linear_model(), backend="loop"), data,
                     mesh=None, jit=False, data_placement="host")


SCRIPT = textwrap.dedent('''
    import sys
    sys.path.insert(0, "tests/support")
    import fedjax_pfl
    assert fedjax_pfl.use_cpu_cores(2) == 2
    import jax, numpy as np
    import pytest
    from fedjax_pfl import algorithms, core
    from fedjax_pfl.core.rows import DeviceBlocks
    import helpers
    from helpers import linear_model, make_data, make_raw
    SIZES = [12, 30, 7, 19, 25, 3, 40, 11, 9]
    data = make_data(SIZES)                                     # N = 9, padded to 10

    # Each device's block holds exactly the training samples of the participants it trains:
    # the round's participants (in the mapper's order) dealt in contiguous blocks of ceil(M/2),
    # one client after another, zeros after them; starts relative to the block; owner = block.
    # Host placement gathers the blocks on the host; sharded placement moves them between the
    # devices from each device's own range of clients.
    algo = algorithms.get("fedavg", model=linear_model(), participation=0.4, batch_size=4)
    x, y, train, test, *_ = make_raw(SIZES)
    by_start = lambda a: sorted(a.addressable_shards, key=lambda s: s.index[0].start or 0)
    for placement in ("host", "sharded"):
        program = core.Program(algo, data, mesh=core.client_mesh(), data_placement=placement)
        staged = program.placements.data.stage(jax.random.key(1), 0, 1)
        ids = staged.ids[0]
        assert program.placements.data.blocks and isinstance(staged.data.x, DeviceBlocks)
        rows = sorted(SIZES)[-1] + sorted(SIZES)[-2]             # the 2 largest clients together
        assert program.placements.data.block_rows == rows
        owner = np.asarray(staged.data.x.owner)
        start = np.asarray(staged.data.clients.train_start)
        for d, (xs, ys) in enumerate(zip(by_start(staged.data.x.rows), by_start(staged.data.y.rows))):
            mine = ids[2 * d:2 * d + 2]
            want_x = np.concatenate([x[train[i]] for i in mine])
            want_y = np.concatenate([y[train[i]] for i in mine])
            got_x, got_y = np.asarray(xs.data), np.asarray(ys.data)
            assert got_x.shape[0] == rows and xs.device == jax.devices()[d]
            np.testing.assert_array_equal(got_x[:len(want_x)], want_x)
            np.testing.assert_array_equal(got_y[:len(want_y)], want_y)
            assert not got_x[len(want_x):].any() and not got_y[len(want_y):].any()
            assert owner[mine].tolist() == [d] * len(mine)
            assert start[mine].tolist() == [0, SIZES[mine[0]]][:len(mine)]
        assert (owner[np.setdiff1d(np.arange(10), ids)] == -1).all()
        with pytest.raises(TypeError, match="per-device blocks"):
            staged.data.inputs(np.arange(3))          # not an array outside the client mapper

    # Sharded placement: clients 0-8 (and the padding client 9) in two contiguous ranges of
    # about equal samples. Train + test samples: 16 40 9 25 33 4 53 14 12, 206 in all; client i
    # goes to the device whose half holds the middle of its samples: 8, 36, 60.5, 77.5, 106.5
    # (device 1 from 103), so 0-3 on device 0 (90 samples) and 4-9 on device 1 (116). Each
    # device holds its clients' training then test samples, one client after another.
    stream = program.placements.data
    assert stream.layout.owner.tolist() == [0] * 4 + [1] * 6 and stream.layout.rows == 116
    for d, (xs, ys) in enumerate(zip(by_start(stream.owned_x), by_start(stream.owned_y))):
        mine = range(0, 4) if d == 0 else range(4, 9)
        order = np.concatenate([np.concatenate([train[i], test[i]]) for i in mine])
        got_x, got_y = np.asarray(xs.data), np.asarray(ys.data)
        assert got_x.shape[0] == 116 and xs.device == jax.devices()[d]
        np.testing.assert_array_equal(got_x[:len(order)], x[order])
        np.testing.assert_array_equal(got_y[:len(order)], y[order])
        assert not got_x[len(order):].any()
    assert stream.bytes_read == (x[:1].nbytes + 4) * 206     # each sample once (int32 labels)
    # An evaluation group dealt to the devices: each block its clients' training samples, then
    # their test samples.
    group = np.array([6, 2, 0, 5])
    ev = stream.evaluation_data(group)
    for d, xs in enumerate(by_start(ev.x.rows)):
        mine = group[2 * d:2 * d + 2]
        order = np.concatenate([train[i] for i in mine] + [test[i] for i in mine])
        np.testing.assert_array_equal(np.asarray(xs.data)[:len(order)], x[order])
        assert not np.asarray(xs.data)[len(order):].any()
    # Evaluation runs where the clients live: groups of ceil(G/D) = 2 clients from each range,
    # [0 1 | 4 5], [2 3 | 6 7], [8 9 | two fillers], each client dealt to its own device. The
    # fillers are the smallest other clients, 5 (3 + 1 samples) and 2; 8, 9 and 5 are all
    # device 1's, so 5 goes to device 0 beside 2: its 4 samples are the only rows that cross.
    moved = stream.moved_rows
    program.evaluate(program.init(jax.random.key(0)))
    assert stream.moved_rows - moved == 4
    with pytest.raises(ValueError, match="data_blocks"):
        core.Program(algorithms.get("fedfomo", model=linear_model(), participation=0.4,
                                    batch_size=4), data, mesh=core.client_mesh(),
                     data_placement="sharded")
    # auto: device while the dataset fits on both devices (with the client state, in 80 % of the
    # memory), sharded while half of it does, host below that.
    from fedjax_pfl.core import placing as placing_module
    whole, measured = data.x.nbytes + data.y.nbytes, placing_module.available_memory
    for available, want in ((4 * whole, "device"), (int(1.5 * whole / 0.8), "sharded"),
                            (int(0.9 * whole / 0.8), "host")):
        placing_module.available_memory = lambda platform, a=available: a
        assert core.Program(algo, data, mesh=core.client_mesh(),
                            data_placement="auto").data_placement == want, (available, want)
    placing_module.available_memory = measured
    program = core.Program(algo, data, mesh=core.client_mesh(), data_placement="host")

    # A probe answering the round's clients in another order (the blocks then hold other
    # clients than the devices train) stops the run; nothing is read silently: one round a
    # call, two (the count leaves a scan over the rounds), and with ditto's client rows on the
    # host (the host-state program and its scan).
    ditto = algorithms.get("ditto", model=linear_model(), participation=0.4, batch_size=4)
    for a, per_call, state_placement in ((algo, 1, "device"), (algo, 2, "device"),
                                         (ditto, 1, "host"), (ditto, 2, "host")):
        wrong = core.Program(a, data, mesh=core.client_mesh(), data_placement="host",
                             state_placement=state_placement, rounds_per_call=per_call)
        real = wrong.placements.data._participants
        wrong.placements.data._participants = lambda *args, real=real: real(*args)[:, ::-1]
        with pytest.raises(RuntimeError, match="does not hold its samples"):
            wrong.run_rounds(wrong.init(jax.random.key(0)), jax.random.key(1), 0, per_call)
    # Evaluating ids with repeats (CachedEvaluation pads that way): each client once, its rows
    # copied back, equal to device placement's.
    state = program.init(jax.random.key(0))
    ids = np.array([4, 1, 4, 7, 1, 0])
    device = core.Program(algo, data, mesh=core.client_mesh(), data_placement="device")
    helpers.assert_evaluations_equal(program.evaluate(state, ids),
                                     device.evaluate(device.init(jax.random.key(0)), ids))
    # Likewise an evaluation group staged in another order than the one it is evaluated in.
    staging = program.placements.data.evaluation_data
    program.placements.data.evaluation_data = lambda ids: staging(ids[::-1])
    with pytest.raises(RuntimeError, match="evaluation: .* does not hold its samples"):
        program.evaluate(program.init(jax.random.key(0)))     # (the failed round took `state`)
    # FedFomo declares that its round reads samples in pair order: whole buffers, no blocks.
    fomo = algorithms.get("fedfomo", model=linear_model(), participation=0.4, batch_size=4)
    assert not core.Program(fomo, data, mesh=core.client_mesh(), data_placement="host").placements.data.blocks

    # (pgfedmo on two devices one round a call: tests/system/test_multiprocess.py, two processes)
    # Placements as (data, client state); ditto with its data sharded and its client rows on
    # the host; fedpc, whose init reads every client's samples (eagerly, from the host copy).
    both = [("host", "device"), ("sharded", "device")]
    for name, per_call, placements in (("fedrep", 1, both), ("pgfedmo", 2, both),
                                       ("ditto", 1, [("sharded", "host")]),
                                       ("fedpc", 1, [("sharded", "device")])):
        hp = {"participation": 0.4, "batch_size": 4, **algorithms.spec(name).test_hparams}
        algo = algorithms.get(name, model=linear_model(), **hp)
        out = {}
        for placement in [("device", "device")] + placements:
            program = core.Program(algo, data, mesh=core.client_mesh(), data_placement=placement[0],
                                   state_placement=placement[1], rounds_per_call=per_call)
            assert (program.data_placement, program.state_placement) == placement
            state = program.init(jax.random.key(0))
            ms = []
            for r in range(0, 4, per_call):
                state, m = program.run_rounds(state, jax.random.key(1), r, per_call)
                ms += m
            out[placement] = (jax.tree.leaves(ms), program.evaluate(state))
            if placement[1] == "device":
                out[placement] += (jax.tree.leaves(jax.device_get(state)),)
        for other in placements:
            for i in ((0, 2) if other[1] == "device" else (0,)):
                for a, b in zip(out[("device", "device")][i], out[other][i], strict=True):
                    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
                        a, b = jax.random.key_data(a), jax.random.key_data(b)
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            helpers.assert_evaluations_equal(out[("device", "device")][1], out[other][1])
    print("OK")
''')


@pytest.mark.slow
def test_host_placement_on_two_devices_equals_device_placement():
    """Two devices: each device's block holds exactly the samples of the participants it trains
    (checked against the raw arrays), whether gathered on the host (host placement) or moved
    between the devices from each device's own range of clients (sharded placement, whose ranges
    are checked too); a misdealt round stops with an error; and the rounds of host and sharded
    placement equal device placement's bit for bit (sharded also with ditto's client state on
    the host, and with fedpc) (fedrep one round a call; pgfedmo two rounds per call, a scan
    over the staged rounds' blocks against a scan over the whole dataset), at the suite's
    fast-compile settings (tests/conftest.py)."""
    env = {**os.environ, "FEDJAX_PFL_CPU_DEVICES": "2"}
    env["XLA_FLAGS"] = helpers.without_device_count(env.get("XLA_FLAGS", ""))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                          cwd=root, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]


def test_a_run_may_resume_with_another_data_placement():
    """The placement moves the same samples (the rounds are bit for bit the same), so --resume
    accepts a change of --data-placement; a change of another setting is still refused."""
    from fedjax_pfl.runner.config import RunConfig, config_record, resume_conflicts

    saved = RunConfig(algo="fedavg", data_placement="host", out="/tmp/x")
    hp = saved.validate()
    record = config_record(saved, hp, "mlp", {})
    for placement in ("device", "auto"):
        cfg = RunConfig(algo="fedavg", data_placement=placement, out="/tmp/x")
        assert resume_conflicts(cfg, hp, "mlp", record) is None
    other = RunConfig(algo="fedavg", data_placement="device", seed=3, out="/tmp/x")
    from fedjax_pfl.errors import render

    assert "made with seed 0, not 3" in render(resume_conflicts(other, hp, "mlp", record))


SHARE_SCRIPT = textwrap.dedent('''
    import json, sys
    sys.path.insert(0, "tests/support")
    import fedjax_pfl
    port, pid, nproc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if nproc > 1:
        fedjax_pfl.init_distributed(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    else:
        assert fedjax_pfl.use_cpu_cores(2) == 2
    import jax, numpy as np
    from fedjax_pfl import algorithms, core
    from helpers import linear_model, make_data
    data = make_data(%r)
    algo = algorithms.get("fedavg", model=linear_model(), participation=0.5, batch_size=4)
    out = {"process": jax.process_index()}
    for placement in ("host", "sharded"):
        program = core.Program(algo, data, mesh=core.client_mesh(), data_placement=placement)
        program.placements.data.prefetch_enabled = False    # (what a round reads, not when: no round 4 staged)
        placed = int(program.placements.data.bytes_read)    # sharded: each device's range, read once
        state = program.init(jax.random.key(0))
        for r in range(3):
            state, _ = program.run_rounds(state, jax.random.key(1), r, 1)
        ids = [program.placements.data.participants(jax.random.key(1), r, 1)[0].tolist() for r in range(3)]
        plain = jax.tree.map(lambda a: jax.random.key_data(a) if jax.dtypes.issubdtype(
            a.dtype, jax.dtypes.prng_key) else a, state)
        leaves = [np.asarray(a).tolist() for a in jax.tree.leaves(core.to_host(plain))]
        read = int(program.placements.data.bytes_read)
        evals = [np.asarray(a).tolist() for a in jax.tree.leaves(program.evaluate(state))]
        out[placement] = {"placed": placed, "read": read - placed, "ids": ids, "state": leaves,
                          "evals": evals, "eval_read": int(program.placements.data.bytes_read) - read}
    print(json.dumps(out))
''' % (SIZES,))


@pytest.mark.slow
def test_each_process_reads_only_the_samples_of_the_clients_its_devices_train(tmp_path):
    """Two processes of one device each against one process of two devices: the rounds end in
    the same state, bit for bit. Host placement: each process reads from the dataset only the
    training samples of the participants dealt to its own device (ceil(M/2) of each round's M,
    in the mapper's order): about half of what the one process reads, and together exactly
    that. Sharded placement: each process reads only its device's range of clients, once, and
    nothing during the rounds and the evaluation; the same state and evaluation."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def start(pid: int, nproc: int, devices: str):
        env = {**os.environ, "FEDJAX_PFL_CPU_DEVICES": devices, "PYTHONPATH": root}
        env["XLA_FLAGS"] = helpers.without_device_count(env.get("XLA_FLAGS", ""))
        return subprocess.Popen([sys.executable, "-c", SHARE_SCRIPT, port, str(pid), str(nproc)],
                                env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)

    procs = [start(0, 2, "1"), start(1, 2, "1"), start(0, 1, "2")]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    two, one = results[:2], results[2]
    x, y, *_ = make_raw(SIZES)
    row = x[0].nbytes + 4                             # float32 features and an int32 label

    # Host placement: each process reads, round by round, only its device's participants.
    h2, h1 = [r["host"] for r in two], one["host"]
    for r in h2:
        for a, b in zip(r["state"], h1["state"], strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    per_device = [0, 0]
    assert h2[0]["ids"] == h2[1]["ids"] == h1["ids"]
    for ids in h1["ids"]:                             # the 3 rounds' participants, mapper order
        width = -(-len(ids) // 2)
        for d in (0, 1):
            per_device[d] += row * sum(SIZES[i] for i in ids[d * width:(d + 1) * width])
    assert h1["read"] == sum(per_device)
    assert sorted((r["process"], r["host"]["read"]) for r in two) == [(0, per_device[0]),
                                                                      (1, per_device[1])]
    assert all(0.3 < r["read"] / h1["read"] < 0.7 for r in h2)
    # Evaluation (groups of 8 clients, dealt to the devices by samples): the same results, and
    # each process reads only its devices' clients, together what the one process reads (every
    # client's training and test samples, plus the last group's filler clients).
    for r in h2:
        for a, b in zip(r["evals"], h1["evals"], strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert sum(r["eval_read"] for r in h2) == h1["eval_read"] >= row * x.shape[0]
    assert all(0.3 < r["eval_read"] / h1["eval_read"] < 0.7 for r in h2)

    # Sharded placement: each process reads its device's range of clients once, when the
    # program is built, and nothing after (rounds and evaluation move samples between the
    # devices); the same state and evaluation as host placement. The ranges: client i to the
    # device whose half of all samples holds the middle of its own.
    sizes = [n + max(1, n // 3) for n in SIZES]       # training + test samples
    half, before, owned = sum(sizes) / 2, 0, [0, 0]
    for n in sizes:
        owned[min(int((before + n / 2) // half), 1)] += n
        before += n
    assert owned == [123, 112]
    s2, s1 = [r["sharded"] for r in two], one["sharded"]
    assert s1["placed"] == row * sum(sizes)
    assert sorted((r["process"], r["sharded"]["placed"]) for r in two) == [(0, row * owned[0]),
                                                                          (1, row * owned[1])]
    for r in s2 + [s1]:
        assert r["read"] == r["eval_read"] == 0 and r["ids"] == h1["ids"]
        for a, b in zip(r["state"], h1["state"], strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(r["evals"], h1["evals"], strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
