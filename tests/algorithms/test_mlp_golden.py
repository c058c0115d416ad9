"""pFedSOP and PGFed through `round_fn` and `evaluate` on a model with several leaves, against an
independent NumPy float64 transcription of the papers' rounds (docs/algorithms/pfedsop.md#round,
docs/algorithms/pgfed.md#round).

The model is a two-layer tanh MLP with leaves of 20, 4, 12 and 3 entries: every norm, dot product
and angle of both algorithms must be taken over the whole parameter vector
(docs/algorithms/pfedsop.md#global-norms), which a one-leaf model cannot tell apart from a
per-leaf reading. Every client takes full-batch
steps (B ≥ n_i), so the batch order cannot matter and the transcription needs no engine keys.

The headline number a user reads is `evaluate(state, data)["client"]`: the tests compare it,
client by client and for an `ids` subset in a given order, with the test accuracy and loss of the
transcription's personal models computed here in NumPy. They also check that the situation tells
the right rows apart from the global model, from last round's (stale) models and from another
client's row, so a regression to any of those fails.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_raw

from fedjax_pfl import algorithms
from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.models.model import Model

SIZES = [6, 9, 4, 7, 5]          # N = 5 clients; B = 10 ≥ n_i: one full-batch step per epoch
TEST_SIZES = [8, 8, 8, 8, 8]
F, H, C = 5, 4, 3                # leaves w1 [5, 4], b1 [4], w2 [4, 3], b2 [3]
SHAPES = {"b1": (H,), "b2": (C,), "w1": (F, H), "w2": (H, C)}   # pytree (sorted key) order


def mlp_init(key):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    return {"w1": 0.8 * jax.random.normal(k1, (F, H)), "b1": 0.3 * jax.random.normal(k2, (H,)),
            "w2": 0.8 * jax.random.normal(k3, (H, C)), "b2": 0.3 * jax.random.normal(k4, (C,))}


MLP = Model(init=mlp_init, name="mlp2",
            apply=lambda p, x: jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"])


# ---------------------------------------------------------------------------------------------
# NumPy float64: the model on a flat parameter vector


def flatten(tree) -> np.ndarray:
    return np.concatenate([np.asarray(tree[k], np.float64).ravel() for k in SHAPES])


def unflatten(v: np.ndarray) -> dict:
    out, start = {}, 0
    for k, shape in SHAPES.items():
        size = int(np.prod(shape))
        out[k] = v[start:start + size].reshape(shape)
        start += size
    return out


def forward(v, x):
    p = unflatten(v)
    h = np.tanh(x @ p["w1"] + p["b1"])
    return h, h @ p["w2"] + p["b2"]


def per_example_loss(logits, y):
    z = logits - logits.max(1, keepdims=True)
    return np.log(np.exp(z).sum(1)) - z[np.arange(len(y)), y]


def loss_and_grad(v, x, y):
    """Mean softmax cross-entropy over (x, y) and its gradient by hand-written backprop."""
    p = unflatten(v)
    h, logits = forward(v, x)
    prob = np.exp(logits - logits.max(1, keepdims=True))
    prob /= prob.sum(1, keepdims=True)
    d_logits = (prob - np.eye(C)[y]) / len(y)
    d_z1 = (d_logits @ p["w2"].T) * (1 - h**2)
    grads = {"b1": d_z1.sum(0), "b2": d_logits.sum(0), "w1": x.T @ d_z1, "w2": h.T @ d_logits}
    return per_example_loss(logits, y).mean(), flatten(grads)


def model_scores(v, x, y):
    """(correct, loss_sum) of one model on one client's test split."""
    _, logits = forward(v, x)
    return float(np.sum(logits.argmax(1) == y)), float(per_example_loss(logits, y).sum())


def problem(seed=0):
    x, y, train, test, _, _ = make_raw(SIZES, num_classes=C, feature_dim=F,
                                       test_sizes=TEST_SIZES, seed=seed)
    data = FederatedData.from_arrays(x, y, train, test, num_classes=C, name="mlp-toy")
    x = x.astype(np.float64)
    clients = [(x[tr], y[tr], x[te], y[te]) for tr, te in zip(train, test)]
    return data, clients


def scores(models, clients):
    """[N] correct and [N] loss_sum of models[i] on client i's test split."""
    out = np.array([model_scores(v, c[2], c[3]) for v, c in zip(models, clients)])
    return out[:, 0], out[:, 1]


def assert_client_eval(ev, models, clients, ids=None):
    ids = range(len(clients)) if ids is None else ids
    correct, loss_sum = scores([models[i] for i in ids], [clients[i] for i in ids])
    np.testing.assert_array_equal(np.asarray(ev.count), [len(clients[i][3]) for i in ids])
    np.testing.assert_array_equal(np.asarray(ev.correct), correct)
    np.testing.assert_allclose(np.asarray(ev.loss_sum), loss_sum, rtol=1e-9)


def assert_distinguishable(truth, *wrong):
    """Every wrong choice of models changes some client's test loss by far more than tolerance."""
    _, ref = truth
    for models, clients in wrong:
        _, other = scores(models, clients)
        assert np.abs(other - ref).max() > 1e-3


