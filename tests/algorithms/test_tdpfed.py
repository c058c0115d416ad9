"""TDPFed, pFedMe and FedAvg (s.a.r.) (docs/algorithms/tdpfed.md#round, #state and #tests;
T-numbers below).

The golden tests compare the real round_fn (float64) with a NumPy transcription of
docs/algorithms/tdpfed.md#round written here from the equations: explicit Khatri–Rao products and
unfoldings for the factor gradient (eq. 23), Nesterov and Adam written out, softmax-regression
gradients by hand.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import linear_model, make_data, make_raw, states_per_backend, tree_allclose

from fedjax_pfl import algorithms, models
from fedjax_pfl.models import cp

SIZES = [6, 9, 4]                        # three clients, full batches (batch 16 ≥ every n_i)
COMMON = dict(batch_size=16, local_steps=2)


def toy():
    return make_data(SIZES, feature_dim=5, num_classes=3, seed=3)


# ---------------------------------------------------------------------------------------------
# NumPy reference


def client_arrays(data, k):
    """Client k's training samples, from the raw arrays behind `toy()` (not the device layout)."""
    del data
    x, y, train, _, _, _ = make_raw(SIZES, feature_dim=5, num_classes=3, seed=3)
    return np.asarray(x, np.float64)[train[k]], np.asarray(y)[train[k]]


def ce_grad(theta, x, y):
    """Mean cross-entropy of softmax(x w + b) and its gradient."""
    z = x @ theta["w"] + theta["b"]
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    onehot = np.eye(3)[y]
    loss = -np.mean(np.log(p[np.arange(len(y)), y]))
    d = (p - onehot) / len(y)
    return loss, {"w": x.T @ d, "b": d.sum(axis=0)}


def kr(mats):
    out = mats[0]
    for m in mats[1:]:
        out = np.einsum("ir,jr->ijr", out, m).reshape(-1, m.shape[1])
    return out


def unfold(x, n):
    return np.moveaxis(x, n, 0).reshape(x.shape[n], -1)


def recon(a):
    return {"w": a["w"][0] @ a["w"][1].T if isinstance(a["w"], list) else a["w"], "b": a["b"]}


def factor_grads(a, theta, lam, modes):
    """λ(A^(n)V_n − θ_(n)H_n) (eq. 23) for n in `modes`; λ(b_A − b_θ) for the bias (mode 0)."""
    out = {"b": lam * (a["b"] - theta["b"]) if 0 in modes else np.zeros_like(a["b"])}
    if isinstance(a["w"], list):
        grads = []
        for n, f in enumerate(a["w"]):
            others = [g for m, g in enumerate(a["w"]) if m != n]
            h = kr(others)
            g = lam * (f @ (h.T @ h) - unfold(theta["w"], n) @ h) if n in modes else np.zeros_like(f)
            grads.append(g)
        out["w"] = grads
    else:
        out["w"] = lam * (a["w"] - theta["w"]) if 0 in modes else np.zeros_like(a["w"])
    return out


def leaves(t):
    return [t["b"]] + (t["w"] if isinstance(t["w"], list) else [t["w"]])


def rebuild(t, flat):
    return {"b": flat[0], "w": list(flat[1:]) if isinstance(t["w"], list) else flat[1]}


class Adam:
    def __init__(self, lr, like):
        self.lr, self.t = lr, 0
        self.m = [np.zeros_like(x) for x in like]
        self.v = [np.zeros_like(x) for x in like]

    def step(self, params, grads):
        self.t += 1
        out = []
        for i, (p, g) in enumerate(zip(params, grads)):
            self.m[i] = 0.9 * self.m[i] + 0.1 * g
            self.v[i] = 0.999 * self.v[i] + 0.001 * g * g
            mh, vh = self.m[i] / (1 - 0.9 ** self.t), self.v[i] / (1 - 0.999 ** self.t)
            out.append(p - self.lr * mh / (np.sqrt(vh) + 1e-8))
        return out


