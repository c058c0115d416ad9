"""FedALA (fedjax_pfl/algorithms/fedala.py; docs/algorithms/fedala.md#tests) against float64 NumPy
transcriptions of the ALA weight update (eq. 5) on softmax regression, the closed forms of the
local aggregation (eq. 4) and a hand-built round on the tests' linear model {w, b}, whose layers
in path order are b < w: p = 1 puts w under ALA and keeps b as the lower layer (θ_g)."""

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_states_close, linear_model

from fedjax_pfl import algorithms, core
from fedjax_pfl.algorithms import fedala

F, C = 5, 3
TOP = {"b": False, "w": True}


def softmax_grad_w(x, y, w, b):
    """∇_w of the mean cross-entropy of softmax(x w + b) over the rows of x, in float64."""
    logits = x @ w + b
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    onehot = np.eye(C)[y]
    return x.T @ (p - onehot) / len(x)


def reference_ala(x, y, theta_g, theta_l, weights, eta, steps):
    """`steps` full-batch steps of W ← clip(W − η ∇_θ̂L ⊙ (θ_g − θ_i), 0, 1) on top = w, with
    θ̂ = (w: θ_i + (θ_g − θ_i) ⊙ W, b: θ_g), in float64; also the unclipped last step."""
    W = raw = weights.astype(np.float64)
    for _ in range(steps):
        w_hat = theta_l["w"] + (theta_g["w"] - theta_l["w"]) * W
        raw = W - eta * softmax_grad_w(x, y, w_hat, theta_g["b"]) * (theta_g["w"] - theta_l["w"])
        W = np.clip(raw, 0.0, 1.0)
    return W, raw


def random_models(seed, n):
    rng = np.random.default_rng(seed)
    g = {"w": rng.normal(size=(F, C)), "b": rng.normal(size=C)}
    locs = [{"w": rng.normal(size=(F, C)) * 2, "b": rng.normal(size=C)} for _ in range(n)]
    return g, locs


def run_ala(data, theta_g, locs, weights, *, rand_percent, passes, batch_size=32, eta=4.0,
            threshold=0.0, patience=2, backend="vmap", key=0):
    loop, probe = fedala.ala_loop(linear_model(F, C), TOP, eta=eta, rand_percent=rand_percent,
                                  batch_size=batch_size, threshold=threshold, patience=patience)
    mapper = core.client_mapper(backend)
    run = core.jit_unless_loop(mapper, lambda shared, rows: mapper.run(loop, rows, shared=shared,
                                                                        probe=probe))
    m = len(locs)
    idx = jnp.arange(m)
    local_top = {"b": None, "w": jnp.asarray(np.stack([l["w"] for l in locs]), jnp.float32)}
    w = {"b": None, "w": jnp.asarray(np.stack(weights), jnp.float32)}
    g = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), theta_g)
    keys = core.gather(jax.random.split(jax.random.key(key), m), idx)
    rows = fedala.AlaRow(local_top, w, core.gather(data.clients, idx), keys,
                         jnp.full((m,), passes, jnp.int32))
    return run((data, g), rows), keys


SIZES = [6, 8]


def client_rows(sizes, i):
    x, y, train, *_ = helpers.make_raw(sizes, num_classes=C, feature_dim=F)
    return x[train[i]].astype(np.float64), y[train[i]]


@pytest.mark.slow
def test_ala_step_matches_float64_gradient_and_clips():
    # T1: one pass of ALA with B ≥ n_i is one full-batch step on W; η = 4 pushes entries past 0
    # and past 1, so the clip is exercised on both sides.
    data = helpers.make_data(SIZES, num_classes=C, feature_dim=F)
    theta_g, locs = random_models(1, 2)
    rng = np.random.default_rng(2)
    weights = [rng.uniform(0, 1, (F, C)) for _ in locs]
    weights[0][0, 0], weights[1][1, 1] = 0.0, 1.0
    result, _ = run_ala(data, theta_g, locs, weights, rand_percent=100, passes=1)
    for i in range(2):
        x, y = client_rows(SIZES, i)
        want, raw = reference_ala(x, y, theta_g, locs[i], weights[i], 4.0, 1)
        assert (raw < 0).any() and (raw > 1).any(), "the example must exercise both clips"
        np.testing.assert_allclose(np.asarray(result.weights["w"][i]), want, rtol=1e-4, atol=1e-5)
        assert int(result.epochs[i]) == 1