@functools.lru_cache(maxsize=None)
def run_rounds(name, seed, rounds=4, **hp):
    """(algo, data, clients, states, sampled) of `rounds` rounds; shared by the golden and the
    headline tests (one compilation each)."""
    hp = (PGFED_HP if name.startswith("pgfed") else PFEDSOP_HP) | hp
    data, clients = problem(seed)
    with jax.enable_x64(True):
        return (*_run(name, data, rounds, **hp), data, clients)


def _run(name, data, rounds, **hp):
    algo = algorithms.get(name, model=MLP, **hp)
    state = algo.init(jax.random.key(0), data)
    step = jax.jit(algo.round_fn)
    states, sampled = [state], []
    for r in range(rounds):
        state, m = step(state, data, jax.random.fold_in(jax.random.key(1), r))
        states.append(state)
        sampled.append(np.asarray(m["sampled"]).tolist())
    return algo, states, sampled


# ---------------------------------------------------------------------------------------------
# pFedSOP


def pfedsop_reference(clients, x0, sampled_per_round, *, eta1, eta2, rho, lam, epochs, keep):
    """docs/algorithms/pfedsop.md#round, literally, one client at a time: one vector in R^d per
    model."""
    n = len(clients)
    x = [x0.copy() for _ in range(n)]
    delta = [np.zeros_like(x0) for _ in range(n)]
    is_new = [True] * n
    delta_glob = np.zeros_like(x0)
    history = []
    for S in sampled_per_round:
        uploads = []
        for i in S:
            if is_new[i]:
                xi = x0.copy()                                               # C0
            else:
                d, g = delta[i], delta_glob
                sim = d @ g / (np.linalg.norm(d) * np.linalg.norm(g))         # C1
                phi = np.arccos(np.clip(sim, -1, 1))                          # C2
                beta = 1 - np.exp(-np.exp(-lam * (phi - 1)))                  # C3
                dp = (1 - beta) * d + beta * g                                # C4
                step = np.linalg.solve(np.outer(dp, dp) + rho * np.eye(len(dp)), dp)   # C5–C6
                xi = x[i] - eta1 * step                                       # C7
            z = xi.copy()
            for _ in range(epochs):                                           # C9, full batch
                z = z - eta2 * loss_and_grad(z, clients[i][0], clients[i][1])[1]
            delta[i] = (xi - z) / eta2                                        # C10
            x[i] = xi if keep == "newton" else z                              # C11 (pfedsop.md#a3)
            is_new[i] = False
            uploads.append(delta[i])
        delta_glob = np.mean(uploads, axis=0)                                 # S3
        history.append(dict(x=[v.copy() for v in x], delta=[v.copy() for v in delta],
                            delta_glob=delta_glob.copy()))
    return history


PFEDSOP_HP = dict(participation=0.6, local_epochs=3, batch_size=10, eta_local=0.4,
                  eta_personal=0.7, rho=0.5, gompertz_lambda=1.5)


