"""SCAFFOLD (Karimireddy et al., ICML 2020, Algorithm 1): one round with zero control variates and
one local step is FedAvg's round (hand-computed); three rounds of option II on quadratics against
a NumPy float64 transcription (ragged K_i, η_g ≠ 1, |S|/N ≠ 1); the corrected gradient
g − c_i + c is what the optimizer steps on; unsampled clients keep c_i; option I's c_i⁺ is the
full-data gradient at x; the chunked backend equals the loop backend; the flags in --help."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import linear_model, tree_allclose

from fedjax_pfl import algorithms
from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.models.model import Model

# Linear regression ŷ = a·w + b with per-example loss ½(ŷ − t)²: each client's f_i is a quadratic
# whose gradient NumPy computes exactly (`numpy_grad`).
REGRESSION = Model(init=lambda key: {"w": 0.5 * jax.random.normal(key, (3,)), "b": jnp.ones(())},
                   apply=lambda p, x: x @ p["w"] + p["b"], loss=lambda out, y: 0.5 * (out - y) ** 2)
SIZES = [3, 5, 2, 4]
N = len(SIZES)
TIGHT = dict(rtol=1e-10, atol=1e-12)


def regression_data(identical_rows: bool = False):
    """Clients of SIZES training rows (a_j, t_j) and one test row each. With `identical_rows`
    each client's rows are n_i copies of one row, so every minibatch's mean gradient is the
    client's full gradient whatever the batch order or size: local SGD on f_i is then
    deterministic gradient descent, for any number of steps K_i."""
    rng = np.random.default_rng(3)
    x, y, train, test, start = [], [], [], [], 0
    for n in SIZES:
        rows = rng.normal(size=(1 if identical_rows else n, 3))
        targets = rng.integers(0, 5, len(rows))
        x.append(np.repeat(rows, n // len(rows), axis=0))
        y.append(np.repeat(targets, n // len(rows)))
        train.append(np.arange(start, start + n))
        start += n
    x, y = np.concatenate(x + [rng.normal(size=(N, 3))]), np.concatenate(y + [np.zeros(N, int)])
    test = [np.array([start + k]) for k in range(N)]
    data = FederatedData.from_arrays(x, y, train, test, num_classes=5)
    return data, x, y, train


def numpy_grad(w, b, a, t):
    """∇ of f_i(w, b) = mean_j ½(a_j·w + b − t_j)² (float64)."""
    r = a @ w + b - t
    return np.concatenate([a.T @ r / len(t), [np.mean(r)]])


def flat(params) -> np.ndarray:
    """{'w': [3], 'b': []} (or rows [M, 3], [M]) as one float64 vector (or [M, 4] rows)."""
    w, b = np.asarray(params["w"], np.float64), np.asarray(params["b"], np.float64)
    return np.concatenate([w, b[..., None]], axis=-1)


def unflat(v) -> dict:
    v = jnp.asarray(v)
    return {"b": v[..., 3], "w": v[..., :3]}


@pytest.mark.parametrize("weights", ["uniform", "data_size"])
@pytest.mark.slow
def test_zero_controls_and_one_step_is_a_fedavg_round(x64, weights):
    # With c = c_i = 0 and K = 1 full-batch step, y_i = x − η ∇f_i(x) and, at η_g = 1,
    # x⁺ = x + Σ w_i (y_i − x) = Σ w_i y_i: FedAvg's round (FedAvg's n_i weights with
    # 'data_size', the paper's plain mean with 'uniform'). Option II then gives
    # c_i⁺ = (x − y_i)/η = ∇f_i(x), and c⁺ = (1/N) Σ_i ∇f_i(x) with every client sampled.
    lr = 0.3
    data, x, y, train = regression_data()
    algo = algorithms.get("scaffold", model=REGRESSION, lr=lr, local_steps=1, batch_size=8,
                          participation=1.0, weights=weights)
    state = algo.init(jax.random.key(0), data)
    x0 = flat(state.params)
    grads = np.stack([numpy_grad(x0[:3], x0[3], x[train[i]], y[train[i]]) for i in range(N)])
    models = x0 - lr * grads                                                     # y_i
    w = np.array(SIZES, float) if weights == "data_size" else np.ones(N)
    fedavg = (w / w.sum()) @ models

    new, metrics = jax.jit(algo.round_fn)(state, data, jax.random.key(1))
    np.testing.assert_array_equal(np.sort(metrics["sampled"]), np.arange(N))
    np.testing.assert_allclose(flat(new.params), fedavg, **TIGHT)
    np.testing.assert_allclose(flat(new.client_control), grads, **TIGHT)
    np.testing.assert_allclose(flat(new.control), grads.mean(axis=0), **TIGHT)
    assert float(metrics["comm_up_floats"]) == float(metrics["comm_down_floats"]) == N * 2 * 4


@pytest.mark.slow
def test_three_rounds_of_option_ii_against_numpy_transcription(x64):
    # Quadratics whose local SGD is exact gradient descent (identical rows), B = 2 and E = 2, so
    # clients take different numbers of steps K_i = 2·⌈n_i/2⌉ = 4, 6, 2, 4; M = 2 of N = 4
    # (|S|/N = 1/2) and η_g = 0.7, so a missing |S|/N or an ignored η_g shows.
    lr, server_lr, rounds = 0.1, 0.7, 3
    data, x, y, train = regression_data(identical_rows=True)
    steps = [2 * -(-n // 2) for n in SIZES]
    algo = algorithms.get("scaffold", model=REGRESSION, lr=lr, server_lr=server_lr,
                          local_epochs=2, batch_size=2, participation=0.5)
    state = algo.init(jax.random.key(0), data)
    xs, c, ci = flat(state.params), np.zeros(4), np.zeros((N, 4))
    seen = set()
    for r in range(rounds):
        state, metrics = jax.jit(algo.round_fn)(state, data, jax.random.key(r))
        sampled = [int(i) for i in metrics["sampled"]]
        assert len(sampled) == 2 and int(metrics["client_steps"]) == sum(steps[i] for i in sampled)
        delta_y, delta_c = [], []
        for i in sampled:
            yi = xs.copy()
            for _ in range(steps[i]):                                           # line 10
                yi = yi - lr * (numpy_grad(yi[:3], yi[3], x[train[i]], y[train[i]]) - ci[i] + c)
            c_plus = ci[i] - c + (xs - yi) / (steps[i] * lr)                    # line 12, II
            delta_y.append(yi - xs)
            delta_c.append(c_plus - ci[i])
            ci[i] = c_plus
        xs = xs + server_lr * np.mean(delta_y, axis=0)                          # line 16
        c = c + (2 / N) * np.mean(delta_c, axis=0)                              # line 17
        np.testing.assert_allclose(flat(state.params), xs, **TIGHT)
        np.testing.assert_allclose(flat(state.control), c, **TIGHT)
        np.testing.assert_allclose(flat(state.client_control), ci, **TIGHT)
        seen |= set(sampled)
    np.testing.assert_allclose(c, ci.mean(axis=0), **TIGHT)       # c stays the mean of the c_i
    assert len(seen) >= 3 and np.abs(c).max() > 1e-2               # the corrections are exercised


@functools.lru_cache(maxsize=None)
def _one_corrected_round(variant: str, local_steps: int):
    """One round from a state with random c and c_i (float64): (data arrays, state before,
    state after, sampled ids)."""
    with jax.enable_x64(True):
        data, x, y, train = regression_data()
        algo = algorithms.get("scaffold", model=REGRESSION, lr=0.2, server_lr=0.5, batch_size=8,
                              local_steps=local_steps, participation=0.5, variant=variant)
        state = algo.init(jax.random.key(0), data)
        rng = np.random.default_rng(7)
        state = state._replace(control=unflat(rng.normal(size=4)),
                               client_control=unflat(rng.normal(size=(N, 4))))
        new, metrics = jax.jit(algo.round_fn)(state, data, jax.random.key(4))
        return (x, y, train), state, new, [int(i) for i in metrics["sampled"]]


def test_the_optimizer_steps_on_the_corrected_gradient(x64):
    # One full-batch step with c ≠ 0: y_i = x − η(∇f_i(x) − c_i + c), and
    # x⁺ = x + η_g · mean_i (y_i − x); option II then gives c_i⁺ = c_i − c + (x − y_i)/η = ∇f_i(x).
    (x, y, train), state, new, sampled = _one_corrected_round("ii", 1)
    xs, c, ci = flat(state.params), flat(state.control), flat(state.client_control)
    grads = {i: numpy_grad(xs[:3], xs[3], x[train[i]], y[train[i]]) for i in sampled}
    models = [xs - 0.2 * (grads[i] - ci[i] + c) for i in sampled]
    np.testing.assert_allclose(flat(new.params), xs + 0.5 * np.mean([m - xs for m in models], 0),
                               **TIGHT)
    for i in sampled:
        np.testing.assert_allclose(flat(new.client_control)[i], grads[i], **TIGHT)
    expected_c = c + sum(grads[i] - ci[i] for i in sampled) / N
    np.testing.assert_allclose(flat(new.control), expected_c, **TIGHT)


def test_unsampled_clients_keep_their_control_variates(x64):
    _, state, new, sampled = _one_corrected_round("ii", 1)
    unsampled = sorted(set(range(N)) - set(sampled))
    assert len(sampled) == 2 and len(unsampled) == 2
    before, after = flat(state.client_control), flat(new.client_control)
    np.testing.assert_array_equal(after[unsampled], before[unsampled])          # bit for bit
    assert np.all(np.abs(after[sampled] - before[sampled]) > 1e-6)


def test_option_i_stores_the_full_data_gradient_at_the_server_model(x64):
    # Option I: c_i⁺ = ∇f_i(x) over all of client i's data, whatever the local steps did (two
    # steps here, where option II's (x − y_i)/(2η) − c + c_i would differ).
    (x, y, train), state, new, sampled = _one_corrected_round("i", 2)
    xs, c, ci = flat(state.params), flat(state.control), flat(state.client_control)
    grads = {i: numpy_grad(xs[:3], xs[3], x[train[i]], y[train[i]]) for i in sampled}
    for i in sampled:
        np.testing.assert_allclose(flat(new.client_control)[i], grads[i], **TIGHT)
    np.testing.assert_allclose(flat(new.control), c + sum(grads[i] - ci[i] for i in sampled) / N,
                               **TIGHT)


def _rounds(backend, data):
    algo = algorithms.get("scaffold", model=linear_model(), backend=backend, chunk_size=2, lr=0.1,
                          batch_size=4, local_epochs=2, participation=0.5, server_lr=0.8,
                          momentum=0.5, momentum_buffer="persist", weights="data_size")
    step = algo.round_fn if backend == "loop" else jax.jit(algo.round_fn)
    state = algo.init(jax.random.key(0), data)
    for r in range(2):                      # round 2 steps with c ≠ 0 and persisted momentum
        state, _ = step(state, data, jax.random.key(r))
    return state, algo.evaluate(state, data)


@pytest.mark.slow      # the loop backend runs rounds eagerly (a consistency check)
def test_chunked_backend_equals_loop_backend(ragged_data):
    # A consistency check of the vectorised path (ragged clients of 7, 23, 12 and 1 samples, so
    # K_i differs, persistent momentum rows); the values are pinned by the tests above.
    ref, ref_eval = _rounds("loop", ragged_data)
    state, ev = _rounds("chunked", ragged_data)
    tree_allclose(state, ref, rtol=2e-5, atol=1e-6)
    assert float(jnp.abs(ref.control["w"]).max()) > 1e-3
    np.testing.assert_allclose(ev["client"].correct, ref_eval["client"].correct)


def test_cli_help_explains_the_flags():
    import run as cli

    text = " ".join(cli.build_parser().format_help().split())
    assert "--scaffold-server-lr FLOAT η_g, the global step size" in text
    assert "--scaffold-variant {ii,i}" in text and "--scaffold-weights {uniform,data_size}" in text
    with pytest.raises(ValueError, match="--scaffold-server-lr must be > 0"):
        algorithms.get("scaffold", model=linear_model(), server_lr=0.0)


@pytest.mark.parametrize("variant", ["ii", "i"])
@pytest.mark.slow
def test_a_client_without_data_keeps_its_control_variate_and_contributes_nothing(x64, variant):
    # A7: a client with n_i = 0 takes K_i = 0 steps, so option II's (x − y_i)/(K_i η_l) is 0/0
    # and option I's gradient has no data: its c_i stays as it was (bit for bit), Δc_i = 0 and
    # Δy_i = y_i − x = 0. With every client sampled (M = N = 4) and uniform weights, x⁺ and c⁺
    # are the three data clients' updates summed over M = N = 4 (the empty one adds 0).
    sizes = [3, 0, 2, 4]
    rng = np.random.default_rng(11)
    rows = rng.normal(size=(sum(sizes) + len(sizes), 3))
    targets = np.concatenate([rng.integers(0, 5, sum(sizes)), np.zeros(len(sizes), int)])
    bounds = np.cumsum([0] + sizes)
    train = [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    test = [np.array([bounds[-1] + k]) for k in range(len(sizes))]
    data = FederatedData.from_arrays(rows, targets, train, test, num_classes=5)
    lr, server_lr = 0.2, 0.5
    algo = algorithms.get("scaffold", model=REGRESSION, lr=lr, server_lr=server_lr, batch_size=8,
                          local_steps=1, participation=1.0, variant=variant)
    state = algo.init(jax.random.key(0), data)
    c, ci = rng.normal(size=4), rng.normal(size=(N, 4))
    state = state._replace(control=unflat(c), client_control=unflat(ci))
    new, metrics = jax.jit(algo.round_fn)(state, data, jax.random.key(2))
    np.testing.assert_array_equal(np.sort(metrics["sampled"]), np.arange(N))
    xs = flat(state.params)
    delta_y, delta_c, c_new = np.zeros((N, 4)), np.zeros((N, 4)), ci.copy()
    for i in (0, 2, 3):           # one full-batch step on the corrected gradient (line 10)
        g = numpy_grad(xs[:3], xs[3], rows[train[i]], targets[train[i]])
        yi = xs - lr * (g - ci[i] + c)
        c_new[i] = g if variant == "i" else ci[i] - c + (xs - yi) / lr        # line 11
        delta_y[i], delta_c[i] = yi - xs, c_new[i] - ci[i]
    got = flat(new.client_control)
    np.testing.assert_array_equal(got[1], ci[1])                  # the empty client: kept exactly
    np.testing.assert_allclose(got, c_new, **TIGHT)
    np.testing.assert_allclose(flat(new.params), xs + server_lr * delta_y.sum(0) / N, **TIGHT)
    np.testing.assert_allclose(flat(new.control), c + delta_c.sum(0) / N, **TIGHT)
