"""FedPC (docs/algorithms/fedpc.md#tests): the reductions (d2 = 0 is minibatch SGD, λ = 0 is
independent SGD on the personal parts, λ → ∞ fuses them), partial participation, the K-step gradient
reading, the graph spaces on planted clusters, the compressed uplink's accounting, backends and
compile-once.

References are jax.grad of each client's full-batch mean loss in float64 (a full batch makes the
engine's minibatch the whole client, whatever its order), not the engine's code paths.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import make_data, tree_allclose, tree_equal

from fedjax_pfl import algorithms, core
from fedjax_pfl.algorithms import fedpc as fedpc_lib
from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.models import split as S
from fedjax_pfl.models.model import Model, softmax_cross_entropy
from fedjax_pfl.ops import graph as G


def _init(key):
    k0, k1 = jax.random.split(key)
    return {"Dense_0": {"kernel": 0.5 * jax.random.normal(k0, (5, 4)), "bias": jnp.zeros(4)},
            "Dense_1": {"kernel": 0.5 * jax.random.normal(k1, (4, 3)), "bias": jnp.zeros(3)}}


def _apply(p, x):
    h = jnp.tanh(x.reshape(x.shape[0], -1) @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
    return h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]


TINY = Model(_init, _apply, softmax_cross_entropy, "tiny")    # body Dense_0, head Dense_1
SIZES = [7, 23, 12, 9]
FULL_BATCH = 32                                               # ≥ every client's training size


@jax.jit
@jax.grad
def _mean_loss_grad(params, x, y):
    return jnp.mean(softmax_cross_entropy(_apply(params, x), y))


def full_gradients(params, data, ids):
    """∇f_n(params_n) over client n's whole training split, for each n in ids (float64)."""
    x, y = np.asarray(data.x), np.asarray(data.y)
    out = []
    for row, n in enumerate(ids):
        rows = data.client_rows(int(n))
        p = jax.tree.map(lambda a: a[row], params)
        out.append(_mean_loss_grad(p, jnp.asarray(x[rows], jnp.float64), jnp.asarray(y[rows])))
    return jax.tree.map(lambda *g: jnp.stack(g), *out)


def get(**hp):
    # The feature-space graph is the cheapest to build; every space is tested on planted clusters.
    base_hp = dict(lr=0.3, batch_size=FULL_BATCH, participation=1.0, local_steps=1, graph="feature")
    return algorithms.get("fedpc", model=TINY, **{**base_hp, **hp})


@pytest.mark.slow
def test_all_shared_is_synchronous_minibatch_sgd(x64):
    # T8: d2 = 0 — x ← x − η·(1/N)Σ_n ∇f_n(x), the mean over all clients (full participation).
    data = make_data(SIZES)
    algo = get(personal="none")
    state = algo.init(jax.random.key(0), data)
    assert jax.tree.leaves(state.z) == [] and state.w.shape[1] == 0
    expected = _init(jax.random.key(0))
    for r in range(2):
        grads = full_gradients(core.broadcast(expected, 4), data, range(4))
        expected = jax.tree.map(lambda p, g: p - 0.3 * g.mean(0), expected, grads)
        state, m = jax.jit(algo.round_fn)(state, data, jax.random.key(r))
        tree_allclose(state.x, expected, rtol=1e-12, atol=1e-14)
    assert float(m["comm_up_floats"]) == 4 * 39 and float(m["bits_per_client"]) == 32 * 39


@pytest.mark.slow
@pytest.mark.parametrize("shared_mean", ["sampled", "all"])
def test_lambda_zero_is_independent_sgd_on_personal_parts(x64, shared_mean):
    # T2: λ = 0 — z_n ← z_n − (η_z/N)∇_z f_n (η_z = η: the draft's formula), for the sampled
    # clients only (unsampled rows of G_t are zero), and x ← x − η·mean over S_t of ∇_x f_n
    # ('sampled') or Σ_{S_t} ∇_x f_n / N ('all').
    data = make_data(SIZES)
    algo = get(lam=0.0, eta_personal=0.3, participation=0.5, shared_mean=shared_mean)
    state = algo.init(jax.random.key(0), data)
    mask = S.personal_mask(_init(jax.random.key(0)), "head")
    for r in range(2):
        new, m = jax.jit(algo.round_fn)(state, data, jax.random.key(r))
        idx = np.asarray(m["sampled"])
        y = S.merge(core.broadcast(state.x, 2), core.gather(state.z, idx), mask)
        g_x, g_z = S.split(full_gradients(y, data, idx), mask)
        divisor = 2 if shared_mean == "sampled" else 4
        tree_allclose(new.x, jax.tree.map(lambda x, g: x - 0.3 * g.sum(0) / divisor, state.x, g_x),
                      rtol=1e-12, atol=1e-14)
        expected_z = jax.tree.map(lambda z, g: z.at[idx].add(-0.3 / 4 * g), state.z, g_z)
        tree_allclose(new.z, expected_z, rtol=1e-12, atol=1e-14)
        for i in set(range(4)) - set(idx.tolist()):              # unsampled: bit for bit
            tree_equal(jax.tree.map(lambda a: a[i], new.z), jax.tree.map(lambda a: a[i], state.z))
        state = new