@pytest.mark.slow
def test_ala_uses_only_the_random_fraction_of_data():
    # T1 with s = 50 %: D_i^s is the first ⌊0.5·8⌋ = 4 positions of the client's keyed
    # permutation (core.epoch_permutation, the engine's shuffle), one full-batch step on them.
    data = helpers.make_data(SIZES, num_classes=C, feature_dim=F)
    theta_g, locs = random_models(3, 2)
    weights = [np.full((F, C), 0.5), np.full((F, C), 0.5)]
    result, keys = run_ala(data, theta_g, locs, weights, rand_percent=50, passes=1, eta=1.0)
    x, y = client_rows(SIZES, 1)
    pos = np.asarray(core.epoch_permutation(keys[1], 8, jnp.arange(4)))
    assert len(set(pos.tolist())) == 4
    want, _ = reference_ala(x[pos], y[pos], theta_g, locs[1], weights[1], 1.0, 1)
    everything, _ = reference_ala(x, y, theta_g, locs[1], weights[1], 1.0, 1)
    got = np.asarray(result.weights["w"][1])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert np.abs(everything - want).max() > 1e-3, "the subset must change the answer"
    # ⌊0.5·6⌋ = 3 samples for client 0; ⌊s·n⌋ = 0 is raised to one sample.
    np.testing.assert_array_equal(fedala.subset_size(jnp.array([6, 8, 1, 0]), 50.0), [3, 4, 1, 0])


