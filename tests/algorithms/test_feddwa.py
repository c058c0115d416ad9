"""FedDWA (fedjax_pfl/algorithms/feddwa.py; docs/algorithms/feddwa.md#tests) against naive float64
double loops over clients and a transcription of its round on quadratic clients, whose
full-batch gradient steps (and so the guidance models) can be written out by hand."""

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_states_close, linear_model, tree_equal

from fedjax_pfl import algorithms
from fedjax_pfl.algorithms import feddwa
from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.models.model import Model

THETA0 = np.array([0.5, -0.2, 0.1])
# f_i(w) = mean_k ½‖w − x_k‖² over client i's samples: gradient w − x̄_i, so one full-batch step
# is w ← w − η(w − x̄_i).
QUADRATIC = Model(init=lambda key: {"x": jnp.asarray(THETA0)}, apply=lambda p, x: p["x"] - x,
                  loss=lambda out, y: 0.5 * jnp.sum(out**2, axis=-1))
SIZES = [3, 5, 2, 4, 6]


def quadratic_clients(seed=0, identical=False):
    rng = np.random.default_rng(seed)
    if identical:
        x = rng.normal(size=(4, 3))
        xs = [x] * len(SIZES)
    else:
        xs = [rng.normal(size=(n, 3)) + rng.normal(size=3) * 2 for n in SIZES]
    sizes = [len(x) for x in xs]
    starts = np.cumsum([0] + sizes)
    train = [np.arange(a, b) for a, b in zip(starts[:-1], starts[1:])]
    return FederatedData.from_arrays(np.concatenate(xs), np.zeros(starts[-1]), train, train,
                                     num_classes=1), xs


def naive_weights(guides, trained, k):
    """{(i, j): p_ij} one pair at a time: 1/‖ŵ_i − w_j‖² over the k nearest w_j, normalised (the
    paper's weights with the authors' top-K; no ties in the data used)."""
    m = len(trained)
    p = np.zeros((m, m))
    for i in range(m):
        dist = [sum(np.sum((g - w) ** 2) for g, w in zip(guides[i], trained[j])) for j in range(m)]
        nearest = sorted(range(m), key=lambda j: dist[j])[:k]
        total = sum(1.0 / dist[j] for j in nearest)
        for j in nearest:
            p[i, j] = (1.0 / dist[j]) / total
    return p


def naive_mix(p, trained):
    """Row i: Σ_j p_ij w_j, leaf by leaf, one client at a time."""
    m = len(trained)
    return [[sum(p[i, j] * trained[j][leaf] for j in range(m)) for leaf in range(len(trained[0]))]
            for i in range(m)]


@pytest.mark.slow
def test_distances_weights_and_mixtures_equal_a_naive_double_loop(x64):
    # T1: D, P and P·W on 5 clients with two leaves, models far from 0 (as trained models are)
    # and guidance steps small against the distances between clients.
    rng = np.random.default_rng(3)
    trained = [[3.0 + rng.normal(size=(4, 2)), -2.0 + rng.normal(size=3)] for _ in range(5)]
    guides = [[a + 0.05 * rng.normal(size=a.shape) for a in w] for w in trained]
    stack = lambda ms: {"a": jnp.asarray(np.stack([m[0] for m in ms])),
                        "b": jnp.asarray(np.stack([m[1] for m in ms]))}
    d = feddwa.guidance_sq_distances(stack(guides), stack(trained))
    want_d = [[sum(np.sum((g - w) ** 2) for g, w in zip(guides[i], trained[j])) for j in range(5)]
              for i in range(5)]
    np.testing.assert_allclose(d, want_d, rtol=1e-12)
    for k in (1, 3, 5):
        p = feddwa.dwa_weights(d, k)
        want = naive_weights(guides, trained, k)
        np.testing.assert_allclose(p, want, rtol=1e-12, atol=1e-15)
        mixed = feddwa.attention_mix.mix_rows(p, stack(trained))
        for i, row in enumerate(naive_mix(want, trained)):
            np.testing.assert_allclose(mixed["a"][i], row[0], rtol=1e-12)
            np.testing.assert_allclose(mixed["b"][i], row[1], rtol=1e-12)


