"""Local training: exact per-client epochs, masking of ragged clients, hooks and the full pass."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import linear_model, make_data, make_raw, tree_allclose

from fedjax_pfl import core
from fedjax_pfl.core.local import FullPass, LocalTrainer, add_aux_gradient, masked_mean_loss, steps_per_epoch
from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.models.model import Model


def counting_data(sizes):
    """Row r's input is the one-hot vector e_r, so a model x @ c reads the scalar c[r]."""
    total = sum(sizes)
    x = np.eye(total, dtype=np.float32)
    starts = np.cumsum([0] + list(sizes))
    train = [np.arange(a, b) for a, b in zip(starts[:-1], starts[1:])]
    return FederatedData.from_arrays(x, np.zeros(total, np.int32), train, train, num_classes=1)


# Loss of sample r is c[r]; its gradient is e_r / (real batch size).
COUNTER = Model(init=lambda key: {"c": jnp.zeros(1)}, apply=lambda p, x: x @ p["c"],
                loss=lambda out, y: out)


def train(data, model, idx, *, epochs, batch_size, backend="vmap", drop_last=False, lr=1.0,
          params=None, key=0):
    trainer = LocalTrainer(model, optax.sgd(lr), epochs=epochs, batch_size=batch_size,
                           mapper=core.client_mapper(backend, 2), drop_last=drop_last)
    idx = jnp.asarray(idx)
    if params is None:
        params = model.init(jax.random.key(0))
    start = core.broadcast(params, idx.shape[0])
    opt = core.broadcast(trainer.init_opt_state(params), idx.shape[0])
    keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(key), idx)
    return trainer(data, start, opt, core.gather(data.clients, idx), keys)


@pytest.mark.parametrize("drop_last,expected", [(False, [3, 1, 0, 1]), (True, [2, 1, 0, 1])])
def test_steps_per_epoch(drop_last, expected):
    # n = 7, 3, 0, 2 with B = 3: ceil gives 3, 1, 0, 1; floor gives 2, 1, 0 and 1 (n < B: one batch).
    got = steps_per_epoch(jnp.array([7, 3, 0, 2]), 3, drop_last)
    np.testing.assert_array_equal(got, expected)


def test_each_sample_visited_once_per_epoch_with_masked_last_batch():
    # Client sizes 7 and 2 padded to 7. One epoch, B = 3, lr = 1 on c from 0: sample r in a batch
    # of b real samples moves by −1/b. Client 0 has batches of 3, 3, 1: six samples at −1/3 and one
    # at −1. Client 1 (n = 2 < B) has one batch of 2: both at −1/2. No other coordinate moves.
    data = counting_data([7, 2])
    params = {"c": jnp.zeros(9)}
    out = train(data, COUNTER, [0, 1], epochs=1, batch_size=3, params=params)
    c0, c1 = np.asarray(out.params["c"])
    np.testing.assert_allclose(np.sort(c0[:7]), [-1.0] + [-1 / 3] * 6, rtol=1e-6)
    np.testing.assert_array_equal(c0[7:], 0.0)
    np.testing.assert_allclose(c1[7:], -0.5)
    np.testing.assert_array_equal(c1[:7], 0.0)
    np.testing.assert_array_equal(out.num_steps, [3, 1])


def test_epochs_reshuffle_and_cover_every_sample():
    # B = 1: every step is one sample with gradient e_r, so after E epochs each of the client's
    # samples moved by exactly −E, and E·n steps were taken.
    data = counting_data([5, 3])
    out = train(data, COUNTER, [0, 1], epochs=4, batch_size=1, params={"c": jnp.zeros(8)})
    np.testing.assert_allclose(out.params["c"][0], [-4] * 5 + [0] * 3)
    np.testing.assert_allclose(out.params["c"][1], [0] * 5 + [-4] * 3)
    np.testing.assert_array_equal(out.num_steps, [20, 12])


_PERMUTATIONS = {unroll: jax.jit(functools.partial(core.epoch_permutation, unroll=unroll))
                 for unroll in (False, True)}
