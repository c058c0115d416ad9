"""Clients that never train (--unseen-clients, issue 57 item 3), against expectations derived
here: the held-out set's size ⌈FRAC·N⌉ by hand and its seeding; the held-out clients' state rows
bit for bit equal to `init`'s after several rounds (Ditto, pFedSOP); no held-out id in any
round's sampled ids, fixed or Poisson, and the declared participants the round's; the newcomer
rule of FedAvg (the global model, evaluated here with NumPy) and of FedAvg-FT (one full-batch
gradient step of the global model on the client's own data, written here in NumPy); the
refusals; every algorithm has a declared rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import linear_model, make_raw

from fedjax_pfl import algorithms
from fedjax_pfl.algorithms import engine, newcomers
from fedjax_pfl.data.federated import FederatedData

SIZES = [7, 12, 9, 5, 11, 8, 6, 10]           # N = 8
N = len(SIZES)


def _data(pad: int = 0):
    x, y, train, test, scale, shift = make_raw(SIZES, test_sizes=[4] * N)
    data = FederatedData.from_arrays(x, y, train, test, num_classes=3, input_scale=scale,
                                     input_shift=shift, name="toy")
    return (data.pad_clients(pad, minimum=1) if pad else data), (x, y, train, test)


def test_the_held_out_set_is_ceil_frac_n_clients_drawn_from_the_seed():
    # N = 10: ⌈0.2·10⌉ = 2, ⌈0.25·10⌉ = 3 (2.5 up), ⌈0.01·10⌉ = 1, 0 → none, ⌈0.95·10⌉ = 10;
    # N = 100: ⌈0.07·100⌉ = 7 (0.07·100 is 7.000000000000001 in floating point: a bare ceil
    # would give 8).
    for fraction, n, want in ((0.2, 10, 2), (0.25, 10, 3), (0.01, 10, 1), (0.0, 10, 0),
                              (0.95, 10, 10), (0.07, 100, 7)):
        ids = engine.unseen_ids(fraction, 0, n)
        assert ids.size == want, fraction
        assert np.all(np.diff(ids) > 0) and (ids.size == 0 or (ids.min() >= 0 and ids.max() < n))
    a, b = engine.unseen_ids(0.2, 3, 50), engine.unseen_ids(0.2, 3, 50)
    np.testing.assert_array_equal(a, b)                       # the same seed: the same set
    assert not np.array_equal(a, engine.unseen_ids(0.2, 4, 50))   # another seed: another
    mask = engine.unseen_mask(0.2, 3, 50)
    np.testing.assert_array_equal(np.flatnonzero(mask), a)


def _rows_with_client_axis(state, n):
    return [leaf for leaf in jax.tree.leaves(state) if getattr(leaf, "shape", ())[:1] == (n,)]


@pytest.mark.parametrize("name", ["ditto", "pfedsop"])
@pytest.mark.slow
def test_held_out_rows_never_change_and_are_never_sampled(name):
    data, _ = _data()
    fraction, seed = 0.25, 5                                   # U = 2 of 8; M = 2 a round
    algo = algorithms.get(name, model=linear_model(), unseen_clients=fraction, unseen_seed=seed,
                          participation=0.25, batch_size=4, lr=0.1, backend="vmap",
                          **algorithms.spec(name).test_hparams)
    unseen = engine.unseen_ids(fraction, seed, N)
    seen = np.setdiff1d(np.arange(N), unseen)
    state0 = algo.init(jax.random.key(0), data)
    init_rows = [np.asarray(x) for x in _rows_with_client_axis(state0, data.num_clients)]
    assert init_rows, "the algorithm keeps per-client rows"
    step = jax.jit(algo.round_fn)
    state, sampled = state0, []
    for r in range(6):
        key = jax.random.fold_in(jax.random.key(1), r)
        state, m = step(state, data, key)
        ids = np.asarray(m["sampled"])
        np.testing.assert_array_equal(np.asarray(algo.participants(data, key)), ids)
        sampled.append(ids)
    sampled = np.concatenate(sampled)
    assert not np.isin(sampled, unseen).any()
    assert set(sampled.tolist()) <= set(seen.tolist())
    rows = [np.asarray(x) for x in _rows_with_client_axis(state, data.num_clients)]
    changed = False
    for before, after in zip(init_rows, rows, strict=True):
        np.testing.assert_array_equal(after[unseen], before[unseen])     # bit for bit
        changed |= not np.array_equal(after[sampled], before[sampled])
    assert changed, "the sampled clients' rows did train"


@pytest.mark.slow
def test_poisson_rounds_never_draw_a_held_out_client():
    data, _ = _data(pad=4)
    algo = algorithms.get("fedavg", model=linear_model(), unseen_clients=0.5, unseen_seed=2,
                          participation=0.6, sampling="poisson", dp_clip=float("inf"),
                          batch_size=4, backend="vmap")
    unseen = engine.unseen_ids(0.5, 2, N)
    state = algo.init(jax.random.key(0), data)
    step = jax.jit(algo.round_fn)
    drawn = []
    for r in range(25):
        key = jax.random.key(r)
        state, m = step(state, data, key)
        ids = np.asarray(m["sampled"])
        np.testing.assert_array_equal(np.asarray(algo.participants(data, key)), ids)
        real = ids[ids < N]
        assert np.all(ids[ids >= N] == N)          # empty slots hold the first padding client
        assert np.all(np.diff(real) > 0)
        drawn.append(real)
    drawn = np.concatenate(drawn)
    assert not np.isin(drawn, unseen).any()
    # each of the 4 others, w.p. 0.6 a round for 25 rounds, is drawn (a miss: 0.4^25)
    assert set(drawn.tolist()) == set(np.setdiff1d(np.arange(N), unseen).tolist())


def _numpy_eval(params, x, y):
    logits = x @ np.asarray(params["w"], np.float64) + np.asarray(params["b"], np.float64)
    return int(np.sum(np.argmax(logits, axis=1) == y))


def test_fedavg_evaluates_a_newcomer_with_the_global_model():
    data, (x, y, _, test) = _data()
    algo = algorithms.get("fedavg", model=linear_model(), unseen_clients=0.25, unseen_seed=1,
                          participation=0.5, batch_size=4, lr=0.3, backend="vmap")
    state = algo.init(jax.random.key(0), data)
    for r in range(3):
        state, _ = jax.jit(algo.round_fn)(state, data, jax.random.key(r))
    unseen = engine.unseen_ids(0.25, 1, N)
    ev = algo.evaluate(state, data, jnp.asarray(unseen))["client"]
    for k, i in enumerate(unseen):
        assert int(ev.correct[k]) == _numpy_eval(state.params, x[test[i]], y[test[i]])
        assert int(ev.count[k]) == len(test[i])


@pytest.mark.slow
def test_fedavg_ft_fine_tunes_a_newcomer_from_the_global_model():
    """FedAvg-FT: one epoch of one full batch (B ≥ n) is one gradient step of the mean softmax
    cross-entropy from the global model: w − η Xᵀ(softmax(Xw + b) − Y)/n, b − η Σ(…)/n."""
    data, (x, y, train, test) = _data()
    lr = 0.5
    algo = algorithms.get("fedavg_ft", model=linear_model(), unseen_clients=0.25, unseen_seed=1,
                          participation=0.5, batch_size=16, lr=lr, ft_epochs=1, backend="vmap")
    state = algo.init(jax.random.key(0), data)
    for r in range(2):
        state, _ = jax.jit(algo.round_fn)(state, data, jax.random.key(r))
    unseen = engine.unseen_ids(0.25, 1, N)
    ev = algo.evaluate(state, data, jnp.asarray(unseen))
    w, b = (np.asarray(state.params[k], np.float64) for k in ("w", "b"))
    for k, i in enumerate(unseen):
        xt, yt = x[train[i]].astype(np.float64), y[train[i]]
        logits = xt @ w + b
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        g = (p - np.eye(3)[yt]) / len(yt)
        tuned = {"w": w - lr * xt.T @ g, "b": b - lr * g.sum(0)}
        assert int(ev["client"].correct[k]) == _numpy_eval(tuned, x[test[i]], y[test[i]])
        logits = x[test[i]] @ tuned["w"] + tuned["b"]
        lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
        np.testing.assert_allclose(float(ev["client"].loss_sum[k]),
                                   np.sum(lse - logits[np.arange(len(test[i])), y[test[i]]]),
                                   rtol=1e-4)
        assert int(ev["global"].correct[k]) == _numpy_eval(state.params, x[test[i]], y[test[i]])


def test_refusals_in_one_line():
    data, _ = _data()
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match=r"--unseen-clients must be in \[0, 1\)"):
            algorithms.get("fedavg", model=linear_model(), unseen_clients=bad)
    # U = ⌈0.8·8⌉ = 7 held out leaves 1 < M = ⌊8·0.25⌋ = 2
    algo = algorithms.get("fedavg", model=linear_model(), unseen_clients=0.8, participation=0.25)
    with pytest.raises(ValueError, match="leaving 1: fewer than the 2 a round samples"):
        algo.round_fn(algo.init(jax.random.key(0), data), data, jax.random.key(0))
    for name in newcomers.REFUSED:
        with pytest.raises(ValueError, match="trains every client each round"):
            algorithms.get(name, model=linear_model(), unseen_clients=0.25)


def test_every_algorithm_declares_how_it_evaluates_a_newcomer():
    names = set(algorithms.names())
    assert names == set(newcomers.NEWCOMER_RULES) | set(newcomers.REFUSED)
    assert not set(newcomers.NEWCOMER_RULES) & set(newcomers.REFUSED)