def reference_client(start, a0, x, y, hp):
    """ClientUpdate of tdpfed.md#round for one client: τ local rounds of s NAG + s' factor steps."""
    theta = {k: v.copy() for k, v in start.items()}
    a = {"b": a0["b"].copy(), "w": [f.copy() for f in a0["w"]] if isinstance(a0["w"], list)
         else a0["w"].copy()}
    buf = {k: np.zeros_like(v) for k, v in theta.items()}
    n_modes = len(leaves(a)) - 1
    cyclic = hp["factor_update"] == "cyclic"
    groups = [[0, 1]] + [[n + 1] for n in range(1, n_modes)] if cyclic else [list(range(n_modes + 1))]
    adams = [Adam(hp["lr"], [leaves(a)[i] for i in g]) for g in groups]
    first_losses = []
    for _ in range(hp["local_steps"]):
        centre = recon(a)
        for i in range(hp["personal_steps"]):
            loss, g = ce_grad(theta, x, y)
            if i == 0:
                first_losses.append(loss)
            for k in theta:
                g[k] = g[k] + hp["lam"] * (theta[k] - centre[k])
                buf[k] = hp["momentum"] * buf[k] + g[k]
                theta[k] = theta[k] - hp["personal_lr"] * (g[k] + hp["momentum"] * buf[k])
        for _ in range(hp["factor_steps"]):
            for group, adam in zip(groups, adams):
                modes = [group[-1] - 1] if cyclic else list(range(n_modes))
                flat = leaves(a)
                g = leaves(factor_grads(a, theta, hp["lam"], modes))
                if hp["factor_opt"] == "adam":
                    new = adam.step([flat[i] for i in group], [g[i] for i in group])
                else:
                    new = [flat[i] - hp["lr"] * g[i] for i in group]
                for i, v in zip(group, new):
                    flat[i] = v
                a = rebuild(a, flat)
    return theta, a, float(np.mean(first_losses))


def reference_round(data, factors, omega, sampled, hp):
    """One round of tdpfed.md#round (all clients train; S_t aggregated by AFM or ACT)."""
    start = omega if omega is not None else recon(factors)
    thetas, locals_, losses = [], [], []
    for k in range(len(SIZES)):
        x, y = client_arrays(data, k)
        th, a, loss = reference_client(start, factors, x, y, hp)
        thetas.append(th), locals_.append(a), losses.append(loss)
    counts = np.array([SIZES[k] for k in sampled], float)
    p = counts / counts.sum() if hp["weights"] == "data_size" else np.full(len(sampled), 1 / len(sampled))
    beta = hp["beta"]
    if hp["aggregate"] == "afm":
        new = [(1 - beta) * f + beta * sum(pk * leaves(locals_[k])[i] for pk, k in zip(p, sampled))
               for i, f in enumerate(leaves(factors))]
        return thetas, rebuild(factors, new), None, losses
    composed = {key: sum(pk * recon(locals_[k])[key] for pk, k in zip(p, sampled)) for key in ("w", "b")}
    omega = {key: (1 - beta) * recon(factors)[key] + beta * composed[key] for key in ("w", "b")}
    return thetas, None, omega, losses


def to_np(state_factors):
    w = state_factors["w"]
    return {"b": np.asarray(state_factors["b"], np.float64),
            "w": [np.asarray(f, np.float64) for f in w.factors] if cp.is_cp(w) else np.asarray(w, np.float64)}


HP = dict(cr=1.2, lam=3.0, personal_lr=0.1, personal_steps=3, factor_steps=4, factor_opt="adam",
          factor_update="joint", beta=1.4, aggregate="afm", weights="data_size", lr=0.05,
          momentum=0.9, participation=0.67, **COMMON)


@pytest.mark.slow
@pytest.mark.parametrize("change", [
    {}, {"factor_update": "cyclic"}, {"factor_opt": "gd"}, {"weights": "uniform", "beta": 1.0},
    {"cr": 1.0}, {"momentum": 0.0, "beta": 0.6},
])
def test_afm_rounds_match_the_numpy_transcription(x64, change):
    hp = {**HP, **change}
    data = toy()
    algo = algorithms.get("tdpfed", model=linear_model(), **{k: v for k, v in hp.items()})
    state = algo.init(jax.random.key(0), data)
    if hp["cr"] != 1.0:
        assert cp.ranks(state.factors) == {"w": 2}       # 5·3 / (1.2·8) = 1.56 → 2
    step = jax.jit(algo.round_fn)
    factors = to_np(state.factors)
    for r in range(2):
        state, m = step(state, data, jax.random.key(r))
        sampled = np.asarray(m["sampled"]).tolist()
        assert len(sampled) == 2 and len(set(sampled)) == 2       # S = floor(3 · 0.67) = 2
        thetas, factors, _, losses = reference_round(data, factors, None, sampled, hp)
        for k in range(3):                                          # every client trained
            np.testing.assert_allclose(state.theta["w"][k], thetas[k]["w"], rtol=1e-9, atol=1e-11)
            np.testing.assert_allclose(state.theta["b"][k], thetas[k]["b"], rtol=1e-9, atol=1e-11)
        got = to_np(state.factors)
        for a, b in zip(leaves(got), leaves(factors)):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11)
        np.testing.assert_allclose(m["train_loss"], losses, rtol=1e-9)
        np.testing.assert_array_equal(m["trained"], [0, 1, 2])
        assert int(m["client_steps"]) == 3 * hp["local_steps"]