@pytest.mark.slow
def test_default_personal_step_moves_z_like_a_local_sgd_step(x64):
    # The default η_z = N·η: with λ = 0 a round moves z_n by η·∇_z f_n.
    data = make_data(SIZES)
    algo = get(lam=0.0)
    state = algo.init(jax.random.key(0), data)
    new, _ = jax.jit(algo.round_fn)(state, data, jax.random.key(0))
    mask = S.personal_mask(_init(jax.random.key(0)), "head")
    y = S.merge(core.broadcast(state.x, 4), state.z, mask)
    _, g_z = S.split(full_gradients(y, data, range(4)), mask)
    tree_allclose(new.z, jax.tree.map(lambda z, g: z - 0.3 * g, state.z, g_z), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("steps", [pytest.param(1, marks=pytest.mark.slow), 2])
@pytest.mark.slow
def test_client_sends_the_sum_of_its_local_minibatch_gradients(x64, steps):
    # K = 1 is exactly the stochastic gradient at y (also checked through the whole round by
    # test_all_shared_is_synchronous_minibatch_sgd); K = 2 adds the gradient after one SGD step.
    data = make_data(SIZES)
    params = core.broadcast(_init(jax.random.key(1)), 4)
    trainer = core.LocalTrainer(TINY, optax.chain(fedpc_lib.accumulate_gradients(), optax.sgd(0.3)),
                                steps=steps, batch_size=FULL_BATCH, mapper=core.client_mapper("vmap"))
    opt = core.broadcast(trainer.init_opt_state(_init(jax.random.key(1))), 4)
    result = trainer(data, params, opt, data.clients, jax.random.split(jax.random.key(2), 4))
    g1 = full_gradients(params, data, range(4))
    expected = g1
    if steps == 2:
        moved = jax.tree.map(lambda p, g: p - 0.3 * g, params, g1)
        expected = jax.tree.map(jnp.add, g1, full_gradients(moved, data, range(4)))
    tree_allclose(result.opt_state[0], expected, rtol=1e-12, atol=1e-14)


@pytest.mark.slow
def test_large_lambda_fuses_all_personal_parts(x64):
    # T3: λ → ∞ on a connected graph: after the round's ADMM every client has the same head.
    data = make_data(SIZES)
    algo = get(lam=1e3, admm_iters=300, k=2)
    state, m = jax.jit(algo.round_fn)(algo.init(jax.random.key(0), data), data, jax.random.key(0))
    for leaf in jax.tree.leaves(state.z):
        np.testing.assert_allclose(leaf, np.broadcast_to(leaf.mean(0), leaf.shape), atol=1e-8)
    assert float(m["admm_primal"]) < 1e-8


@pytest.mark.slow
def test_graph_couples_unsampled_clients_cg_cold_start_and_decay():
    # With λ > 0 an unsampled client's head moves too (its zero gradient row is still coupled
    # through the graph); the CG solver, cold-started ADMM and η/√t decay run in the round.
    # (Cholesky and CG are tested equal on the Z-system in tests/ops/test_graph.py.)
    data = make_data(SIZES)
    algo = get(lam=0.05, participation=0.5, admm_start="cold", eta_decay="inv_sqrt", solver="cg")
    state = first = algo.init(jax.random.key(0), data)
    step = jax.jit(algo.round_fn)
    for r in range(2):
        state, m = step(state, data, jax.random.key(r))
    np.testing.assert_allclose(float(m["eta"]), 0.3 / np.sqrt(2), rtol=1e-6)
    assert float(m["admm_primal"]) < 1e-3
    unsampled = sorted(set(range(4)) - set(np.asarray(m["sampled"]).tolist()))
    moved = [not np.allclose(state.z["Dense_1"]["bias"][i], first.z["Dense_1"]["bias"][i])
             for i in unsampled]
    assert any(moved)


@functools.lru_cache(maxsize=None)
def _backend_run(backend):
    data = make_data(SIZES)
    # chunk_size 0: the automatic chunk size (its probe of the mapped compression once failed on
    # a Python-float step size).
    algo = get(backend=backend, chunk_size=0, lam=0.05, participation=0.5, gamma=0.5,
               compress_iters=10, local_steps=2, batch_size=4)
    round_fn = algo.round_fn
    if backend != "loop":
        chex.clear_trace_counter()    # chex identifies functions by source and call site
        round_fn = jax.jit(chex.assert_max_traces(algo.round_fn, n=1))       # compiles once
    state = algo.init(jax.random.key(0), data)
    metrics = []
    for r in range(2):
        state, m = round_fn(state, data, jax.random.key(r))
        metrics.append(m)
    return state, metrics, algo.evaluate(state, data)["client"], algo


@pytest.mark.slow      # the loop backend runs the round eagerly: ~25 s of CPU
def test_vmapped_and_chunked_equal_loop_backend():
    ref_state, ref_metrics, ref_eval, _ = _backend_run("loop")
    for backend in ("vmap", "chunked"):
        state, metrics, ev, _ = _backend_run(backend)
        tree_allclose(state, ref_state, rtol=2e-5, atol=1e-6)
        for a, b in zip(metrics, ref_metrics):
            np.testing.assert_array_equal(a["sampled"], b["sampled"])
            np.testing.assert_allclose(a["train_loss"], b["train_loss"], rtol=2e-5)
            np.testing.assert_allclose(a["bits_per_client"], b["bits_per_client"], rtol=0.1)
        np.testing.assert_allclose(ev.correct, ref_eval.correct)


@pytest.mark.slow
def test_compressed_uplink_is_accounted_in_bits():
    # (Also: the chunked round with the automatic chunk size compiles once over 2 rounds.)
    _, metrics, _, _ = _backend_run("chunked")
    d = 5 * 4 + 4 + 4 * 3 + 3
    for m in metrics:
        assert float(m["bits_per_client_dense"]) == 32 * d
        assert float(m["bits_per_client"]) < 32 * d            # fewer distinct values than d
        assert float(m["distinct_values"]) < d
        assert float(m["comm_up_bits"]) == pytest.approx(2 * float(m["bits_per_client"]))
        assert float(m["comm_up_bits_dense"]) == 2 * 32 * d


def clustered_toy_data():
    """Three groups of three clients: group g has labels {2g, 2g+1} and inputs N(1.5g, 4^g·I)."""
    rng = np.random.default_rng(0)
    xs, ys, train, test, start = [], [], [], [], 0
    for client in range(9):
        g = client // 3
        x = 1.5 * g + 2.0**g * rng.normal(size=(30, 5))
        y = 2 * g + (x[:, (g + 1) % 5] > 1.5 * g).astype(int)
        xs.append(x)
        ys.append(y)
        train.append(np.arange(start, start + 24))
        test.append(np.arange(start + 24, start + 30))
        start += 30
    return FederatedData.from_arrays(np.concatenate(xs).astype(np.float32), np.concatenate(ys),
                                     train, test, num_classes=6)


@pytest.mark.slow
@pytest.mark.parametrize("space", ["data", "feature", "model"])
def test_each_graph_space_finds_the_planted_clusters(space):
    data = clustered_toy_data()
    model = Model(lambda k: {"Dense_0": {"kernel": 0.1 * jax.random.normal(k, (5, 6)),
                                         "bias": jnp.zeros(6)}},
                  lambda p, x: x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
    algo = algorithms.get("fedpc", model=model, graph=space, k=2, graph_samples=24, lr=0.1,
                          batch_size=8, warmup_epochs=3)
    state = algo.init(jax.random.key(0), data)
    planted = np.arange(9) // 3
    assert G.edges_within(state.graph, planted) == 1.0
    assert float(state.same_labels) == 1.0          # the metric equals the planted fraction here
    s, r = np.asarray(state.graph.senders), np.asarray(state.graph.receivers)
    assert np.all(s < r) and state.w.shape == (state.graph.num_edges, 5 * 6 + 6)


def test_bad_settings_fail_early():
    with pytest.raises(ValueError, match="--fedpc-personal must be 'head', 'all', 'none' or a regex"):
        get(personal="Dense_(")
    with pytest.raises(ValueError, match="matches no parameter"):
        get(personal="Conv")
    with pytest.raises(ValueError, match="--momentum-buffer persist is not supported"):
        get(momentum=0.9, momentum_buffer="persist")
    with pytest.raises(ValueError, match="--fedpc-p must be one of"):
        get(p="3")
