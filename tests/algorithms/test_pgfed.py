"""PGFed / PGFedMo / PGFed-CE: docs/algorithms/pgfed.md#tests (T-numbers below) against an
independent NumPy transcription."""

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_states_close, linear_model, make_data, tree_equal

from fedjax_pfl import algorithms
from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.models.model import Model

THETA0 = np.array([0.5, -0.2, 0.1])
# f_i(θ) = mean_j ½‖θ − x_j‖² over client i's samples: gradient θ − mean(x).
QUADRATIC = Model(init=lambda key: {"x": jnp.asarray(THETA0)}, apply=lambda p, x: p["x"] - x,
                  loss=lambda out, y: 0.5 * jnp.sum(out**2, axis=-1))
SIZES = [3, 5, 2, 4, 6]

# A round's hyperparameters are constants of its compiled program, and jax.jit's cache is keyed
# by the function, which a freshly built algorithm does not share: tests whose algorithm, model
# and (resolved) hyperparameters agree take their jitted round from here and compile it once
# per test process (the data are arguments, so any clients of the same shapes reuse it).
MODELS = {"quadratic": QUADRATIC, "linear": linear_model()}
_STEPS: dict = {}


def algo_and_step(name, model="quadratic", *, product=False, **hp):
    """(algorithm, its jitted round_fn; at XLA's defaults with product=True), shared by every
    test of this module that asks for the same algorithm, model and hyperparameters (defaults
    resolved, so naming a default value or leaving it out is the same program)."""
    algo = algorithms.get(name, model=MODELS[model], **hp)
    x64 = jnp.zeros(()).dtype == jnp.float64
    key = (name, model, product, x64, tuple(sorted((k, repr(v)) for k, v in algo.hparams.items())))
    if key not in _STEPS:
        _STEPS[key] = (algo, (helpers.product_jit if product else jax.jit)(algo.round_fn))
    return _STEPS[key]


def quadratic_clients(seed=0):
    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=(n, 3)) + rng.normal(size=3) * 2 for n in SIZES]
    starts = np.cumsum([0] + SIZES)
    train = [np.arange(a, b) for a, b in zip(starts[:-1], starts[1:])]
    return FederatedData.from_arrays(np.concatenate(xs), np.zeros(starts[-1]), train, train,
                                     num_classes=1), xs


def reference_rounds(xs, sampled_per_round, *, mu, eta1, eta2, beta, epochs, momentum, ce=False):
    """The reference code's round (docs/algorithms/pgfed.md#round), literally, one client at a
    time, in float64.

    Full batches (B ≥ n_i with drop_last: one step of all n_i samples per epoch), so the batch
    order cannot matter.
    """
    n, m = len(xs), len(sampled_per_round[0])
    A = np.full((n, n), 1.0 / m)
    theta = [THETA0.copy() for _ in range(n)]
    buf = [np.zeros(3) for _ in range(n)]
    held = [None] * n
    G, b, gbar, prev = {}, {}, None, []
    theta_g = THETA0.copy()
    history = []
    for S in sampled_per_round:
        new_G, new_b = {}, {}
        for i in S:
            th = theta_g.copy()                                       # send: θ_i ← θ_g
            if G:
                c = sum(mu * A[i, j] * G[j] for j in prev)
                held[i] = c if held[i] is None else (1 - beta) * c + beta * held[i]
            for _ in range(epochs):
                grad = th - xs[i].mean(0)
                if G:
                    grad = grad + held[i]
                    for j in prev:
                        g2 = (mu * G[j] @ theta_g) if ce else gbar @ th   # s = ḡ·θ_i before the step
                        A[i, j] = max(0.0, A[i, j] - eta2 * (b[j] + g2))
                buf[i] = momentum * buf[i] + grad
                th = th - eta1 * buf[i]
            theta[i] = th
            L = np.mean(0.5 * np.sum((th - xs[i]) ** 2, axis=1))
            new_G[i] = th - xs[i].mean(0)
            new_b[i] = mu * (L - new_G[i] @ th)
        weights = np.array([len(xs[i]) for i in S], float)
        theta_g = sum(w * theta[i] for w, i in zip(weights / weights.sum(), S))
        gbar = mu / m * sum(new_G[i] for i in S)
        G, b, prev = new_G, new_b, list(S)
        history.append(dict(theta=np.array(theta), A=A.copy(), theta_g=theta_g.copy(),
                            held=[None if h is None else h.copy() for h in held]))
    return history