@pytest.mark.slow
def test_act_round_matches_the_numpy_transcription(x64):
    hp = {**HP, "aggregate": "act", "als_iters": 30}
    data = toy()
    algo = algorithms.get("tdpfed", model=linear_model(), **hp)
    state = algo.init(jax.random.key(0), data)
    step = jax.jit(algo.round_fn)
    factors, omega = to_np(state.factors), None
    for r in range(2):
        state, m = step(state, data, jax.random.key(r))
        thetas, _, omega, _ = reference_round(data, factors, omega, np.asarray(m["sampled"]).tolist(), hp)
        for key in ("w", "b"):                        # ω̃ = (1−β)⟦A_t⟧ + β Σ p_k ⟦A_k⟧ exactly
            np.testing.assert_allclose(state.omega[key], omega[key], rtol=1e-9, atol=1e-11)
            np.testing.assert_allclose(state.theta[key][1], thetas[1][key], rtol=1e-9, atol=1e-11)
        factors = to_np(state.factors)                # the ALS fit, warm-started at A_t
        err = np.linalg.norm(omega["w"] - recon(factors)["w"]) / np.linalg.norm(omega["w"])
        np.testing.assert_allclose(m["act_fit_error_max"], err, rtol=1e-6)
        # Rank 2 cannot fit a generic 5×3 matrix: the best rank-2 error is its third singular value.
        s = np.linalg.svd(omega["w"], compute_uv=False)
        assert err >= s[2] / np.linalg.norm(s) - 1e-9 and err < 1.05 * s[2] / np.linalg.norm(s)
        np.testing.assert_array_equal(state.factors["b"], state.omega["b"])


@pytest.mark.slow
def test_identity_parameterisation_with_one_gd_factor_step_is_pfedme(ragged_data):
    """T23: CR ×1, s' = 1 plain GD step of lr η: w ← w − ηλ(w − θ̃), pFedMe."""
    shared = dict(lam=5.0, personal_lr=0.05, personal_steps=3, beta=1.3, lr=0.03, momentum=0.0,
                  participation=0.5, batch_size=4, local_steps=3)
    td = algorithms.get("tdpfed", model=linear_model(), cr=1.0, factor_opt="gd", factor_steps=1,
                        **shared)
    me = algorithms.get("pfedme", model=linear_model(), **shared)
    s_td, s_me = td.init(jax.random.key(0), ragged_data), me.init(jax.random.key(0), ragged_data)
    for r in range(3):
        s_td, m_td = jax.jit(td.round_fn)(s_td, ragged_data, jax.random.key(r))
        s_me, m_me = jax.jit(me.round_fn)(s_me, ragged_data, jax.random.key(r))
        np.testing.assert_array_equal(m_td["sampled"], m_me["sampled"])
        tree_allclose(s_td.theta, s_me.theta, rtol=1e-5, atol=1e-6)
        tree_allclose(s_td.factors, s_me.params, rtol=1e-5, atol=1e-6)
    ev_td, ev_me = td.evaluate(s_td, ragged_data), me.evaluate(s_me, ragged_data)
    np.testing.assert_array_equal(ev_td["client"].correct, ev_me["client"].correct)


@pytest.mark.slow
def test_pfedme_round_matches_the_numpy_transcription(x64):
    hp = dict(lam=4.0, personal_lr=0.1, personal_steps=3, beta=1.5, lr=0.05, momentum=0.0,
              participation=0.67, **COMMON)
    data = toy()
    algo = algorithms.get("pfedme", model=linear_model(), **hp)
    state = algo.init(jax.random.key(0), data)
    w = {k: np.asarray(v, np.float64) for k, v in state.params.items()}
    for r in range(2):
        state, m = jax.jit(algo.round_fn)(state, data, jax.random.key(r))
        sampled = np.asarray(m["sampled"]).tolist()
        thetas, locals_ = [], []
        for k in range(3):
            x, y = client_arrays(data, k)
            theta, local = {a: b.copy() for a, b in w.items()}, {a: b.copy() for a, b in w.items()}
            for _ in range(hp["local_steps"]):
                for _ in range(hp["personal_steps"]):
                    _, g = ce_grad(theta, x, y)
                    theta = {a: theta[a] - hp["personal_lr"] * (g[a] + hp["lam"] * (theta[a] - local[a]))
                             for a in theta}
                local = {a: local[a] - hp["lr"] * hp["lam"] * (local[a] - theta[a]) for a in local}
            thetas.append(theta), locals_.append(local)
        n = np.array([SIZES[k] for k in sampled], float)
        w = {a: (1 - hp["beta"]) * w[a] + hp["beta"] * sum(nk / n.sum() * locals_[k][a]
                                                           for nk, k in zip(n, sampled)) for a in w}
        for a in w:
            np.testing.assert_allclose(state.params[a], w[a], rtol=1e-9, atol=1e-11)
            np.testing.assert_allclose(state.theta[a][2], thetas[2][a], rtol=1e-9, atol=1e-11)