def test_float32_self_distance_keeps_the_small_guidance_step():
    # T1 (precision): models at ‖w‖ ≈ 300 whose guidance step is 1e-3: the self distance
    # D_ii = ‖ŵ_i − w_i‖² = 1e-6·d is formed from Δ directly, exact in float32.
    rng = np.random.default_rng(0)
    w = 100.0 + rng.normal(size=(4, 10)).astype(np.float32)
    g = w + np.float32(1e-3)
    d = feddwa.guidance_sq_distances({"x": jnp.asarray(g)}, {"x": jnp.asarray(w)})
    want = ((g.astype(np.float64)[:, None] - w.astype(np.float64)[None]) ** 2).sum(-1)
    np.testing.assert_allclose(np.diag(d), np.diag(want), rtol=1e-3)
    np.testing.assert_allclose(d, want, rtol=1e-4)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 7])
@pytest.mark.slow
def test_weights_are_a_distribution_with_exactly_k_nonzero_per_row(k):
    # T2: rows ≥ 0 summing to 1, exactly min(K, M) non-zero, on the K smallest distances.
    d = jnp.asarray(np.random.default_rng(k).uniform(0.1, 4.0, size=(5, 5)), jnp.float32)
    p = np.asarray(feddwa.dwa_weights(d, k))
    assert np.all(p >= 0)
    np.testing.assert_allclose(p.sum(axis=1), 1.0, rtol=1e-6)
    np.testing.assert_array_equal((p > 0).sum(axis=1), min(k, 5))
    for i in range(5):                                          # kept = the nearest, ∝ 1/D
        kept = np.argsort(np.asarray(d[i]))[:min(k, 5)]
        assert set(np.flatnonzero(p[i])) == set(kept.tolist())
        np.testing.assert_allclose(p[i, kept] * np.asarray(d[i, kept]),
                                   1.0 / np.sum(1.0 / np.asarray(d[i, kept])), rtol=1e-5)


