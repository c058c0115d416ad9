"""Guard for core/local.py (issue 30, item 10): every epoch of local training visits a client's
samples in a FRESH order. Each epoch must be a permutation of the client's own samples, and the
orders must differ between epochs (a trainer that reuses one key for every epoch, or ignores
the epoch in `epoch_permutation`'s key, visits them in the same order each time).

The visited order is read directly: a `step_fn` that trains nothing and records the raw row id
carried in each sample's input (x = row id), so the expected sets come from the raw index lists
and nothing is recomputed with the code under test."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_pfl import core
from fedjax_pfl.core.local import LocalTrainer
from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.models.model import Model

SIZES = [7, 10, 2]
BATCH, EPOCHS = 3, 4


def _id_data():
    """Client i's training rows hold their own raw row ids as the (only) input feature."""
    starts = np.cumsum([0] + SIZES)
    train = [np.arange(a, b) for a, b in zip(starts[:-1], starts[1:])]
    total = int(starts[-1])
    test_rows = np.arange(total, total + len(SIZES))       # one test row each (unused here)
    x = np.arange(total + len(SIZES), dtype=np.float32)[:, None]
    data = FederatedData.from_arrays(x, np.zeros(len(x), np.int32), train,
                                     [test_rows[i:i + 1] for i in range(len(SIZES))], num_classes=2)
    return data, train


def _recording_trainer(backend, slots, **schedule):
    """A trainer (E = EPOCHS epochs unless `schedule` says otherwise) whose step writes the row
    ids of its batch (−1 at masked positions) into params["log"][t·B : (t+1)·B] at step t, and
    changes nothing else."""
    model = Model(init=lambda key: {"log": jnp.full((slots,), -2.0), "t": jnp.zeros(())},
                  apply=lambda p, x: x, loss=lambda out, y: out[:, 0])

    def record(params, opt_state, x, y, mask, extra):
        del y, extra
        t = params["t"].astype(jnp.int32)
        ids = jnp.where(mask, x[:, 0], -1.0)
        log = jax.lax.dynamic_update_slice(params["log"], ids, (t * BATCH,))
        return {"log": log, "t": params["t"] + 1}, opt_state, jnp.zeros(())

    return model, LocalTrainer(model, optax.identity(), **(schedule or {"epochs": EPOCHS}),
                               batch_size=BATCH, mapper=core.client_mapper(backend, 2),
                               step_fn=record)


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_every_epoch_is_a_fresh_permutation_of_the_clients_samples(backend):
    data, train = _id_data()
    steps = [-(-n // BATCH) for n in SIZES]                       # ⌈n_i/B⌉: 3, 4, 1
    slots = EPOCHS * max(steps) * BATCH
    model, trainer = _recording_trainer(backend, slots)
    idx = jnp.arange(len(SIZES))
    params = model.init(jax.random.key(0))
    start = core.broadcast(params, len(SIZES))
    opt = core.broadcast(trainer.init_opt_state(params), len(SIZES))
    keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(11), idx)
    out = trainer(data, start, opt, core.gather(data.clients, idx), keys)
    np.testing.assert_array_equal(out.num_steps, [EPOCHS * s for s in steps])
    logs = np.asarray(out.params["log"])
    for i, (n, s) in enumerate(zip(SIZES, steps)):
        per_epoch = logs[i, :EPOCHS * s * BATCH].reshape(EPOCHS, s * BATCH)
        np.testing.assert_array_equal(logs[i, EPOCHS * s * BATCH:], -2.0)   # no step past E·S_i
        orders = []
        for e in range(EPOCHS):
            visited = per_epoch[e][per_epoch[e] >= 0].astype(int)
            # A permutation: each of the client's own rows exactly once, real positions first.
            np.testing.assert_array_equal(np.sort(visited), train[i], err_msg=f"client {i} epoch {e}")
            np.testing.assert_array_equal(per_epoch[e][:n] >= 0, True)
            np.testing.assert_array_equal(per_epoch[e][n:], -1.0)
            orders.append(tuple(visited))
        if n > 2:
            # With n ≥ 7 orders (5,040 of them), two equal epochs among four have probability
            # < 0.2 % for a random shuffle: the fixed keys here draw four distinct ones.
            for a, b in itertools.combinations(range(EPOCHS), 2):
                assert orders[a] != orders[b], f"client {i}: epochs {a} and {b} visit {orders[a]}"
        else:
            # n = 2 has two orders; four epochs of a fresh shuffle use both (probability 7/8).
            assert len(set(orders)) == 2, f"client {i} visits its 2 samples as {orders}"


@pytest.mark.parametrize("schedule", [{"epochs": EPOCHS}, {"steps": 9}])
def test_epoch_e_of_client_i_is_the_permutation_keyed_by_its_epoch(schedule):
    """The order of epoch e is `epoch_permutation(fold_in(key_i, e), n_i, ·)`, the documented
    key schedule (benchmarks/peers/orders.py hands the peers these orders): with E epochs the
    trainer draws every epoch's shuffle when a client starts, with K steps at each step; a
    shifted or reused epoch key fails here, where the freshness test above cannot tell."""
    data, train = _id_data()
    steps = [-(-n // BATCH) for n in SIZES]
    total = [EPOCHS * s for s in steps] if "epochs" in schedule else [9] * len(SIZES)
    model, trainer = _recording_trainer("vmap", max(total) * BATCH, **schedule)
    idx = jnp.arange(len(SIZES))
    params = model.init(jax.random.key(0))
    keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(5), idx)
    out = trainer(data, core.broadcast(params, len(SIZES)),
                  core.broadcast(trainer.init_opt_state(params), len(SIZES)),
                  core.gather(data.clients, idx), keys)
    logs = np.asarray(out.params["log"])
    for i, (n, s) in enumerate(zip(SIZES, steps)):
        expected = []
        for t in range(total[i]):
            e, k = divmod(t, s)
            order = core.epoch_permutation(jax.random.fold_in(keys[i], e), n,
                                           jnp.arange(k * BATCH, (k + 1) * BATCH))
            expected += [train[i][0] + int(r) if k * BATCH + j < n else -1
                         for j, r in enumerate(np.asarray(order))]
        np.testing.assert_array_equal(logs[i, :total[i] * BATCH], expected, err_msg=f"client {i}")