@pytest.mark.parametrize("keep", [pytest.param("newton", marks=pytest.mark.slow), "sgd"])
@pytest.mark.slow
def test_pfedsop_matches_float64_transcription_on_a_multi_leaf_model(x64, keep):
    algo, states, sampled, data, clients = run_rounds("pfedsop", 0, keep=keep)
    assert all(len(s) == 3 for s in sampled)                      # M = floor(0.6 · 5)
    x0 = flatten(states[0].x0)
    ref = pfedsop_reference(clients, x0, sampled, eta1=0.7, eta2=0.4, rho=0.5, lam=1.5, epochs=3,
                            keep=keep)
    returning = 0
    for r, (state, expected) in enumerate(zip(states[1:], ref)):
        for i in range(len(clients)):
            np.testing.assert_allclose(flatten(jax.tree.map(lambda a: a[i], state.clients.x)),
                                       expected["x"][i], rtol=1e-9, atol=1e-12)
            np.testing.assert_allclose(flatten(jax.tree.map(lambda a: a[i], state.clients.delta)),
                                       expected["delta"][i], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(flatten(state.delta_glob), expected["delta_glob"], rtol=1e-9,
                                   atol=1e-12)
        if r:
            returning += len(set(sampled[r]) & set().union(*map(set, sampled[:r])))
    assert returning >= 2                                         # Newton steps were taken


@pytest.mark.parametrize("keep", [pytest.param("newton", marks=pytest.mark.slow), "sgd"])
def test_pfedsop_headline_evaluation_is_each_clients_current_personal_model(x64, keep):
    algo, states, sampled, data, clients = run_rounds("pfedsop", 0, keep=keep)
    x0 = flatten(states[0].x0)
    ref = pfedsop_reference(clients, x0, sampled, eta1=0.7, eta2=0.4, rho=0.5, lam=1.5, epochs=3,
                            keep=keep)
    truth, stale = ref[-1]["x"], ref[-2]["x"]
    # The situation separates the right models from the wrong ones: the shared x0 (pFedSOP has
    # no global model), last round's models, and another client's row.
    rolled = truth[1:] + truth[:1]
    assert_distinguishable(scores(truth, clients), ([x0] * 5, clients), (stale, clients),
                           (rolled, clients))
    evals = algo.evaluate(states[-1], data)
    assert set(evals) == {"client"}
    assert_client_eval(evals["client"], truth, clients)
    ids = [3, 0, 4]                                               # a subset, not in id order
    assert_client_eval(algo.evaluate(states[-1], data, jnp.asarray(ids, jnp.int32))["client"],
                       truth, clients, ids)


# ---------------------------------------------------------------------------------------------
# PGFed


def pgfed_reference(clients, theta0, sampled_per_round, *, mu, eta1, eta2, momentum, epochs,
                    ce=False):
    """The reference code's round (docs/algorithms/pgfed.md#round), literally, one client at a
    time."""
    n, m = len(clients), len(sampled_per_round[0])
    A = np.full((n, n), 1.0 / m)
    theta = [theta0.copy() for _ in range(n)]
    buf = [np.zeros_like(theta0) for _ in range(n)]
    G, b, gbar, prev = {}, {}, None, []
    theta_g = theta0.copy()
    history = []
    for S in sampled_per_round:
        new_G, new_b = {}, {}
        for i in S:
            x_tr, y_tr = clients[i][0], clients[i][1]
            th = theta_g.copy()                                       # θ_i ← θ_g
            held = sum(mu * A[i, j] * G[j] for j in prev) if G else 0.0
            for _ in range(epochs):
                grad = loss_and_grad(th, x_tr, y_tr)[1] + held
                if G:
                    for j in prev:
                        s = mu * G[j] @ theta_g if ce else gbar @ th  # θ_i before the step
                        A[i, j] = max(0.0, A[i, j] - eta2 * (b[j] + s))
                buf[i] = momentum * buf[i] + grad
                th = th - eta1 * buf[i]
            theta[i] = th
            L, new_G[i] = loss_and_grad(th, x_tr, y_tr)               # full data, final θ_i
            new_b[i] = mu * (L - new_G[i] @ th)
        weights = np.array([len(clients[i][0]) for i in S], float)
        theta_g = sum(w * theta[i] for w, i in zip(weights / weights.sum(), S))
        gbar = mu / m * sum(new_G[i] for i in S)
        G, b, prev = new_G, new_b, list(S)
        history.append(dict(theta=[v.copy() for v in theta], A=A.copy(), theta_g=theta_g.copy(),
                            gbar=gbar.copy()))
    return history


PGFED_HP = dict(participation=0.6, local_epochs=3, batch_size=10, drop_last=False, lr=0.2,
                momentum=0.9, momentum_buffer="persist", mu=0.5, alpha_lr=0.3)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pgfed", pytest.param("pgfed_ce", marks=pytest.mark.slow)])
def test_pgfed_matches_float64_transcription_on_a_multi_leaf_model(x64, name):
    _, states, sampled, data, clients = run_rounds(name, 2)
    theta0 = flatten(states[0].global_params)
    ref = pgfed_reference(clients, theta0, sampled, mu=0.5, eta1=0.2, eta2=0.3, momentum=0.9,
                          epochs=3, ce=name == "pgfed_ce")
    for state, expected in zip(states[1:], ref):
        for i in range(len(clients)):
            np.testing.assert_allclose(flatten(jax.tree.map(lambda a: a[i], state.clients.theta)),
                                       expected["theta"][i], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(state.alpha, expected["A"], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(flatten(state.global_params), expected["theta_g"], rtol=1e-9)
        np.testing.assert_allclose(flatten(state.gbar), expected["gbar"], rtol=1e-9, atol=1e-12)
    moved = np.asarray(states[-1].alpha) != 1 / 3
    assert moved.any() and not moved.all()                        # α moved, and only where it may


@pytest.mark.slow
def test_pgfed_headline_evaluation_is_each_clients_current_personal_model(x64):
    algo, states, sampled, data, clients = run_rounds("pgfed", 2)
    theta0 = flatten(states[0].global_params)
    ref = pgfed_reference(clients, theta0, sampled, mu=0.5, eta1=0.2, eta2=0.3, momentum=0.9,
                          epochs=3)
    truth, stale, theta_g = ref[-1]["theta"], ref[-2]["theta"], ref[-1]["theta_g"]
    rolled = truth[1:] + truth[:1]
    assert_distinguishable(scores(truth, clients), ([theta_g] * 5, clients), (stale, clients),
                           (rolled, clients))
    evals = algo.evaluate(states[-1], data)
    assert_client_eval(evals["client"], truth, clients)
    assert_client_eval(evals["global"], [theta_g] * 5, clients)
    ids = [4, 1, 2]
    sub = algo.evaluate(states[-1], data, jnp.asarray(ids, jnp.int32))
    assert_client_eval(sub["client"], truth, clients, ids)
    assert_client_eval(sub["global"], [theta_g] * 5, clients, ids)