@pytest.mark.slow
def test_beta_zero_keeps_the_global_factors():
    algo = algorithms.get("tdpfed", model=linear_model(), cr=1.2, beta=0.0, **COMMON)
    data = toy()
    state = algo.init(jax.random.key(0), data)
    new, _ = jax.jit(algo.round_fn)(state, data, jax.random.key(1))
    for a, b in zip(jax.tree.leaves(new.factors), jax.tree.leaves(state.factors)):
        np.testing.assert_array_equal(a, b)
    assert not np.allclose(new.theta["w"], state.theta["w"])      # clients did train


@pytest.mark.slow
@pytest.mark.parametrize("name,hp", [      # the loop backend runs eagerly: ~20 s of CPU each
    ("tdpfed", {"cr": 1.2}),
    pytest.param("tdpfed", {"cr": 1.2, "aggregate": "act", "factor_update": "cyclic"},
                 marks=pytest.mark.slow),
    pytest.param("pfedme", {}, marks=pytest.mark.slow),
    pytest.param("fedavg_sar", {"mask_fill": "keep"}, marks=pytest.mark.slow),
])
def test_vectorised_backends_equal_the_loop_backend(ragged_data, name, hp):
    states = states_per_backend(name, ragged_data, model=linear_model(), rounds=2, batch_size=4,
                                local_steps=3, participation=0.5, chunk_size=2, **hp)
    for backend in ("vmap", "chunked"):
        tree_allclose(states[backend], states["loop"], rtol=2e-5, atol=1e-6)


@pytest.mark.slow
def test_communication_counts_of_the_mnist_dnn_at_cr2():
    """T31: 39,556 floats per client per direction at ×2 (weights + biases), the
    dense downlink adds 79,510; S clients upload, all K download."""
    data = make_data([3, 4], feature_dim=784, num_classes=10)
    model = models.get("mlp", (784,), 10)
    algo = algorithms.get("tdpfed", model=model, participation=0.5, local_steps=1,
                          personal_steps=1, factor_steps=1, batch_size=4)
    state = algo.init(jax.random.key(0), data)
    _, m = jax.jit(algo.round_fn)(state, data, jax.random.key(0))
    assert float(m["comm_up_floats"]) == 1 * 39_556
    assert float(m["comm_down_floats"]) == 2 * 39_556
    assert float(m["comm_down_floats_factors_only"]) == 2 * 39_556
    assert float(m["comm_down_floats_with_tensor"]) == 2 * (39_556 + 79_510)
    act = algorithms.get("tdpfed", model=model, participation=0.5, local_steps=1, personal_steps=1,
                         factor_steps=1, batch_size=4, aggregate="act", als_iters=1)
    _, m = jax.jit(act.round_fn)(act.init(jax.random.key(0), data), data, jax.random.key(0))
    assert float(m["comm_down_floats"]) == 2 * (39_556 + 79_510)   # ACT needs the dense ω̃
    me = algorithms.get("pfedme", model=model, participation=0.5, local_steps=1, batch_size=4)
    _, m = jax.jit(me.round_fn)(me.init(jax.random.key(0), data), data, jax.random.key(0))
    assert float(m["comm_up_floats"]) == 79_510 and float(m["comm_down_floats"]) == 2 * 79_510


@pytest.mark.slow
def test_round_fn_compiles_once(ragged_data):
    import chex

    algo = algorithms.get("tdpfed", model=linear_model(), cr=1.2, batch_size=4, local_steps=2)
    step = jax.jit(chex.assert_max_traces(algo.round_fn, n=1))
    state = algo.init(jax.random.key(0), ragged_data)
    for r in range(3):
        state, _ = step(state, ragged_data, jax.random.key(r))


