"""FedFomo (fedjax_pfl/algorithms/fedfomo.py; docs/algorithms/fedfomo.md#tests) against a naive
float64 transcription of its round, one client and one pair of clients at a time, on softmax
regression clients whose validation losses and full-batch gradient steps are written out in
NumPy."""

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_states_close, linear_model, tree_equal

from fedjax_pfl import algorithms
from fedjax_pfl.algorithms import fedfomo, registry
from fedjax_pfl.data.federated import FederatedData

SIZES = [10, 12, 9, 11, 8]
# v_i = min(⌈0.2 n_i⌉, n_i − 1): the last v_i training samples are client i's validation block.
VAL = [2, 3, 2, 3, 2]
F, K = 5, 3                     # features, classes of the linear model {w: [F, K], b: [K]}
LR = 0.3


def raw_clients(identical=False, seed=0):
    """(x, y, train index lists, test index lists): client k's rows are contiguous, its
    training rows first, so its validation rows are train[k][-VAL[k]:]."""
    x, y, train, test, _, _ = helpers.make_raw(SIZES, num_classes=K, feature_dim=F, seed=seed)
    if identical:                 # every client holds client 0's samples
        train = [train[0]] * len(SIZES)
        test = [test[0]] * len(SIZES)
    return x, y, train, test


def to_data(x, y, train, test):
    return FederatedData.from_arrays(x, y, train, test, num_classes=K)