# Every n below is evaluated at the same positions 0 … 4101: n is traced, so the nine sizes share
# one compiled program per `unroll` (a length of n + 5 compiled 18 programs, ~6 s).
_POSITIONS = np.arange(4097 + 5)


@pytest.mark.parametrize("unroll", [False, True])      # the CPU's loop, the accelerators' default
@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 17, 100, 1000, 4097])
@pytest.mark.slow
def test_epoch_permutation_is_a_bijection(n, unroll):
    perm, positions = _PERMUTATIONS[unroll], _POSITIONS   # at least 5 positions beyond n return 0
    for k in range(3):
        got = np.asarray(perm(jax.random.key(k), jnp.asarray(n), positions))
        assert sorted(got[:n].tolist()) == list(range(n))
        np.testing.assert_array_equal(got[n:], 0)


@pytest.mark.parametrize("unroll", [False, pytest.param(True, marks=pytest.mark.slow)])  # (CPU: False)
@pytest.mark.slow
def test_epoch_permutations_are_uniform_over_all_orders(unroll):
    """50,400 keys on n = 7: each of the 5,040 orders about 10 times. Pearson's chi-square has
    5,039 degrees of freedom (mean 5,039, sd ≈ 100); a uniform shuffle stays below 5,039 + 5 sd.
    (A Feistel network with cycle walking, tried first, gave 6,700 at 12 rounds.)"""
    import itertools

    perm = jax.jit(jax.vmap(lambda k: core.epoch_permutation(k, jnp.asarray(7), jnp.arange(7), unroll)))
    orders = np.asarray(perm(jax.random.split(jax.random.key(0), 50_400)))
    code = {p: i for i, p in enumerate(itertools.permutations(range(7)))}
    counts = np.bincount([code[tuple(r)] for r in orders], minlength=5040)
    chi2 = ((counts - 10.0) ** 2 / 10.0).sum()
    assert chi2 < 5039 + 5 * 100.4


def test_drop_last_skips_the_partial_batch():
    # n = 7, B = 3, drop_last: two full batches per epoch; exactly one sample is not visited.
    data = counting_data([7])
    out = train(data, COUNTER, [0], epochs=1, batch_size=3, drop_last=True,
                params={"c": jnp.zeros(7)})
    np.testing.assert_allclose(np.sort(out.params["c"][0]), [-1 / 3] * 6 + [0.0], rtol=1e-6)
    np.testing.assert_array_equal(out.num_steps, [2])