def test_ties_keep_the_lower_index_and_zero_distances_take_all_the_weight():
    # T2 (documented edge cases): a tie at the K-th place keeps the lower row index; a distance
    # of exactly 0 takes the whole weight (the limit of 1/D), shared equally among such models.
    d = jnp.array([[1.0, 2.0, 2.0, 2.0, 5.0],
                   [0.5, 0.0, 3.0, 0.0, 1.0],
                   [0.0, 0.0, 0.0, 0.0, 0.0],
                   [4.0, 1.0, 4.0, 1.0, 4.0],
                   [2.0, 2.0, 2.0, 2.0, 1.0]])
    p = np.asarray(feddwa.dwa_weights(d, 3))
    np.testing.assert_allclose(p[0], np.array([1.0, 0.5, 0.5, 0, 0]) / 2.0, rtol=1e-6)
    np.testing.assert_allclose(p[1], [0, 0.5, 0, 0.5, 0], rtol=1e-6)
    np.testing.assert_allclose(p[2], [1 / 3, 1 / 3, 1 / 3, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(p[3], np.array([0.25, 1, 0, 1, 0]) / 2.25, rtol=1e-6)
    np.testing.assert_allclose(p[4], np.array([0.5, 0.5, 0, 0, 1]) / 2.0, rtol=1e-6)


def reference_rounds(xs, sampled_per_round, *, eta, epochs, guide_steps, k):
    """The round (docs/algorithms/feddwa.md#round) literally, in float64, with full batches
    (B ≥ n_i: one gradient step of all n_i samples per epoch or step, so batch order cannot
    matter): train E steps from w̃_i, guide `guide_steps` more, weights, mixtures."""
    w = [THETA0.copy() for _ in xs]
    history = []
    for sampled in sampled_per_round:
        trained, guides = [], []
        for i in sampled:
            th = w[i].copy()
            for _ in range(epochs):
                th = th - eta * (th - xs[i].mean(0))
            g = th.copy()
            for _ in range(guide_steps):
                g = g - eta * (g - xs[i].mean(0))
            trained.append([th]), guides.append([g])
        p = naive_weights(guides, trained, k)
        mixed = naive_mix(p, trained)
        for row, i in enumerate(sampled):
            w[i] = mixed[row][0]
        guide_sq = np.mean([np.sum((g[0] - t[0]) ** 2) for g, t in zip(guides, trained)])
        history.append((np.array(w), p, guide_sq))
    return history


@pytest.mark.parametrize("guidance", [
    {}, pytest.param({"guidance_steps": 1}, marks=pytest.mark.slow),
    pytest.param({"guidance_epochs": 3}, marks=pytest.mark.slow)],
    ids=["same_schedule", "one_step", "three_epochs"])
@pytest.mark.slow
def test_rounds_match_the_naive_transcription(x64, guidance):
    # T1, T4, T5: local training from w̃_i, the guidance pass, the weights from ‖ŵ_i − w_j‖²
    # with top-K, the mixtures, the statistics; unsampled clients untouched.
    data, xs = quadratic_clients()
    algo = algorithms.get("feddwa", model=QUADRATIC, participation=0.8, local_epochs=2,
                          batch_size=8, lr=0.3, topk=2, **guidance)
    step = jax.jit(algo.round_fn)
    state = algo.init(jax.random.key(0), data)
    states, sampled, metrics = [], [], []
    for r in range(4):
        new, m = step(state, data, jax.random.key(r))
        s = np.asarray(m["sampled"]).tolist()
        assert len(s) == 4                                       # M = ⌊0.8 · 5⌋
        for i in set(range(5)) - set(s):                         # T5: unsampled rows untouched
            tree_equal(jax.tree.map(lambda x: x[i], state.params),
                       jax.tree.map(lambda x: x[i], new.params))
        state = new
        states.append(state), sampled.append(s), metrics.append(m)
    guide_steps = guidance.get("guidance_steps", guidance.get("guidance_epochs", 2))
    ref = reference_rounds(xs, sampled, eta=0.3, epochs=2, guide_steps=guide_steps, k=2)
    mixed_others = False
    for state, m, (w, p, guide_sq) in zip(states, metrics, ref):
        np.testing.assert_allclose(state.params["x"], w, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(m["guide_sq_dist_mean"], guide_sq, rtol=1e-10)   # T4
        np.testing.assert_allclose(m["p_self_mean"], np.mean(np.diag(p)), rtol=1e-10)
        np.testing.assert_allclose(m["p_max_mean"], np.mean(p.max(axis=1)), rtol=1e-10)
        off = ~np.eye(4, dtype=bool)
        np.testing.assert_allclose(m["p_other_max"], p[off].max(), rtol=1e-10)
        np.testing.assert_allclose(m["p_nonzero_mean"], 2.0)
        mixed_others |= bool(p[off].max() > 0.05)
    assert mixed_others                   # the weights did mix in other clients somewhere


@pytest.mark.slow      # T4 is also in the transcription's guide_sq_dist_mean
def test_guidance_model_is_the_extra_local_steps_by_hand(x64):
    # T4: one round from w̃ = θ0, E = 1 full-batch step, then the guidance pass: one step
    # (--feddwa-guidance-steps 1) gives ŵ_i − w_i = −η(w_i − x̄_i) with w_i = θ0 − η(θ0 − x̄_i),
    # so ‖ŵ_i − w_i‖² = η²(1 − η)²‖θ0 − x̄_i‖²; two steps: ŵ_i − w_i = ((1 − η)² − 1)(w_i − x̄_i).
    data, xs = quadratic_clients()
    eta = 0.2
    for steps, factor in ((1, eta), (2, 1 - (1 - eta) ** 2)):
        algo = algorithms.get("feddwa", model=QUADRATIC, participation=1.0, local_epochs=1,
                              batch_size=8, lr=eta, topk=5, guidance_steps=steps)
        _, m = jax.jit(algo.round_fn)(algo.init(jax.random.key(0), data), data, jax.random.key(0))
        by_hand = [factor**2 * (1 - eta) ** 2 * np.sum((THETA0 - x.mean(0)) ** 2) for x in xs]
        np.testing.assert_allclose(m["guide_sq_dist_mean"], np.mean(by_hand), rtol=1e-12)
        assert int(m["client_steps"]) == 5 * (1 + steps)


@pytest.mark.slow
def test_identical_clients_mix_back_to_the_common_model(x64):
    # T3: identical data and full participation keep every model equal: whatever the weights,
    # a distribution over equal models returns that model, so each round is plain full-batch
    # SGD from it, computed by hand.
    data, xs = quadratic_clients(identical=True)
    eta = 0.1
    algo = algorithms.get("feddwa", model=QUADRATIC, participation=1.0, local_epochs=3,
                          batch_size=8, lr=eta, topk=3)
    step = jax.jit(algo.round_fn)
    state = algo.init(jax.random.key(0), data)
    w, mean = THETA0.copy(), xs[0].mean(0)
    for r in range(3):
        state, m = step(state, data, jax.random.key(r))
        for _ in range(3):
            w = w - eta * (w - mean)
        np.testing.assert_allclose(state.params["x"], np.tile(w, (5, 1)), rtol=1e-12)
        np.testing.assert_allclose(m["p_nonzero_mean"], 3.0)


@pytest.mark.slow      # the loop backend runs rounds eagerly
def test_loop_backend_equals_chunked(ragged_data):
    # T6: ragged clients (7, 23, 12, 1 samples), persistent momentum rows, chunks of 2.
    states = helpers.states_per_backend(
        "feddwa", ragged_data, backends=("loop", "chunked"), model=linear_model(),
        participation=0.75, local_epochs=2, batch_size=4, chunk_size=2, momentum=0.5,
        momentum_buffer="persist", topk=2)
    assert_states_close(states["chunked"], states["loop"])


def test_flags_are_validated():
    with pytest.raises(ValueError, match="--feddwa-topk must be >= 1"):
        algorithms.get("feddwa", model=linear_model(), topk=0)
    with pytest.raises(ValueError, match="--feddwa-guidance-steps must be >= 1"):
        algorithms.get("feddwa", model=linear_model(), guidance_steps=0)
    hp = algorithms.get("feddwa", model=linear_model()).hparams
    assert (hp["participation"], hp["topk"], hp["guidance_epochs"], hp["guidance_steps"]) == (
        1.0, 5, None, None)


def _epoch_order(start, end, samples, eta):
    """The order in which one epoch of batch-size-1 SGD on ½‖w − x_k‖² visited `samples` to go
    from `start` to `end` (w ← (1 − η)w + η x_k per step), by trying every order in float64;
    None if no order gives `end`."""
    import itertools

    for order in itertools.permutations(range(len(samples))):
        w = start.copy()
        for k in order:
            w = (1 - eta) * w + eta * samples[k]
        if np.allclose(w, end, rtol=1e-9, atol=1e-11):
            return order
    return None


@pytest.mark.slow
def test_guidance_pass_draws_its_own_batch_order(x64, monkeypatch):
    # R2: the guidance pass is an epoch of its own, in a fresh batch order (its own key): with
    # batch size 1 on quadratics each pass is a product of per-sample steps whose order is
    # recovered from the models, w_i from w̃_i = θ0 and ŵ_i from w_i. Both must be epochs (every
    # sample once) and, with independent keys, their orders differ for most clients (reusing the
    # training key would replay the same order for every client).
    data, xs = quadratic_clients()
    eta = 0.3
    algo = algorithms.get("feddwa", model=QUADRATIC, participation=1.0, local_epochs=1,
                          batch_size=1, lr=eta, topk=2)
    seen = []
    distances = feddwa.guidance_sq_distances

    def spy(guides, rows):                      # ŵ and w as round_fn hands them to the server
        seen.append((guides, rows))
        return distances(guides, rows)

    monkeypatch.setattr(feddwa, "guidance_sq_distances", spy)

    def round_and_uploads(state, data, key):
        _, metrics = algo.round_fn(state, data, key)
        return metrics["sampled"], seen[-1]

    sampled, (guides, trained) = jax.jit(round_and_uploads)(
        algo.init(jax.random.key(0), data), data, jax.random.key(5))
    differ = 0
    for row, i in enumerate(np.asarray(sampled)):
        w, g = np.asarray(trained["x"][row]), np.asarray(guides["x"][row])
        train_order = _epoch_order(THETA0, w, xs[i], eta)
        guide_order = _epoch_order(w, g, xs[i], eta)
        assert train_order is not None and guide_order is not None, f"client {i}"
        differ += train_order != guide_order
    assert differ >= 3, f"only {differ} of 5 clients' guidance passes changed the batch order"
