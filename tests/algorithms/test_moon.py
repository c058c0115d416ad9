"""MOON (Li, He & Song, CVPR 2021): the local loss ℓ_sup + μ ℓ_con and its gradient against a direct
float64 NumPy computation (cosines, τ, μ, the two-way log-softmax, a padded example); one round
with μ = 0 (FedAvg) and with μ > 0 against NumPy gradient descent on the same loss, including the
previous-model rows (sampled clients' rows = their trained models, unsampled unchanged); the
chunked backend equals the loop backend; a model without a representation is refused; and
`Model.features` (the input of the head) on the MLP, the FedAvg CNN, ResNet9 and the CharLSTM
against hand computations of the layer before the head."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_states_close, linear_model, states_per_backend

from fedjax_pfl import algorithms, models
from fedjax_pfl.algorithms import moon as moon_lib
from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.data.natural import Task
from fedjax_pfl.models import nets, sequence, tasks

F, H, C = 5, 4, 3                       # the tiny MLP: F → Dense H → ReLU → Dense C (the head)
MLP = models.from_flax(nets.MLP(C, (H,)), (F,))
EPS = 1e-8


# ------------------------------------------------------------------------- NumPy reference (f64)

def np_forward(p, x):
    """(z, logits) of the MLP: z = relu(x W0 + b0) is the head's input, logits = z W1 + b1."""
    z = np.maximum(x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"], 0.0)
    return z, z @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]


def np_cos(a, b):
    na = np.maximum(np.linalg.norm(a, axis=-1), EPS)
    nb = np.maximum(np.linalg.norm(b, axis=-1), EPS)
    return np.sum(a * b, axis=-1) / (na * nb)


def np_logsumexp(v):
    top = v.max(axis=-1, keepdims=True)
    return (top + np.log(np.sum(np.exp(v - top), axis=-1, keepdims=True)))[..., 0]


def np_moon_loss(p, p_glob, p_prev, x, y, mask, mu, tau):
    """(ℓ_sup + μ ℓ_con, ℓ_con), both means over the examples with mask True (eqs. 2–3)."""
    z, logits = np_forward(p, x)
    z_glob, _ = np_forward(p_glob, x)
    z_prev, _ = np_forward(p_prev, x)
    ce = np_logsumexp(logits) - logits[np.arange(len(y)), y]
    pair = np.stack([np_cos(z, z_glob), np_cos(z, z_prev)], axis=-1) / tau
    con = np_logsumexp(pair) - pair[:, 0]            # −log(e^{s_g/τ} / (e^{s_g/τ} + e^{s_p/τ}))
    real = mask.astype(bool)
    return ce[real].mean() + mu * con[real].mean(), con[real].mean()


def to_vec(p):
    return np.concatenate([np.ravel(p[m][k]) for m in ("Dense_0", "Dense_1") for k in ("kernel", "bias")])


def from_vec(v):
    shapes = {"Dense_0": {"kernel": (F, H), "bias": (H,)}, "Dense_1": {"kernel": (H, C), "bias": (C,)}}
    out, i = {}, 0
    for m in ("Dense_0", "Dense_1"):
        out[m] = {}
        for k in ("kernel", "bias"):
            size = int(np.prod(shapes[m][k]))
            out[m][k] = v[i:i + size].reshape(shapes[m][k])
            i += size
    return out


def np_grad(p, p_glob, p_prev, x, y, mask, mu, tau, h=1e-6):
    """Central finite differences of `np_moon_loss` in w (float64); the frozen models fixed."""
    v = to_vec(p)
    g = np.zeros_like(v)
    for k in range(v.size):
        e = np.zeros_like(v)
        e[k] = h
        plus = np_moon_loss(from_vec(v + e), p_glob, p_prev, x, y, mask, mu, tau)[0]
        minus = np_moon_loss(from_vec(v - e), p_glob, p_prev, x, y, mask, mu, tau)[0]
        g[k] = (plus - minus) / (2 * h)
    return from_vec(g)


def random_params(seed):
    rng = np.random.default_rng(seed)
    return from_vec(rng.normal(scale=0.7, size=F * H + H + H * C + C))