@pytest.mark.parametrize("backend", ["vmap", "chunked", "loop"])
@pytest.mark.slow
def test_ragged_clients_trained_together_equal_each_alone(backend):
    # Clients of 7 and 23 samples in one call equal each trained alone: the 7-sample client's
    # masked steps after its last real step change nothing.
    data = make_data([7, 23])
    model = linear_model()
    both = train(data, model, [0, 1], epochs=3, batch_size=4, backend=backend, lr=0.1)
    for i in (0, 1):
        alone = train(data, model, [i], epochs=3, batch_size=4, backend="loop", lr=0.1)
        tree_allclose(jax.tree.map(lambda x: x[i], both.params),
                      jax.tree.map(lambda x: x[0], alone.params), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(both.loss[i], alone.loss[0], rtol=1e-6)
    np.testing.assert_array_equal(both.num_steps, [3 * 2, 3 * 6])


@pytest.mark.slow
def test_finished_clients_keep_optimizer_state():
    # With momentum, a masked step would still decay the buffer if it were applied; it must not be.
    data = make_data([2, 20])
    model = linear_model()
    trainer = LocalTrainer(model, optax.sgd(0.1, momentum=0.9), epochs=1, batch_size=2,
                           mapper=core.client_mapper("vmap"))
    params = model.init(jax.random.key(0))
    keys = jax.random.split(jax.random.key(1), 2)

    def run(idx):
        idx = jnp.asarray(idx)
        m = idx.shape[0]
        return trainer(data, core.broadcast(params, m),
                       core.broadcast(trainer.init_opt_state(params), m),
                       core.gather(data.clients, idx), keys[idx])

    together, alone = run([0, 1]), run([0])
    tree_allclose(jax.tree.map(lambda x: x[0], together.opt_state),
                  jax.tree.map(lambda x: x[0], alone.opt_state), rtol=1e-6)


def test_plain_sgd_on_quadratic_matches_closed_form(x64):
    # P(x) = ½‖x − c‖² with full batches: x_T − c = (1 − η)^T (x_0 − c).
    c = np.array([[1.0, -2.0, 0.5]])
    data = FederatedData.from_arrays(c, np.zeros(1), [np.array([0])], [np.array([0])], num_classes=1)
    model = Model(init=lambda k: {"x": jnp.zeros(3)}, apply=lambda p, x: p["x"] - x,
                  loss=lambda out, y: 0.5 * jnp.sum(out**2, axis=-1))
    out = train(data, model, [0], epochs=5, batch_size=4, lr=0.3)
    expected = c[0] + (1 - 0.3) ** 5 * (0 - c[0])
    np.testing.assert_allclose(out.params["x"][0], expected, rtol=1e-12)


def test_aux_gradient_and_on_step_hook(x64):
    # Zero data gradient: θ moves by exactly −K·η·v after K steps (docs/algorithms/pgfed.md#t26),
    # and the hook sees θ BEFORE each step: it accumulates Σ_k θ_{k−1}·1.
    data = make_data([6])
    model = Model(init=lambda k: {"w": jnp.zeros(2)}, apply=lambda p, x: 0.0 * x[:, :1] + 0 * p["w"][0],
                  loss=lambda out, y: out[:, 0])
    v = jnp.array([1.0, -2.0])

    def hook(state, params, extra):
        return state + jnp.sum(params["w"])

    trainer = LocalTrainer(model, optax.chain(add_aux_gradient(), optax.sgd(0.5)), epochs=2,
                           batch_size=2, mapper=core.client_mapper("vmap"), on_step=hook)
    params = model.init(None)
    out = trainer(data, core.broadcast(params, 1), core.broadcast(trainer.init_opt_state(params), 1),
                  data.clients, jax.random.split(jax.random.key(0), 1),
                  extra={"aux_grad": {"w": v[None]}}, hook_state=jnp.zeros(1))
    steps = 2 * 3
    np.testing.assert_allclose(out.params["w"][0], -steps * 0.5 * v)
    # Σ(θ) before step k is −(k−1)·0.5·Σv = (k−1)·0.5; summed over k = 1..6 gives 0.5·15.
    np.testing.assert_allclose(out.hook_state[0], 0.5 * 15)


@pytest.mark.slow
def test_full_pass_is_the_mean_loss_and_gradient_over_all_samples(x64):
    data = make_data([11, 4])
    x, y, train, _, _, _ = make_raw([11, 4])
    model = linear_model()
    params = model.init(jax.random.key(2))
    full = FullPass(model, batch_size=3, mapper=core.client_mapper("vmap"))
    losses, grads = full(data, core.broadcast(params, 2), data.clients)
    reference = jax.jit(jax.value_and_grad(
        lambda p, xs, ys: jnp.mean(model.loss(model.apply(p, xs), ys))))
    for i, rows in enumerate(train):               # the raw rows, independent of the layout
        ref_loss, ref_grad = reference(params, jnp.asarray(x[rows], jnp.float64), jnp.asarray(y[rows]))
        np.testing.assert_allclose(losses[i], ref_loss, rtol=1e-12)
        tree_allclose(jax.tree.map(lambda g: g[i], grads), ref_grad, rtol=1e-10)


def test_full_pass_automatic_batch_is_the_evaluations_and_gives_the_same_means(x64):
    """batch_size 0 takes auto_eval_batch (256 for this one-layer model: a few floats of
    temporaries per sample), and the means do not depend on the batch beyond rounding."""
    data = make_data([11, 4])
    model = linear_model()
    params = core.broadcast(model.init(jax.random.key(2)), 2)
    auto = FullPass(model, batch_size=0, mapper=core.client_mapper("vmap"))
    assert auto.batch_for(data) == 256
    by_3 = FullPass(model, batch_size=3, mapper=core.client_mapper("vmap"))(data, params, data.clients)
    by_auto = auto(data, params, data.clients)
    tree_allclose(by_auto, by_3, rtol=1e-12)
    with pytest.raises(ValueError, match="full-pass batch"):
        FullPass(model, batch_size=-1, mapper=core.client_mapper("vmap"))


def test_fixed_number_of_steps_walks_through_reshuffled_epochs():
    # steps = K: every client takes exactly K steps whatever its size. Client 0 (n = 7, B = 3,
    # S = 3) takes 5 steps: all of epoch 0 (batches of 3, 3, 1) and two full batches of epoch 1.
    # Each step moves Σ_j c[r_j] by −1 (batch mean), so the total movement is −5; every sample is
    # visited in epoch 0. Client 1 (n = 2 < B) repeats its single batch 5 times.
    data = counting_data([7, 2])
    trainer = LocalTrainer(COUNTER, optax.sgd(1.0), steps=5, batch_size=3,
                           mapper=core.client_mapper("vmap"))
    params = {"c": jnp.zeros(9)}
    keys = jax.random.split(jax.random.key(4), 2)
    out = trainer(data, core.broadcast(params, 2), core.broadcast(trainer.init_opt_state(params), 2),
                  data.clients, keys)
    np.testing.assert_array_equal(out.num_steps, [5, 5])
    c0, c1 = np.asarray(out.params["c"])
    assert c0[:7].sum() == pytest.approx(-5.0) and np.all(c0[:7] <= -1 / 3 + 1e-6)
    np.testing.assert_allclose(c1[7:], [-2.5, -2.5])
    # Epoch 0 gives six samples −1/3 and one sample s −1; epoch 1 gives six samples −1/3 and
    # skips one sample u. If u = s: {−1, −2/3 ×6}; otherwise {−4/3, −1/3 (u), −2/3 ×5}.
    got = sorted(np.round(c0[:7] * 3).astype(int).tolist())
    assert got in ([-3] + [-2] * 6, [-4] + [-2] * 5 + [-1])


def test_custom_step_function_runs_an_inner_loop(x64):
    # A pFedMe/TDPFed-style step: two inner gradient steps on the SAME minibatch. On the quadratic
    # P(x) = ½‖x − c‖² with one sample, each engine step is two plain steps: after K engine steps
    # x − c = (1 − η)^{2K} (x0 − c).
    c = np.array([[1.0, -2.0, 0.5]])
    data = FederatedData.from_arrays(c, np.zeros(1), [np.array([0])], [np.array([0])], num_classes=1)
    model = Model(init=lambda k: {"x": jnp.zeros(3)}, apply=lambda p, x: p["x"] - x,
                  loss=lambda out, y: 0.5 * jnp.sum(out**2, axis=-1))

    def two_inner_steps(params, opt_state, x, y, mask, extra):
        grad = jax.grad(lambda p: masked_mean_loss(model, p, x, y, mask))
        for _ in range(2):
            params = jax.tree.map(lambda p, g: p - 0.25 * g, params, grad(params))
        return params, opt_state, masked_mean_loss(model, params, x, y, mask)

    trainer = LocalTrainer(model, optax.identity(), steps=3, batch_size=1,
                           mapper=core.client_mapper("vmap"), step_fn=two_inner_steps)
    params = model.init(None)
    out = trainer(data, core.broadcast(params, 1), core.broadcast(trainer.init_opt_state(params), 1),
                  data.clients, jax.random.split(jax.random.key(0), 1))
    np.testing.assert_allclose(out.params["x"][0], c[0] + 0.75 ** 6 * (0 - c[0]), rtol=1e-12)


def test_epochs_or_steps_not_both():
    with pytest.raises(ValueError, match="exactly one of epochs"):
        LocalTrainer(COUNTER, optax.sgd(1.0), epochs=1, steps=2, batch_size=1,
                     mapper=core.client_mapper("vmap"))

# -- Guard for core/local.py (issue 30, item 10): every epoch of local training visits a client's ----


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
@pytest.mark.slow
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
@pytest.mark.slow
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