def ce(p, x, y):
    """Mean softmax cross-entropy of {w, b} on rows (x, y), float64."""
    logits = x @ p["w"] + p["b"]
    z = logits - logits.max(1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    return float(-logp[np.arange(len(y)), y].mean())


def ce_grad(p, x, y):
    """∇ of the mean cross-entropy: Xᵀ(softmax − onehot)/n and the mean of (softmax − onehot)."""
    logits = x @ p["w"] + p["b"]
    e = np.exp(logits - logits.max(1, keepdims=True))
    g = e / e.sum(1, keepdims=True)
    g[np.arange(len(y)), y] -= 1.0
    return {"w": x.T @ g / len(y), "b": g.mean(0)}


def vec(p):
    return np.concatenate([np.ravel(p["w"]), np.ravel(p["b"])])


def naive_round(models, x, y, train, starts=None):
    """The round for every client (all sampled, all others' models downloaded), one pair at a
    time in float64: (weights [5, 5] on the other clients, updated models, trained models, train
    losses).
    `starts` given (--fedfomo-baseline start): client i compares with and moves from starts[i],
    its own trained models[i] is one more candidate, and it keeps models[i] if nothing helps."""
    n = len(models)
    weights = np.zeros((n, n))
    starts_new, trained, losses = [], [], []
    for i in range(n):
        val, tr = train[i][-VAL[i]:], train[i][:-VAL[i]]
        ref = models[i] if starts is None else starts[i]
        base_loss = ce(ref, x[val], y[val])
        cands = [j for j in range(n) if j != i] + ([] if starts is None else [i])
        pos = {}
        for j in cands:
            dist = np.sqrt(np.sum((vec(models[j]) - vec(ref)) ** 2))
            pos[j] = max(0.0, (base_loss - ce(models[j], x[val], y[val])) / dist)
        total = sum(pos.values())
        w = {j: (pos[j] / total if total > 0 else 0.0) for j in cands}
        if total == 0 and starts is not None:
            mixed = {k: models[i][k].copy() for k in ("w", "b")}
        else:
            mixed = {k: ref[k] + sum(w[j] * (models[j][k] - ref[k]) for j in cands)
                     for k in ("w", "b")}
        for j in cands:
            if j != i:
                weights[i, j] = w[j]
        g = ce_grad(mixed, x[tr], y[tr])
        starts_new.append(mixed)
        trained.append({k: mixed[k] - LR * g[k] for k in mixed})
        losses.append(ce(mixed, x[tr], y[tr]))
    return weights, starts_new, trained, losses


def one_step_algo(**hp):
    """All 5 clients sampled, one full-batch step (B ≥ n_i) of lr LR, every other model
    downloaded (C = 5 > 4 others), no exploration."""
    kw = dict(participation=1.0, local_steps=1, batch_size=16, lr=LR, candidates=8,
              val_fraction=0.2, epsilon=0.0, epsilon_decay=0.0) | hp
    return algorithms.get("fedfomo", model=linear_model(F, K), **kw)


def with_models(state, models, **changes):
    params = {k: jnp.asarray(np.stack([m[k] for m in models])) for k in ("w", "b")}
    return state._replace(params=params, uploaded=jnp.arange(len(models), dtype=jnp.int32),
                          has_prev=jnp.ones((), bool), round=jnp.ones((), jnp.int32), **changes)


def distinct_models(seed=1):
    rng = np.random.default_rng(seed)
    return [{"w": rng.normal(size=(F, K)) * 0.6, "b": rng.normal(size=K) * 0.3}
            for _ in SIZES]


@pytest.mark.parametrize("baseline", ["current", pytest.param("start", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_round_matches_the_naive_double_loop(x64, baseline):
    # T1, T2: weights, the personalised update and local training on the first n_i − v_i rows.
    x, y, train, test = raw_clients()
    models = distinct_models()
    starts = distinct_models(seed=2) if baseline == "start" else None
    # Client 4's validation labels are the (confident) predictions of a model that no candidate
    # beats there: its own model (current), or its start model (start), with its own trained
    # model worse: it keeps its model (an all-zero row), θ_4 in both readings.
    best = {k: 4.0 * v for k, v in models[4].items()}
    if starts is None:
        models[4] = best
    else:
        starts[4] = best
    val4 = train[4][-VAL[4]:]
    y = y.copy()
    y[val4] = np.argmax(x[val4] @ best["w"] + best["b"], axis=1)
    data = to_data(x, y, train, test)
    algo = one_step_algo(baseline=baseline)
    state = algo.init(jax.random.key(0), data)
    if starts is not None:
        state = state._replace(start={k: jnp.asarray(np.stack([m[k] for m in starts]))
                                      for k in ("w", "b")})
    state = with_models(state, models)
    new, metrics = jax.jit(algo.round_fn)(state, data, jax.random.key(3))
    weights, mixed, trained, losses = naive_round(models, x.astype(np.float64), y, train, starts)
    # The case is not trivial: some row mixes several models, some pair loses, client 4 keeps.
    assert np.any((weights > 0).sum(1) >= 2) and np.all(weights[4] == 0)
    if starts is not None:        # and some client's own trained model shares its new model
        assert np.any((weights.sum(1) > 0.01) & (weights.sum(1) < 0.99))
    np.testing.assert_allclose(new.affinity, weights, rtol=1e-10, atol=1e-12)       # P += W
    for k in ("w", "b"):
        np.testing.assert_allclose(new.params[k], np.stack([t[k] for t in trained]),
                                   rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(metrics["train_loss"], losses, rtol=1e-10)
    if starts is not None:        # where each client's training began: the next round's baseline
        for k in ("w", "b"):
            np.testing.assert_allclose(new.start[k], np.stack([t[k] for t in mixed]), rtol=1e-10,
                                       atol=1e-12)
    # T2: non-negative, each row sums to 1 where anything is positive, else 0.
    assert np.all(np.asarray(new.affinity) >= 0)
    sums = np.asarray(new.affinity).sum(1)
    if starts is None:
        np.testing.assert_allclose(sums, [1.0 if s > 0 else 0.0 for s in weights.sum(1)],
                                   atol=1e-12)
    assert np.all(sums <= 1 + 1e-12)
    off = ~np.eye(5, dtype=bool)
    np.testing.assert_allclose(metrics["w_self_mean"], np.mean(1 - weights.sum(1)), atol=1e-12)
    np.testing.assert_allclose(metrics["w_other_max"], weights[off].max(), rtol=1e-12)
    np.testing.assert_allclose(metrics["w_other_mean"], weights[off].sum() / 20, rtol=1e-12)
    np.testing.assert_allclose(metrics["w_positive_fraction"], (weights[off] > 0).mean())
    np.testing.assert_allclose(metrics["candidates_mean"], 4.0)


def test_identical_clients_keep_their_model_and_train_locally(x64):
    # T3: identical clients with one model: no candidate improves anything (ΔL = 0 = distance),
    # so every client keeps θ and the round is one full-batch step on its training part.
    x, y, train, test = raw_clients(identical=True)
    data = to_data(x, y, train, test)
    algo = one_step_algo()
    theta = distinct_models()[0]
    state = with_models(algo.init(jax.random.key(0), data), [theta] * 5)
    new, metrics = jax.jit(algo.round_fn)(state, data, jax.random.key(0))
    tr = train[0][:-VAL[0]]
    g = ce_grad(theta, x[tr].astype(np.float64), y[tr])
    for k in ("w", "b"):
        np.testing.assert_allclose(new.params[k], np.tile(theta[k] - LR * g[k], (5,) + (1,) * theta[k].ndim),
                                   rtol=1e-10, atol=1e-12)
    assert float(metrics["w_self_mean"]) == 1.0 and float(metrics["w_other_max"]) == 0.0
    np.testing.assert_array_equal(new.affinity, 0.0)


@pytest.mark.slow
def test_validation_block_is_never_trained_on(x64):
    # T4: in round 1 (local training only: nothing uploaded yet) flipping client 1's validation
    # labels leaves every trained model bit for bit unchanged, while flipping one of its
    # training labels changes its model. Two epochs of batches of 4 visit all n_i − v_i rows.
    x, y, train, test = raw_clients()
    algo = one_step_algo(local_steps=None, local_epochs=2, batch_size=4)
    step = jax.jit(algo.round_fn)

    def first_round(labels):
        data = to_data(x, labels, train, test)
        return step(algo.init(jax.random.key(0), data), data, jax.random.key(1))[0]

    flipped_val, flipped_train = y.copy(), y.copy()
    val1, tr1 = train[1][-VAL[1]:], train[1][:-VAL[1]]
    flipped_val[val1] = (y[val1] + 1) % K
    flipped_train[tr1[0]] = (y[tr1[0]] + 1) % K
    base_state = first_round(y)
    tree_equal(first_round(flipped_val).params, base_state.params)
    changed = first_round(flipped_train).params
    assert not np.allclose(changed["w"][1], base_state.params["w"][1])


@pytest.mark.slow
def test_unsampled_clients_are_unchanged():
    # T5: params, optimizer rows, affinity rows and start models of clients not sampled stay bit
    # for bit.
    data = helpers.make_data([7, 23, 12, 1, 9], num_classes=K, feature_dim=F)
    algo = algorithms.get("fedfomo", model=linear_model(F, K), participation=0.6, momentum=0.5,
                          momentum_buffer="persist", batch_size=4, epsilon=0.5, baseline="start")
    step = jax.jit(algo.round_fn)
    state = algo.init(jax.random.key(0), data)
    moved = 0.0
    for r in range(4):
        new, m = step(state, data, jax.random.key(r))
        sampled = set(np.asarray(m["sampled"]).tolist())
        assert len(sampled) == 3
        for i in set(range(5)) - sampled:
            row = lambda t: jax.tree.map(lambda a: a[i], t)
            tree_equal(row(new.params), row(state.params))
            tree_equal(row(new.opt_state), row(state.opt_state))
            tree_equal(row(new.affinity), row(state.affinity))
            tree_equal(row(new.start), row(state.start))
        moved += float(np.sum(np.asarray(new.affinity)))
        state = new
    assert moved > 0                                        # some weights were positive


@pytest.mark.slow      # the loop backend runs rounds eagerly (a consistency check)
def test_loop_backend_equals_chunked(ragged_data):
    # T6: ragged clients (7, 23, 12, 1 samples), exploration on, persistent momentum rows, the
    # 'start' baseline (the default's path is a part of it; the cross-cutting tests run it).
    states = helpers.states_per_backend(
        "fedfomo", ragged_data, backends=("loop", "chunked"), model=linear_model(),
        participation=0.75, local_epochs=2, batch_size=4, chunk_size=2, momentum=0.5,
        momentum_buffer="persist", candidates=2, epsilon=0.5, baseline="start")
    assert_states_close(states["chunked"], states["loop"])


def test_flags_are_validated():
    with pytest.raises(ValueError, match="--fedfomo-val-fraction must be in"):
        algorithms.get("fedfomo", model=linear_model(), val_fraction=1.0)
    with pytest.raises(ValueError, match="--fedfomo-candidates must be >= 1"):
        algorithms.get("fedfomo", model=linear_model(), candidates=0)
    with pytest.raises(ValueError, match="--fedfomo-epsilon must be in"):
        algorithms.get("fedfomo", model=linear_model(), epsilon=1.5)
    with pytest.raises(ValueError, match="--fedfomo-baseline must be one of"):
        algorithms.get("fedfomo", model=linear_model(), baseline="first")
    hp = algorithms.get("fedfomo", model=linear_model()).hparams
    assert (hp["candidates"], hp["val_fraction"], hp["epsilon"], hp["epsilon_decay"],
            hp["baseline"]) == (8, 0.2, 0.3, 0.05, "current")
    assert registry.spec("fedfomo").test_hparams is not None and fedfomo.State._fields[0] == "params"


def test_affinity_accumulates_the_weights_over_rounds(x64):
    # F3: P_ij ← P_ij + w_ij, so after two rounds P = W¹ + W² (each from the naive double loop:
    # round 2 starts from round 1's trained models), not the last round's W² alone.
    x, y, train, test = raw_clients()
    data = to_data(x, y, train, test)
    algo = one_step_algo()
    step = jax.jit(algo.round_fn)
    models = distinct_models()
    state = with_models(algo.init(jax.random.key(0), data), models)
    w1, _, trained, _ = naive_round(models, x.astype(np.float64), y, train)
    state, _ = step(state, data, jax.random.key(3))
    w2, _, _, _ = naive_round(trained, x.astype(np.float64), y, train)
    state, _ = step(state, data, jax.random.key(4))
    assert np.any((w1 > 0) & (w2 > 0)), "both rounds must weigh some pair"
    np.testing.assert_allclose(state.affinity, w1 + w2, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_epsilon_metric_follows_the_decay_schedule():
    # F3: ε_t = max(0, ε − δ(t − 2)) in round t ≥ 2; round 1 has no downloads (0).
    data = to_data(*raw_clients())
    algo = one_step_algo(epsilon=0.12, epsilon_decay=0.05)
    step = jax.jit(algo.round_fn)
    state, seen = algo.init(jax.random.key(0), data), []
    for r in range(5):
        state, m = step(state, data, jax.random.key(r))
        seen.append(float(m["epsilon"]))
    np.testing.assert_allclose(seen, [0.0, 0.12, 0.07, 0.02, 0.0], atol=1e-7)


@pytest.mark.slow
def test_round_two_explores_with_epsilon_and_round_three_with_epsilon_minus_decay():
    # F3 in behaviour: ε = δ = 1 gives ε_2 = 1 (every slot a uniformly random other upload) and
    # ε_3 = 0 (the top affinity). Six clients, one slot each, client i's top affinity on
    # σ(i) = i + 1 mod 6. Client i's samples all have label i mod 3 and θ_i = (w 0,
    # b −5·e_{i mod 3} + 0.3·i) is bad on its own label only (the shift 0.3·i changes no
    # prediction, it tells the models apart), so a candidate of another label gets the whole
    # weight: θ_i moves to exactly the model it downloaded (lr 1e-30: training leaves it there).
    n, k = 6, 3
    sizes = [5] * n
    x, _, train, test, _, _ = helpers.make_raw(sizes, num_classes=k, feature_dim=F)
    y = np.zeros(len(x), int)
    for i in range(n):
        y[train[i]], y[test[i]] = i % k, i % k
    data = FederatedData.from_arrays(x, y, train, test, num_classes=k)
    algo = algorithms.get("fedfomo", model=linear_model(F, k), participation=1.0, local_steps=1,
                          batch_size=8, lr=1e-30, candidates=1, val_fraction=0.2, epsilon=1.0,
                          epsilon_decay=1.0)
    b = -5.0 * np.eye(k)[np.arange(n) % k] + 0.3 * np.arange(n)[:, None]
    sigma = (np.arange(n) + 1) % n
    affinity = np.zeros((n, n))
    affinity[np.arange(n), sigma] = 5.0
    state = algo.init(jax.random.key(0), data)
    state = state._replace(params={"w": jnp.zeros((n, F, k)), "b": jnp.asarray(b, jnp.float32)},
                           affinity=jnp.asarray(affinity, jnp.float32),
                           uploaded=jnp.arange(n, dtype=jnp.int32), has_prev=jnp.ones((), bool))
    step = jax.jit(algo.round_fn)

    def moved_to(rounds_done, key):
        new, m = step(state._replace(round=jnp.asarray(rounds_done, jnp.int32)), data, key)
        got = np.asarray(new.params["b"])
        # the model each client moved to (itself where it kept its own)
        return [int(np.argmin(np.abs(got[i] - b).sum(1))) for i in range(n)], float(m["epsilon"])

    picks, eps = moved_to(2, jax.random.key(7))                        # round 3: ε_3 = 0
    assert eps == 0.0
    np.testing.assert_array_equal(picks, sigma)                        # all greedy
    randomised = [moved_to(1, jax.random.key(s)) for s in range(3)]    # round 2: ε_2 = 1
    assert all(e == 1.0 for _, e in randomised)
    hits = sum(int(np.sum(np.asarray(p) == sigma)) for p, _ in randomised)
    assert hits < 3 * n / 2, "round 2 must explore, not follow the affinity"