def as_np(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


# ------------------------------------------------------------------------------------- the loss

@pytest.mark.slow
def test_loss_and_gradient_against_numpy(x64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, F))
    y = np.array([0, 2, 1, 2])
    mask = np.array([True, True, True, False])          # the last example is padding
    x[3] *= 50.0                                        # a padded example that would dominate
    p, p_glob, p_prev = random_params(1), random_params(2), random_params(3)
    mu, tau = 0.7, 0.3
    loss, con = moon_lib.moon_loss(MLP, p, p_glob, p_prev, jnp.asarray(x), jnp.asarray(y),
                                   jnp.asarray(mask), mu=mu, tau=tau)
    want_loss, want_con = np_moon_loss(p, p_glob, p_prev, x, y, mask, mu, tau)
    np.testing.assert_allclose(float(con), want_con, rtol=1e-10)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-10)
    grad = jax.grad(lambda w: moon_lib.moon_loss(MLP, w, p_glob, p_prev, jnp.asarray(x),
                                                 jnp.asarray(y), jnp.asarray(mask),
                                                 mu=mu, tau=tau)[0])(p)
    want = np_grad(p, p_glob, p_prev, x, y, mask, mu, tau)
    np.testing.assert_allclose(to_vec(as_np(grad)), to_vec(want), rtol=1e-6, atol=1e-8)


def test_contrastive_term_hand_case():
    # z = [1, 0], z_glob = [1, 0] (cos 1), z_prev = [0, 2] (cos 0), τ = 0.5:
    # ℓ = −log(e² / (e² + e⁰)) = log(1 + e⁻²).
    got = moon_lib.contrastive_loss(jnp.array([1.0, 0.0]), jnp.array([1.0, 0.0]),
                                    jnp.array([0.0, 2.0]), 0.5)
    np.testing.assert_allclose(float(got), np.log1p(np.exp(-2.0)), rtol=1e-6)


@pytest.mark.slow
def test_per_token_representation_averages_over_real_target_tokens(x64):
    # z [B, T, H] with sequence labels y [B, T] (0 = PAD): eq. 2 at every position, each example
    # summing its real targets, and the batch's mean over all real tokens of real examples.
    rng = np.random.default_rng(5)
    b, t, hid, v = 3, 4, 3, 6
    y = np.array([[1, 2, 0, 0], [3, 1, 4, 5], [2, 2, 2, 0]])
    mask = np.array([True, True, False])                  # the third example is padding
    task = Task(kind="sequence", inputs="tokens", num_classes=v, vocab_size=v)
    pieces = tasks.for_task(task)
    # A hand model on float inputs x [B, T, hid]: z = x·A (per token), logits = z·W.
    model = models.Model(init=None, apply=lambda p, x: (x @ p["a"]) @ p["w"],
                         features=lambda p, x: x @ p["a"], loss=pieces["loss"],
                         weight=pieces["weight"], metric=pieces["metric"])
    x = rng.normal(size=(b, t, hid))
    p, p_glob, p_prev = ({"a": rng.normal(size=(hid, hid)), "w": rng.normal(size=(hid, v))}
                         for _ in range(3))
    mu, tau = 0.6, 0.4
    loss, con = moon_lib.moon_loss(model, p, p_glob, p_prev, jnp.asarray(x), jnp.asarray(y),
                                   jnp.asarray(mask), mu=mu, tau=tau)
    z, zg, zp = x @ p["a"], x @ p_glob["a"], x @ p_prev["a"]
    pair = np.stack([np_cos(z, zg), np_cos(z, zp)], axis=-1) / tau
    per_token = np_logsumexp(pair) - pair[..., 0]                      # [B, T]
    logits = z @ p["w"]
    ce = np_logsumexp(logits) - np.take_along_axis(logits, y[..., None], -1)[..., 0]
    real = (y != 0) & mask[:, None]                                     # 6 real tokens
    np.testing.assert_allclose(float(con), per_token[real].mean(), rtol=1e-10)
    np.testing.assert_allclose(float(loss), ce[real].mean() + mu * per_token[real].mean(),
                               rtol=1e-10)


# ------------------------------------------------------------------------------ one whole round

SIZES = [3, 5, 2, 4]


def round_data():
    rng = np.random.default_rng(4)
    n = sum(SIZES) + len(SIZES)
    x, y = rng.normal(size=(n, F)), rng.integers(0, C, n)
    train, test, start = [], [], 0
    for s in SIZES:
        train.append(np.arange(start, start + s))
        test.append(np.array([start + s]))
        start += s + 1
    return FederatedData.from_arrays(x, y, train, test, num_classes=C), x, y, train