@pytest.mark.slow
def test_start_phase_repeats_passes_until_settled_or_capped():
    # T1 over several passes (R4): threshold 0 never settles, so all 3 passes run (three
    # full-batch steps); a huge threshold settles as soon as patience + 1 = 3 pass losses exist.
    data = helpers.make_data(SIZES, num_classes=C, feature_dim=F)
    theta_g, locs = random_models(4, 2)
    weights = [np.full((F, C), 0.7), np.full((F, C), 0.3)]
    capped, _ = run_ala(data, theta_g, locs, weights, rand_percent=100, passes=3, eta=0.5)
    for i in range(2):
        x, y = client_rows(SIZES, i)
        want, _ = reference_ala(x, y, theta_g, locs[i], weights[i], 0.5, 3)
        np.testing.assert_allclose(np.asarray(capped.weights["w"][i]), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(capped.epochs, [3, 3])
    settled, _ = run_ala(data, theta_g, locs, weights, rand_percent=100, passes=9, eta=0.5,
                         threshold=1e9, patience=2)
    np.testing.assert_array_equal(settled.epochs, [3, 3])
    x, y = client_rows(SIZES, 0)
    want, _ = reference_ala(x, y, theta_g, locs[0], weights[0], 0.5, 3)
    np.testing.assert_allclose(np.asarray(settled.weights["w"][0]), want, rtol=1e-4, atol=1e-5)


def test_local_aggregation_closed_forms():
    # T2: W = 1 gives θ_g on the top layers, W = 0 keeps θ_i; T3: the lower layers are θ_g.
    theta_g, (loc,) = random_models(5, 1)
    g = jax.tree.map(jnp.asarray, theta_g)
    local_top = {"b": None, "w": jnp.asarray(loc["w"])}
    for value, want_w in ((1.0, theta_g["w"]), (0.0, loc["w"])):
        out = fedala.local_aggregation(g, local_top, {"b": None, "w": jnp.full((F, C), value)}, TOP)
        np.testing.assert_allclose(out["w"], want_w, rtol=1e-6)
        np.testing.assert_array_equal(out["b"], theta_g["b"].astype(out["b"].dtype))
    half = fedala.local_aggregation(g, local_top, {"b": None, "w": jnp.full((F, C), 0.25)}, TOP)
    np.testing.assert_allclose(half["w"], 0.75 * loc["w"] + 0.25 * theta_g["w"], rtol=1e-5)


def test_top_layers_are_the_last_modules_in_path_order():
    params = {"Conv2D_0": {"kernel": 0, "bias": 0}, "Dense_2": {"kernel": 0, "bias": 0},
              "Dense_10": {"kernel": 0, "bias": 0}}
    one = fedala.top_layers_mask(params, 1)
    assert one == {"Conv2D_0": {"kernel": False, "bias": False},
                   "Dense_2": {"kernel": False, "bias": False},
                   "Dense_10": {"kernel": True, "bias": True}}
    two = fedala.top_layers_mask(params, 2)
    assert two["Dense_2"]["kernel"] and not two["Conv2D_0"]["bias"]
    assert fedala.top_layers_mask({"w": 0, "b": 0}, 1) == TOP
    assert all(jax.tree.leaves(fedala.top_layers_mask(params, 9)))


@pytest.mark.slow
def test_round_starts_from_the_aggregate_and_leaves_unsampled_clients_alone():
    # T2–T4 through round_fn: with a negligible lr and η (1e-30: every update rounds away), a
    # sampled client's trained model IS its start θ̂_i, so the state shows eq. 4 exactly:
    # w = θ_i + (θ_g − θ_i) ⊙ W_i and b = θ_g for a returning client, θ_g for a new one;
    # unsampled clients keep θ_i, W_i and their flags; θ_g ← the n_i-weighted mean.
    sizes = [7, 9, 5, 8, 6, 4]
    data = helpers.make_data(sizes, num_classes=C, feature_dim=F)
    algo = algorithms.get("fedala", model=linear_model(F, C), participation=0.5, lr=1e-30,
                          eta=1e-30, batch_size=4, patience=2, max_epochs=3)
    state = algo.init(jax.random.key(0), data)
    theta_g, locs = random_models(6, len(sizes))
    rng = np.random.default_rng(7)
    W = rng.uniform(0, 1, (len(sizes), F, C)).astype(np.float32)
    started = np.array([True, False, True, True, False, True])
    state = state._replace(
        params={k: jnp.asarray(np.stack([l[k] for l in locs]), jnp.float32) for k in ("w", "b")},
        weights={"b": None, "w": jnp.asarray(W)}, started=jnp.asarray(started),
        warm=jnp.asarray(started & (np.arange(6) % 2 == 0)),
        global_params=jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), theta_g))
    for seed in range(50):   # a round key whose sample mixes new and returning clients
        key = jax.random.key(seed)
        new, metrics = jax.jit(algo.round_fn)(state, data, key)
        sampled = np.asarray(metrics["sampled"])
        if started[sampled].any() and not started[sampled].all():
            break
    else:
        pytest.fail("no round key samples both kinds of client")
    starts = {}
    for i in range(len(sizes)):
        if i in sampled:
            if started[i]:
                want_w = locs[i]["w"] + (theta_g["w"] - locs[i]["w"]) * W[i]
            else:
                want_w = theta_g["w"]
            starts[i] = want_w
            np.testing.assert_allclose(new.params["w"][i], want_w, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(new.params["b"][i], theta_g["b"], rtol=1e-6)   # lower: θ_g
            assert bool(new.started[i]) and bool(new.warm[i]) == bool(started[i])
        else:
            for k in ("w", "b"):
                np.testing.assert_array_equal(new.params[k][i], state.params[k][i])
            np.testing.assert_array_equal(new.weights["w"][i], W[i])
            assert bool(new.started[i]) == started[i] and bool(new.warm[i]) == bool(state.warm[i])
    n = np.array(sizes, float)[sampled]
    want_g = sum(n_i * starts[i] for n_i, i in zip(n, sampled)) / n.sum()
    np.testing.assert_allclose(new.global_params["w"], want_g, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new.global_params["b"], theta_g["b"], rtol=1e-5)


@pytest.mark.slow      # the loop backend runs rounds eagerly (a consistency check)
def test_loop_backend_equals_chunked(ragged_data):
    # T5: the vectorised round (chunked lanes of unequal ALA and training lengths) equals the
    # loop backend, over rounds with first participations, start phases and single passes.
    states = helpers.states_per_backend("fedala", ragged_data, rounds=4,
                                        backends=("loop", "chunked"), model=linear_model(),
                                        participation=0.5, batch_size=4, patience=2, max_epochs=3)
    assert_states_close(states["chunked"], states["loop"])


def test_bad_start_phase_budget_is_an_error():
    with pytest.raises(ValueError, match="--fedala-max-epochs"):
        algorithms.get("fedala", model=linear_model(), patience=10, max_epochs=10)


@pytest.mark.slow
def test_round_gives_each_client_its_pass_budget(x64):
    # R4–R6 through round_fn: a first participation runs no ALA (W_i kept), a client's first ALA
    # (started, not warm) the start phase's --fedala-max-epochs passes (3; threshold 0 never
    # settles), a warm client one pass. With s = 100 % and B ≥ n_i a pass is one full-batch
    # step, so W_i is reference_ala's 0, 3 or 1 float64 steps.
    sizes = [7, 8, 5, 6, 8, 4]
    n = len(sizes)
    data = helpers.make_data(sizes, num_classes=C, feature_dim=F)
    algo = algorithms.get("fedala", model=linear_model(F, C), participation=1.0, batch_size=8,
                          local_steps=1, lr=0.1, eta=0.5, rand_percent=100.0, threshold=0.0,
                          patience=2, max_epochs=3)
    theta_g, locs = random_models(8, n)
    W = np.random.default_rng(9).uniform(0.2, 0.8, (n, F, C))
    started = np.array([False, True, True, True, True, False])
    warm = np.array([False, False, True, False, True, False])
    state = algo.init(jax.random.key(0), data)._replace(
        params={k: jnp.asarray(np.stack([l[k] for l in locs])) for k in ("w", "b")},
        weights={"b": None, "w": jnp.asarray(W)}, started=jnp.asarray(started),
        warm=jnp.asarray(warm), global_params=jax.tree.map(jnp.asarray, theta_g))
    new, metrics = jax.jit(algo.round_fn)(state, data, jax.random.key(1))
    np.testing.assert_array_equal(np.sort(metrics["sampled"]), np.arange(n))
    passes = np.where(~started, 0, np.where(warm, 1, 3))
    for i in range(n):
        x, y = client_rows(sizes, i)
        want, _ = reference_ala(x, y, theta_g, locs[i], W[i], 0.5, int(passes[i]))
        np.testing.assert_allclose(new.weights["w"][i], want, rtol=1e-6, atol=1e-8,
                                   err_msg=f"client {i}, {passes[i]} passes")
    np.testing.assert_allclose(metrics["ala_epochs"], passes.mean())
    np.testing.assert_array_equal(new.warm, started)          # the start phase is done once