# The backend comparison's setting; T4's test (beta_zero) runs the same chunked PGFed program.
BACKEND_HP = dict(participation=0.75, local_epochs=2, batch_size=4, chunk_size=2)


def run(name, data, rounds=5, **hp):
    hp = dict(participation=0.6, local_epochs=2, batch_size=8, lr=0.1, mu=0.3, alpha_lr=0.05) | hp
    algo, step = algo_and_step(name, **hp)
    state = algo.init(jax.random.key(0), data)
    states, sampled = [], []
    for r in range(rounds):
        state, m = step(state, data, jax.random.fold_in(jax.random.key(1), r))
        states.append(state)
        sampled.append(np.asarray(m["sampled"]).tolist())
    return algo, states, sampled


@pytest.mark.parametrize("name,beta,ce", [("pgfed", 0.0, False), ("pgfedmo", 0.5, False),
                                          pytest.param("pgfed_ce", 0.0, True, marks=pytest.mark.slow)])
def test_matches_reference_transcription(x64, name, beta, ce):
    data, xs = quadratic_clients()
    hp = {"beta": beta} if name == "pgfedmo" else {}
    _, states, sampled = run(name, data, **hp)
    assert all(len(s) == 3 for s in sampled)                      # M = floor(0.6 · 5)
    ref = reference_rounds(xs, sampled, mu=0.3, eta1=0.1, eta2=0.05, beta=beta, epochs=2,
                           momentum=0.9, ce=ce)
    for state, expected in zip(states, ref):
        np.testing.assert_allclose(state.clients.theta["x"], expected["theta"], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(state.alpha, expected["A"], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(state.global_params["x"], expected["theta_g"], rtol=1e-10)
        for i, h in enumerate(expected["held"]):
            if h is not None:
                np.testing.assert_allclose(state.clients.aux["x"][i], h, rtol=1e-10, atol=1e-12)
            else:
                assert not bool(state.clients.aux_set[i])
    assert any(np.any(s.alpha != s.alpha[0, 0]) for s in states)   # α actually moved


@pytest.mark.slow
def test_mu_zero_reproduces_fedavg_exactly(ragged_data):
    # T1: same sampling, batch order, optimizer and init: identical θ trajectories.
    hp = dict(participation=0.5, local_epochs=2, batch_size=4, lr=0.05, momentum=0.9,
              momentum_buffer="persist", drop_last=True)
    pg, pg_round = algo_and_step("pgfed", "linear", product=True, mu=0.0, alpha_lr=0.5, **hp)
    fa, fa_round = algo_and_step("fedavg", "linear", product=True, **hp)     # also in T7's test
    s_pg, s_fa = pg.init(jax.random.key(0), ragged_data), fa.init(jax.random.key(0), ragged_data)
    for r in range(4):
        key = jax.random.key(r)
        s_pg, m_pg = pg_round(s_pg, ragged_data, key)
        s_fa, m_fa = fa_round(s_fa, ragged_data, key)
        tree_equal(s_pg.global_params, s_fa.params)
        np.testing.assert_array_equal(m_pg["train_loss"], m_fa["train_loss"])
        tree_equal(s_pg.clients.opt_state, s_fa.opt_state)           # per-client momentum buffers
    np.testing.assert_array_equal(s_pg.alpha, 1.0 / 2)              # A stays at 1/M


@pytest.mark.slow
def test_zero_alpha_and_zero_alpha_lr_is_fedavg_training(x64):
    # T2: A ≡ 0 and η₂ = 0 give g̃ = 0 for any μ, and α never moves.
    data, xs = quadratic_clients(1)
    algo = algorithms.get("pgfed", model=QUADRATIC, participation=0.6, local_epochs=2,
                          batch_size=8, lr=0.1, mu=0.5, alpha_lr=0.0)
    fa = algorithms.get("fedavg", model=QUADRATIC, participation=0.6, local_epochs=2,
                        batch_size=8, lr=0.1, momentum=0.9, momentum_buffer="persist", drop_last=True)
    s, f = algo.init(jax.random.key(0), data), fa.init(jax.random.key(0), data)
    s = s._replace(alpha=jnp.zeros_like(s.alpha))
    for r in range(3):
        s, _ = jax.jit(algo.round_fn)(s, data, jax.random.key(r))
        f, _ = jax.jit(fa.round_fn)(f, data, jax.random.key(r))
        np.testing.assert_allclose(s.global_params["x"], f.params["x"], rtol=1e-12)
    assert float(jnp.abs(s.alpha).max()) == 0.0


@pytest.mark.slow
def test_beta_zero_pgfedmo_is_pgfed_bit_for_bit(ragged_data):
    # T4 (PGFed's program is the chunked one of test_vmapped_equals_loop_backend[pgfed])
    a, step_a = algo_and_step("pgfed", "linear", **BACKEND_HP)
    b, step_b = algo_and_step("pgfedmo", "linear", beta=0.0, **BACKEND_HP)
    sa, sb = a.init(jax.random.key(0), ragged_data), b.init(jax.random.key(0), ragged_data)
    for r in range(3):
        sa, _ = step_a(sa, ragged_data, jax.random.key(r))
        sb, _ = step_b(sb, ragged_data, jax.random.key(r))
    tree_equal(sa, sb)


@pytest.mark.slow
def test_round_two_download_is_gbar_and_momentum_recursion(x64):
    # T8: in round 2 every sampled client's α row is 1/M, so c_i = ḡ for all of them.
    # T6: with full participation a client's held gradient follows c¹, (1−β)c² + βc¹,
    # (1−β)c³ + β(1−β)c² + β²c¹.
    data, xs = quadratic_clients(2)
    beta = 0.3
    algo, step = algo_and_step("pgfedmo", participation=1.0, local_epochs=1, batch_size=8, lr=0.1,
                               mu=0.2, alpha_lr=0.05, beta=beta)     # first_aux "copy" (A6's test)
    state = algo.init(jax.random.key(0), data)
    downloads = []
    for r in range(4):
        if r >= 1:   # the download this round: c = μ A[S, P] @ G from the state before the round
            downloads.append(0.2 * np.asarray(state.alpha)[:, np.asarray(state.prev_idx)]
                             @ np.asarray(state.prev_grads["x"]))
        gbar_before = np.asarray(state.gbar["x"])
        state, _ = step(state, data, jax.random.key(r))
        if r == 1:
            np.testing.assert_allclose(state.clients.aux["x"], np.tile(gbar_before, (5, 1)), rtol=1e-12)
    c1, c2, c3 = downloads
    expected = (1 - beta) * c3 + beta * (1 - beta) * c2 + beta**2 * c1
    np.testing.assert_allclose(state.clients.aux["x"], expected, rtol=1e-12)


@pytest.mark.slow
def test_alpha_is_nonnegative_and_only_previous_columns_move(ragged_data):
    # T15–T16: α ≥ 0; columns j ∉ S_{t−1} are unchanged during round t; rows of unsampled
    # clients are unchanged.
    algo, step = algo_and_step("pgfed", "linear", participation=0.5, alpha_lr=5.0, mu=1.0,
                               local_epochs=1, batch_size=4)   # also the α statistics' test's
    state = algo.init(jax.random.key(0), ragged_data)
    for r in range(5):
        before = np.asarray(state.alpha)
        prev = set(np.asarray(state.prev_idx).tolist()) if r else set()
        state, m = step(state, ragged_data, jax.random.key(r))
        after = np.asarray(state.alpha)
        assert np.all(after >= 0)
        sampled = set(np.asarray(m["sampled"]).tolist())
        for i in range(4):
            for j in range(4):
                if i not in sampled or j not in prev:
                    assert after[i, j] == before[i, j]
    assert float(m["alpha_zero_fraction"]) > 0    # the projection at 0 is active here


@pytest.mark.slow
def test_gradients_of_the_auxiliary_risk(x64):
    # T9–T11: R_aux(θ_i, α_i) = μ Σ_{j∈P} α_ij [L_j + G_j·(θ_i − θ_j)] (eq. 9), built from the
    # state the implementation uploaded in round 1. In round 2, jax.grad of R_aux in θ must be
    # the download the code adds to every step (constant in θ), and the code's α step must be
    # −η₂ times jax.grad in α with the exact μ G_j·θ_i replaced by its mean over j, ḡ·θ_i.
    data, xs = quadratic_clients(3)
    mu, eta2 = 0.3, 0.05
    # One full-batch step per round (B ≥ n_i), so round 2's only α step is taken at θ_i = θ_g.
    # (T3's program: test_alpha_recovers_from_zero_only_when_the_gradient_is_negative.)
    algo, step = algo_and_step("pgfed", participation=0.6, local_epochs=1, batch_size=8, lr=0.1,
                               mu=mu, alpha_lr=eta2)
    state, _ = step(algo.init(jax.random.key(0), data), data, jax.random.key(0))
    P = np.asarray(state.prev_idx)
    G = np.asarray(state.prev_grads["x"])
    theta_j = np.asarray(state.clients.theta["x"])[P]
    L = np.asarray(state.prev_b) / mu + np.sum(G * theta_j, axis=1)
    # L_j must be client j's mean loss at θ_j.
    for k, j in enumerate(P):
        np.testing.assert_allclose(L[k], np.mean(0.5 * np.sum((theta_j[k] - xs[j]) ** 2, 1)), rtol=1e-12)

    def r_aux(theta_i, alpha_i):
        return mu * jnp.sum(alpha_i * (L + G @ theta_i - jnp.sum(G * theta_j, axis=1)))

    after, metrics = step(state, data, jax.random.key(1))
    theta_g = jnp.asarray(state.global_params["x"])
    for i in np.asarray(metrics["sampled"]):
        alpha_i = jnp.asarray(state.alpha)[i, P]
        d_theta, d_alpha = jax.grad(r_aux, argnums=(0, 1))(theta_g, alpha_i)
        np.testing.assert_allclose(after.clients.aux["x"][i], d_theta, rtol=1e-12)
        np.testing.assert_allclose(jax.grad(r_aux)(3 * theta_g + 1, alpha_i), d_theta, rtol=1e-12)
        exact = mu * G @ theta_g
        np.testing.assert_allclose(np.asarray(state.gbar["x"]) @ theta_g, exact.mean(), rtol=1e-12)
        surrogate = d_alpha - exact + exact.mean()
        np.testing.assert_allclose(after.alpha[i, P], np.maximum(0.0, alpha_i - eta2 * surrogate),
                                   rtol=1e-12, atol=1e-15)
        assert not np.allclose(after.alpha[i, P], alpha_i)       # the step did move α


@pytest.mark.slow
def test_alpha_update_count_per_client(x64):
    # T17: client i makes exactly E·⌊n_i/B⌋ α updates in a round (drop_last). With ḡ = 0 and
    # b_j = −1 every update adds exactly η₂ to each touched α_ij, so the change counts them.
    sizes = [7, 23, 12, 16]
    data = make_data(sizes)
    eta2, epochs, batch = 0.01, 2, 4
    algo = algorithms.get("pgfed", model=linear_model(), participation=1.0, local_epochs=epochs,
                          batch_size=batch, lr=0.05, mu=0.3, alpha_lr=eta2, drop_last=True)
    step = jax.jit(algo.round_fn)
    state, _ = step(algo.init(jax.random.key(0), data), data, jax.random.key(0))
    state = state._replace(gbar=jax.tree.map(jnp.zeros_like, state.gbar),
                           prev_b=-jnp.ones_like(state.prev_b))
    after, _ = step(state, data, jax.random.key(1))
    n_train = np.asarray(data.clients.train_count)
    expected = epochs * (n_train // batch) * eta2
    np.testing.assert_allclose(np.asarray(after.alpha - state.alpha),
                               np.tile(expected[:, None], (1, 4)), rtol=1e-9)


@pytest.mark.slow
def test_first_aux_zero_weights_the_first_download(x64):
    # A6 option: with --pgfed-first-aux zero the held gradient starts at 0, so the first download
    # enters as (1−β) c instead of c; before any download both variants are identical.
    data, _ = quadratic_clients(4)
    hp = dict(participation=1.0, local_epochs=1, batch_size=8, lr=0.1, mu=0.2, alpha_lr=0.05,
              beta=0.3)
    states = {}
    for first in ("copy", "zero"):      # "copy": T6/T8's program (the default)
        algo, step = algo_and_step("pgfedmo", first_aux=first, **hp)
        state = algo.init(jax.random.key(0), data)
        for r in range(2):
            state, _ = step(state, data, jax.random.key(r))
            if r == 0:
                before = state
        states[first] = (before, state)
    tree_equal(states["copy"][0], states["zero"][0])
    copy, zero = states["copy"][1], states["zero"][1]
    assert float(jnp.abs(copy.clients.aux["x"]).max()) > 0
    np.testing.assert_allclose(zero.clients.aux["x"], 0.7 * copy.clients.aux["x"], rtol=1e-12)
    assert bool(zero.clients.aux_set.all())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pgfed", pytest.param("pgfedmo", marks=pytest.mark.slow),
                                  pytest.param("pgfed_ce", marks=pytest.mark.slow)])
def test_vmapped_equals_loop_backend(ragged_data, name):
    runs = {}
    for backend in ("loop", "vmap", "chunked"):      # as helpers.states_per_backend
        algo, step = algo_and_step(name, "linear", backend=backend, **BACKEND_HP)
        step = algo.round_fn if backend == "loop" else step          # the loop runs eagerly
        state = algo.init(jax.random.key(0), ragged_data)
        for r in range(3):
            state, _ = step(state, ragged_data, jax.random.key(r))
        runs[backend] = state
    for backend in ("vmap", "chunked"):       # every field: θ_i, buffers, α and its statistics, …
        assert_states_close(runs[backend], runs["loop"])


def test_defaults_follow_the_reference_code():
    algo = algorithms.get("pgfedmo", model=linear_model())
    hp = algo.hparams
    assert (hp["lr"], hp["mu"], hp["alpha_lr"], hp["beta"], hp["batch_size"], hp["local_epochs"],
            hp["participation"], hp["momentum"], hp["momentum_buffer"]) == \
        (0.005, 0.1, 0.01, 0.5, 10, 5, 0.25, 0.9, "persist")
    with pytest.raises(ValueError, match="has no hyperparameter beta"):
        algorithms.get("pgfed", model=linear_model(), beta=0.5)


@pytest.mark.slow
def test_alpha_recovers_from_zero_only_when_the_gradient_is_negative(x64):
    # T3: from A ≡ 0 an entry leaves 0 only through a step with b_j + s < 0. With one local
    # epoch of one full batch, each sampled client takes exactly one α step, at θ_i = θ_g, so
    # α_ij = max(0, −η₂ (b_j + ḡ·θ_g)): positive exactly where the gradient is negative.
    # Client 2 sits far from the others: its b_j = μ(L_j − G_j·θ_j) is strongly positive while
    # the near clients' b_j + ḡ·θ_g are negative, so both cases occur.
    rng = np.random.default_rng(0)
    centres = [[0, 0, 0], [0.5, 0, 0], [6.0, -4.0, 2.0], [-0.3, 0.2, 0], [0, 0.4, 0.1]]
    xs = [np.asarray(c) + 0.3 * rng.normal(size=(n, 3)) for c, n in zip(centres, SIZES)]
    starts = np.cumsum([0] + SIZES)
    train = [np.arange(a, b) for a, b in zip(starts[:-1], starts[1:])]
    data = FederatedData.from_arrays(np.concatenate(xs), np.zeros(starts[-1]), train, train,
                                     num_classes=1)
    algo, step = algo_and_step("pgfed", participation=0.6, local_epochs=1, batch_size=8, lr=0.1,
                               mu=0.3, alpha_lr=0.05)          # T9–T11's program
    state = algo.init(jax.random.key(0), data)
    state = state._replace(alpha=jnp.zeros_like(state.alpha))
    state, _ = step(state, data, jax.random.key(0))
    theta_g = np.asarray(state.global_params["x"])
    P, b, gbar = np.asarray(state.prev_idx), np.asarray(state.prev_b), np.asarray(state.gbar["x"])
    state, m = step(state, data, jax.random.key(1))
    grad = b + gbar @ theta_g
    assert np.any(grad < 0) and np.any(grad > 0)        # both cases occur in this example
    for i in np.asarray(m["sampled"]):
        got = np.asarray(state.alpha)[i, P]
        np.testing.assert_allclose(got, np.maximum(0.0, -0.05 * grad), rtol=1e-12, atol=0)
        assert np.all(got[grad >= 0] == 0.0)


@pytest.mark.slow
def test_beta_one_keeps_the_first_download(x64):
    # T5: with β = 1 the held auxiliary gradient stays at its first (copied) download.
    data, xs = quadratic_clients(5)
    algo = algorithms.get("pgfedmo", model=QUADRATIC, participation=1.0, local_epochs=1,
                          batch_size=8, lr=0.1, mu=0.2, alpha_lr=0.05, beta=1.0)
    state = algo.init(jax.random.key(0), data)
    step = jax.jit(algo.round_fn)
    state, _ = step(state, data, jax.random.key(0))
    state, _ = step(state, data, jax.random.key(1))
    first = np.asarray(state.clients.aux["x"])
    for r in range(2, 5):
        state, _ = step(state, data, jax.random.key(r))
        np.testing.assert_array_equal(state.clients.aux["x"], first)


@pytest.mark.slow
def test_round_one_is_fedavg_for_any_mu(ragged_data):
    # T7: no auxiliary term and no α update in round 1.
    hp = dict(participation=0.5, local_epochs=2, batch_size=4, lr=0.05, momentum=0.9,
              momentum_buffer="persist", drop_last=True)
    # Two different programs agreeing bit for bit: at XLA's defaults (helpers.product_jit); at the
    # suite's -O0 they differed by one ulp on an AMD EPYC (32 MiB L3) machine. FedAvg's program
    # is T1's (test_mu_zero_reproduces_fedavg_exactly).
    pg, pg_round = algo_and_step("pgfed", "linear", product=True, mu=0.7, alpha_lr=0.5, **hp)
    fa, fa_round = algo_and_step("fedavg", "linear", product=True, **hp)
    s_pg, _ = pg_round(pg.init(jax.random.key(0), ragged_data), ragged_data, jax.random.key(3))
    s_fa, _ = fa_round(fa.init(jax.random.key(0), ragged_data), ragged_data, jax.random.key(3))
    tree_equal(s_pg.global_params, s_fa.params)
    np.testing.assert_array_equal(s_pg.alpha, 0.5)


@pytest.mark.slow
def test_taylor_gap_on_quadratic_clients(x64):
    # T12: for f_j = mean ½‖θ − x‖², f_j(θ_i) − [L_j + G_j·(θ_i − θ_j)] = ½‖θ_i − θ_j‖².
    data, xs = quadratic_clients(6)
    mu = 0.3
    algo, step = algo_and_step("pgfed", participation=0.6, local_epochs=2, batch_size=8, lr=0.1,
                               mu=mu, alpha_lr=0.05)          # the transcription test's program
    state, _ = step(algo.init(jax.random.key(0), data), data, jax.random.key(0))
    P = np.asarray(state.prev_idx)
    G = np.asarray(state.prev_grads["x"])
    theta = np.asarray(state.clients.theta["x"])
    L = np.asarray(state.prev_b) / mu + np.sum(G * theta[P], axis=1)
    theta_i = np.array([1.0, -0.5, 0.25])
    for k, j in enumerate(P):
        exact = np.mean(0.5 * np.sum((theta_i - xs[j]) ** 2, axis=1))
        gap = exact - (L[k] + G[k] @ (theta_i - theta[j]))
        assert gap == pytest.approx(0.5 * np.sum((theta_i - theta[j]) ** 2), rel=1e-10)


@pytest.mark.slow
def test_unsampled_clients_keep_all_their_state(ragged_data):
    # T14/T22: θ_i, the held g̃_i, its flag and the optimizer buffer of unsampled clients.
    algo = algorithms.get("pgfedmo", model=linear_model(), participation=0.5, local_epochs=1,
                          batch_size=4)
    step = jax.jit(algo.round_fn)
    state = algo.init(jax.random.key(0), ragged_data)
    for r in range(3):
        new, m = step(state, ragged_data, jax.random.key(r))
        sampled = set(np.asarray(m["sampled"]).tolist())
        for i in set(range(4)) - sampled:
            tree_equal(jax.tree.map(lambda x: x[i], state.clients), jax.tree.map(lambda x: x[i], new.clients))
        state = new


@pytest.mark.slow
def test_identical_clients_give_identical_models(x64):
    # T27: full participation, identical data on every client, equal α rows.
    x = np.random.default_rng(0).normal(size=(4, 3))
    data = FederatedData.from_arrays(np.tile(x, (3, 1)), np.zeros(12),
                                     [np.arange(0, 4), np.arange(4, 8), np.arange(8, 12)],
                                     [np.arange(0, 4), np.arange(4, 8), np.arange(8, 12)], num_classes=1)
    algo = algorithms.get("pgfedmo", model=QUADRATIC, participation=1.0, local_epochs=2,
                          batch_size=8, lr=0.1, mu=0.3, alpha_lr=0.05)
    state = algo.init(jax.random.key(0), data)
    for r in range(3):
        state, _ = jax.jit(algo.round_fn)(state, data, jax.random.key(r))
    theta = np.asarray(state.clients.theta["x"])
    np.testing.assert_allclose(theta, np.tile(theta[0], (3, 1)), rtol=1e-12)
    np.testing.assert_allclose(state.global_params["x"], theta[0], rtol=1e-12)


@pytest.mark.slow
def test_alpha_statistics_without_an_n_by_n_temporary(ragged_data):
    """The α metrics kept in O(M·N) per round equal the direct N×N computations, zeros included
    (a large η₂ projects many α_ij to 0)."""
    algo, step = algo_and_step("pgfed", "linear", participation=0.5, alpha_lr=5.0, mu=1.0,
                               local_epochs=1, batch_size=4)   # T15–T16's program
    state = algo.init(jax.random.key(0), ragged_data)
    zero_seen = False
    for r in range(5):
        state, m = step(state, ragged_data, jax.random.key(r))
        a = np.asarray(state.alpha, np.float64)
        np.testing.assert_allclose(m["alpha_mean"], a.mean(), rtol=1e-5)
        np.testing.assert_allclose(m["alpha_row_mean_min"], a.mean(axis=1).min(), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(m["alpha_row_mean_max"], a.mean(axis=1).max(), rtol=1e-5)
        np.testing.assert_allclose(m["alpha_zero_fraction"], np.mean(a == 0), rtol=1e-6)
        zero_seen |= bool(np.any(a == 0))
    assert zero_seen