@pytest.mark.slow
def test_evaluates_personalised_thetas_and_the_global_cp_model(ragged_data):
    """"client" is each θ_k (row k on client k), "global" is ⟦A⟧: checked on the test losses,
    which differ between the two (a weak pull λ lets θ_k leave ⟦A⟧)."""
    algo = algorithms.get("tdpfed", model=linear_model(), cr=1.2, batch_size=4, local_steps=4,
                          lam=0.1, personal_lr=0.3)
    state = algo.init(jax.random.key(0), ragged_data)
    state, _ = jax.jit(algo.round_fn)(state, ragged_data, jax.random.key(0))
    evals = algo.evaluate(state, ragged_data)
    model = linear_model()
    n = ragged_data.num_clients
    global_params = cp.reconstruct(state.factors)
    for k in range(n):
        rows = ragged_data.client_rows(k, "test")
        x, y = ragged_data.inputs(rows), ragged_data.labels(rows)
        own = jax.tree.map(lambda a: a[k], state.theta)
        personal_loss = float(jnp.sum(model.loss(model.apply(own, x), y)))
        global_loss = float(jnp.sum(model.loss(model.apply(global_params, x), y)))
        np.testing.assert_allclose(evals["client"].loss_sum[k], personal_loss, rtol=1e-5)
        np.testing.assert_allclose(evals["global"].loss_sum[k], global_loss, rtol=1e-5)
        assert abs(personal_loss - global_loss) > 1e-3 * abs(global_loss)


# ---------------------------------------------------------------------------------------------
# FedAvg (s.a.r.)


def test_sar_masks():
    from fedjax_pfl.algorithms.fedavg_sar import random_mask

    like = {"a": jnp.zeros((40, 25)), "b": jnp.zeros(7)}
    fixed = random_mask(jax.random.key(0), like, 3.0, "fixed")
    assert int(sum(jnp.sum(m) for m in jax.tree.leaves(fixed))) == round(1007 / 3)
    counts = [float(sum(jnp.sum(m) for m in jax.tree.leaves(random_mask(jax.random.key(i), like, 2.0, "bernoulli"))))
              for i in range(20)]
    assert abs(np.mean(counts) / 1007 - 0.5) < 0.01      # 20·1007 draws: sd of the mean 0.0035
    a = random_mask(jax.random.key(1), like, 2.0, "bernoulli")
    b = random_mask(jax.random.key(2), like, 2.0, "bernoulli")
    assert not np.array_equal(a["a"], b["a"])              # a fresh mask per transmission


@pytest.mark.slow
def test_sar_with_cr_one_is_fedavg(ragged_data):
    hp = dict(model=linear_model(), participation=0.5, batch_size=4, lr=0.1)
    sar = algorithms.get("fedavg_sar", cr=1.0, **hp)
    avg = algorithms.get("fedavg", **hp)
    s1, s2 = sar.init(jax.random.key(0), ragged_data), avg.init(jax.random.key(0), ragged_data)
    for r in range(2):
        s1, m1 = jax.jit(sar.round_fn)(s1, ragged_data, jax.random.key(r))
        s2, m2 = jax.jit(avg.round_fn)(s2, ragged_data, jax.random.key(r))
    tree_allclose(s1.params, s2.params, rtol=1e-6, atol=1e-7)
    assert float(m1["comm_up_floats"]) == 2 * 5 * 3 + 2 * 3      # M = 2 clients × d = 18


@pytest.mark.slow
@pytest.mark.parametrize("fill", ["zero", "keep"])
def test_sar_unsent_coordinates_arrive_as_zero_or_the_old_value(ragged_data, fill):
    """With CR huge nothing is sent: zero-fill makes the server's model 0, keep-fill leaves it."""
    algo = algorithms.get("fedavg_sar", model=linear_model(), cr=1e9, mask_fill=fill,
                          participation=0.5, batch_size=4)
    state = algo.init(jax.random.key(0), ragged_data)
    new, m = jax.jit(algo.round_fn)(state, ragged_data, jax.random.key(1))
    if fill == "zero":
        tree_allclose(new.params, jax.tree.map(jnp.zeros_like, state.params), rtol=0, atol=0)
    else:  # the weighted mean of identical copies, up to float rounding of the weights
        tree_allclose(new.params, state.params, rtol=1e-6, atol=0)
    assert float(m["comm_up_floats"]) == 0 and float(m["comm_down_floats"]) == 0
    if fill == "keep":   # the clients trained from their own old model and keep the result
        sampled = np.asarray(m["sampled"])
        assert not np.allclose(new.client_params["w"][sampled[0]], state.params["w"])