@pytest.mark.parametrize("mu", [pytest.param(0.0, marks=pytest.mark.slow), 1.5], ids=["mu0_fedavg", "mu1.5"])
@pytest.mark.slow
def test_one_round_against_numpy_gradient_descent(x64, mu):
    # Batch 8 ≥ every n_i: each local step is full-batch gradient descent on the client's padded
    # batch (order irrelevant), 2 epochs = 2 steps. μ = 0 is FedAvg's round by hand: w_i after two
    # plain cross-entropy steps, then Σ (n_i/Σn) w_i. The previous models are set to distinct
    # random models so that z_prev ≠ z_glob.
    data, x, y, train = round_data()
    lr, tau = 0.4, 0.3
    algo = algorithms.get("moon", model=MLP, participation=0.5, batch_size=8, local_epochs=2,
                          lr=lr, mu=mu, tau=tau, backend="loop")
    state = algo.init(jax.random.key(0), data)
    w0 = random_params(10)
    prev = [random_params(20 + i) for i in range(len(SIZES))]
    stacked_prev = jax.tree.map(lambda *rows: jnp.asarray(np.stack(rows)), *prev)
    state = state._replace(params=jax.tree.map(jnp.asarray, w0), prev=stacked_prev)
    new, metrics = algo.round_fn(state, data, jax.random.key(7))
    sampled = [int(i) for i in np.asarray(metrics["sampled"])]
    assert len(sampled) == 2

    trained, cons = {}, []
    for i in sampled:
        xi = np.zeros((8, F))
        yi = np.zeros(8, int)
        xi[:SIZES[i]], yi[:SIZES[i]] = x[train[i]], y[train[i]]
        mask = np.arange(8) < SIZES[i]
        w = w0
        for _ in range(2):
            cons.append(np_moon_loss(w, w0, prev[i], xi, yi, mask, mu, tau)[1])
            g = np_grad(w, w0, prev[i], xi, yi, mask, mu, tau)
            w = jax.tree.map(lambda a, b: a - lr * b, w, g)
        trained[i] = w
    n = np.array([SIZES[i] for i in sampled], float)
    want = jax.tree.map(lambda *ws: sum(k * wk for k, wk in zip(n / n.sum(), ws)),
                        *[trained[i] for i in sampled])
    np.testing.assert_allclose(to_vec(as_np(new.params)), to_vec(want), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(float(metrics["contrastive_loss"]), np.mean(cons), rtol=1e-6)
    # Previous-model rows: sampled clients' rows are their trained models, the others unchanged.
    for i in range(len(SIZES)):
        row = jax.tree.map(lambda a: np.asarray(a[i], np.float64), new.prev)
        expected = trained[i] if i in sampled else prev[i]
        np.testing.assert_allclose(to_vec(row), to_vec(expected), rtol=1e-6, atol=1e-8,
                                   err_msg=f"client {i}")


@pytest.mark.slow
def test_first_round_previous_models_are_the_initial_model():
    # Before a client first trains, w_i^prev = w⁰ (docs/algorithms/moon.md M3): then z_glob = z_prev
    # in round 0, so ℓ_con = log 2 whatever the local model.
    data, *_ = round_data()
    algo = algorithms.get("moon", model=MLP, participation=0.5, batch_size=2)
    state = algo.init(jax.random.key(0), data)
    for leaf, row in zip(jax.tree.leaves(state.params), jax.tree.leaves(state.prev)):
        np.testing.assert_array_equal(np.asarray(row), np.broadcast_to(leaf, row.shape))
    _, metrics = jax.jit(algo.round_fn)(state, data, jax.random.key(1))
    np.testing.assert_allclose(float(metrics["contrastive_loss"]), np.log(2.0), rtol=1e-6)


@pytest.mark.slow      # the loop backend runs rounds eagerly (a consistency check)
def test_chunked_backend_equals_loop():
    data, *_ = round_data()
    states = states_per_backend("moon", data, rounds=2, backends=("loop", "chunked"), model=MLP,
                                participation=0.5, batch_size=2, chunk_size=1, momentum=0.9,
                                momentum_buffer="persist", mu=2.0)
    assert_states_close(states["chunked"], states["loop"])


def test_a_model_without_features_is_refused():
    with pytest.raises(ValueError, match="representation"):
        algorithms.get("moon", model=linear_model()._replace(features=None))


def test_flags_in_help():
    flags = {flag for _, flag in algorithms.spec("moon").all_hparams()}
    assert {"--moon-mu", "--moon-tau"} <= flags
    with pytest.raises(ValueError, match="--moon-tau"):
        algorithms.get("moon", model=MLP, tau=0.0)


# ------------------------------------------------------------------- Model.features (head input)

def _head(params):
    return np.asarray(params["Dense_1" if "Dense_1" in params else "Dense_0"]["kernel"]), \
        np.asarray(params["Dense_1" if "Dense_1" in params else "Dense_0"]["bias"])


def _run(model, module, params, x, *names):
    """(features, outputs, *the outputs of submodules `names`) from one compiled program; the
    last from flax's capture_intermediates (not the interceptor behind `features`)."""
    def run(p, x):
        inter = ()
        if names:
            _, state = module.apply({"params": p}, x, capture_intermediates=True,
                                    mutable=["intermediates"])
            inter = tuple(state["intermediates"][n]["__call__"][0] for n in names)
        return (model.features(p, x), model.apply(p, x), *inter)
    return jax.tree.map(np.asarray, jax.jit(run)(params, x))


def _check_head_input(params, z, outputs, z_hand):
    np.testing.assert_allclose(z, z_hand, rtol=1e-5, atol=1e-6)
    kernel, bias = _head(params)          # and the head applied to z is the model's output
    np.testing.assert_allclose(outputs, z @ kernel + bias, rtol=1e-4, atol=1e-5)


def test_features_of_the_mlp_is_its_hidden_layer():
    x = np.random.default_rng(0).normal(size=(3, 2, 3)).astype(np.float32)   # flattened to 6
    model = models.get("mlp", (2, 3), 4, hidden=(5,))
    p = jax.jit(model.init)(jax.random.key(0))      # (one compiled init, not op by op)
    w, b = np.asarray(p["Dense_0"]["kernel"]), np.asarray(p["Dense_0"]["bias"])
    z, out = _run(model, None, p, x)
    _check_head_input(p, z, out, np.maximum(x.reshape(3, 6) @ w + b, 0.0))


@pytest.mark.slow     # (the MLP's features: quick)
def test_features_of_the_fedavg_cnn_is_its_dense_512_layer():
    x = np.random.default_rng(1).normal(size=(2, 16, 16, 1)).astype(np.float32)
    model = models.get("cnn", (16, 16, 1), 10)
    p = jax.jit(model.init)(jax.random.key(0))      # (one compiled init, not op by op)
    z, out, hidden = _run(model, nets.FedAvgCNN(10), p, x, "Dense_0")   # Dense 512, pre-ReLU
    assert hidden.shape == (2, 512)
    _check_head_input(p, z, out, np.maximum(hidden, 0.0))


@pytest.mark.slow     # (the MLP's features: quick)
def test_features_of_resnet9_is_its_global_max_pool():
    x = np.random.default_rng(2).normal(size=(2, 16, 16, 3)).astype(np.float32)
    model = models.get("resnet9", (16, 16, 3), 5, width=2, conv="im2col")
    p = jax.jit(model.init)(jax.random.key(0))      # (one compiled init, not op by op)
    # The last stage: u = pool(block₅(·)) [2, 2, 2, 16]; residual u + block₆(block₇(u)) (the
    # outer block is constructed, so named, first); then the global max over the 2 × 2 positions.
    module = nets.ResNet9(5, width=2, conv="im2col")
    z, out, out5, out6 = _run(model, module, p, x, "ConvNormReLU_5", "ConvNormReLU_6")
    u = out5.reshape(2, 2, 2, 2, 2, 16).max(axis=(2, 4))
    _check_head_input(p, z, out, (u + out6).max(axis=(1, 2)))


@pytest.mark.slow     # (the MLP's features: quick)
def test_features_of_the_char_lstm_is_its_last_lstm_output_per_token():
    task = Task(kind="sequence", inputs="tokens", num_classes=7, vocab_size=7)
    model = models.get("char_lstm", (5,), 7, task=task, options={"hidden": 6, "embed": 3})
    p = jax.jit(model.init)(jax.random.key(0))      # (one compiled init, not op by op)
    x = np.array([[1, 4, 2, 0, 0], [3, 3, 5, 6, 1]], np.int32)
    z, out, h = _run(model, sequence.CharLSTM(7, 7, embed=3, hidden=6), p, x, "LSTM_1")
    assert h.shape == (2, 5, 6)                                  # [B, T, H]: every position
    _check_head_input(p, z, out, h)
