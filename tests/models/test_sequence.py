"""Sequence models (models/sequence.py, nets.FemnistCNN): the LSTM cell and layer against a plain
NumPy float64 LSTM, published parameter counts, padding invariance of models + losses, causality,
the bag of words against NumPy, split-model heads, and `get`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfl.data.natural import Task
from fedjax_pfl.models import nets, sequence, tasks
from fedjax_pfl.models.split import head_pattern, leaf_paths, personal_mask
from fedjax_pfl.ops import tree_size

# ---------------------------------------------------------------- NumPy float64 reference LSTM


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def _np_gates(params):
    """Per-gate (W, U, b) from the documented [i | f | g | o] layout."""
    h = params["kernel_rec"].shape[0]
    cut = lambda a, k: np.asarray(a, np.float64)[..., k * h : (k + 1) * h]
    return {name: tuple(cut(params[p], k) for p in ("kernel_in", "kernel_rec", "bias"))
            for k, name in enumerate("ifgo")}


def _np_cell(gates, c, h, x):
    pre = {n: x @ w + h @ u + b for n, (w, u, b) in gates.items()}
    i, f, g, o = _sigmoid(pre["i"]), _sigmoid(pre["f"]), np.tanh(pre["g"]), _sigmoid(pre["o"])
    c = f * c + i * g
    return c, o * np.tanh(c)


def _np_lstm(params, x, mask=None):
    """x [B, T, D] -> [B, T, H], zero initial state; a masked step keeps the state."""
    gates = _np_gates(params)
    b, t, _ = x.shape
    hdim = params["kernel_rec"].shape[0]
    out = np.zeros((b, t, hdim))
    for n in range(b):
        c = np.zeros(hdim)
        h = np.zeros(hdim)
        for s in range(t):
            if mask is None or mask[n, s]:
                c, h = _np_cell(gates, c, h, np.asarray(x[n, s], np.float64))
            out[n, s] = h
    return out


def _random_lstm_params(rng, d, h):
    return {"kernel_in": rng.normal(size=(d, 4 * h)) * 0.5,
            "kernel_rec": rng.normal(size=(h, 4 * h)) * 0.5,
            "bias": rng.normal(size=(4 * h,)) * 0.5}


def test_lstm_cell_equals_numpy_float64(x64):
    rng = np.random.default_rng(0)
    p = _random_lstm_params(rng, 3, 5)
    x, c, h = rng.normal(size=(2, 3)), rng.normal(size=(2, 5)), rng.normal(size=(2, 5))
    (got_c, got_h), out = sequence.LSTMCell(5).apply({"params": p}, (c, h), x)
    want_c, want_h = _np_cell(_np_gates(p), c, h, x)
    np.testing.assert_allclose(got_c, want_c, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(got_h, want_h, rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(out, got_h)


@pytest.mark.parametrize("masked", [False, True])
def test_lstm_layer_equals_numpy_float64(x64, masked):
    rng = np.random.default_rng(1)
    p = _random_lstm_params(rng, 3, 4)
    x = rng.normal(size=(3, 6, 3))
    mask = rng.random((3, 6)) < 0.6 if masked else None
    got = sequence.LSTM(4).apply({"params": p}, jnp.asarray(x),
                                 None if mask is None else jnp.asarray(mask))
    np.testing.assert_allclose(got, _np_lstm(p, x, mask), rtol=1e-12, atol=1e-13)


@pytest.mark.slow
def test_lstm_layer_gradient_equals_central_differences(x64):
    """Reverse mode through the scan and the input-projection matmul's custom VJP."""
    rng = np.random.default_rng(2)
    p = _random_lstm_params(rng, 2, 3)
    x = rng.normal(size=(2, 4, 2))
    w = rng.normal(size=(2, 4, 3))
    f = lambda q: jnp.sum(w * sequence.LSTM(3).apply({"params": q}, jnp.asarray(x)))
    grad = jax.grad(f)(jax.tree.map(jnp.asarray, p))
    fn = lambda q: float(np.sum(w * _np_lstm(q, x)))
    eps = 1e-6
    for name in ("kernel_in", "kernel_rec", "bias"):
        for idx in [(0,) * p[name].ndim, tuple(s - 1 for s in p[name].shape)]:
            up = {k: v.copy() for k, v in p.items()}
            dn = {k: v.copy() for k, v in p.items()}
            up[name][idx] += eps
            dn[name][idx] -= eps
            np.testing.assert_allclose(grad[name][idx], (fn(up) - fn(dn)) / (2 * eps),
                                       rtol=1e-6, atol=1e-8)


def _lstm_problem(seed, masked, d=2, h=3, b=2, t=5):
    """Random float64 LSTM parameters, inputs x [B, T, D], output weights w [B, T, H], a mask
    (a leading, an inner and a trailing masked step when `masked`) and the objective
    f(params, x) = Σ w ⊙ tanh(LSTM(x)) evaluated by the NumPy reference (tanh so that the
    second derivative has terms from outside the layer too)."""
    rng = np.random.default_rng(seed)
    p = _random_lstm_params(rng, d, h)
    x = rng.normal(size=(b, t, d))
    w = rng.normal(size=(b, t, h))
    mask = None
    if masked:
        mask = np.ones((b, t), bool)
        mask[0, 0] = mask[0, 2] = mask[1, t - 1] = mask[1, t - 2] = False
    np_f = lambda q, z: float(np.sum(w * np.tanh(_np_lstm(q, z, mask))))

    def jax_f(q, z):
        out = sequence.LSTM(h).apply({"params": q}, z, None if mask is None else jnp.asarray(mask))
        return jnp.sum(w * jnp.tanh(out))

    return rng, p, x, np_f, jax_f


def _direction(rng, p, x):
    return ({k: rng.normal(size=v.shape) for k, v in p.items()}, rng.normal(size=x.shape))


def _moved(p, x, dirs, steps):
    """(p, x) + Σ s·(dp, dx) over (s, (dp, dx)) in zip(steps, dirs)."""
    q = {k: v + sum(s * d[0][k] for s, d in zip(steps, dirs)) for k, v in p.items()}
    return q, x + sum(s * d[1] for s, d in zip(steps, dirs))


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.slow
def test_lstm_layer_gradient_of_every_parameter_equals_central_differences(x64, masked):
    """Reverse mode (the transpose of `lstm_recurrence`'s hand-written tangent, the recurrent
    kernel's gradient as one matmul after the scan) against central differences of the NumPy
    float64 LSTM, for every entry of every parameter and of the input, padding included."""
    _, p, x, np_f, jax_f = _lstm_problem(10, masked)
    gp, gx = jax.grad(jax_f, (0, 1))(jax.tree.map(jnp.asarray, p), jnp.asarray(x))
    eps = 1e-6
    for name in ("kernel_in", "kernel_rec", "bias"):
        want = np.zeros_like(p[name])
        for idx in np.ndindex(p[name].shape):
            up = {k: v.copy() for k, v in p.items()}
            dn = {k: v.copy() for k, v in p.items()}
            up[name][idx] += eps
            dn[name][idx] -= eps
            want[idx] = (np_f(up, x) - np_f(dn, x)) / (2 * eps)
        np.testing.assert_allclose(gp[name], want, rtol=1e-6, atol=1e-8, err_msg=name)
    want_x = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        up, dn = x.copy(), x.copy()
        up[idx] += eps
        dn[idx] -= eps
        want_x[idx] = (np_f(p, up) - np_f(p, dn)) / (2 * eps)
    np.testing.assert_allclose(gx, want_x, rtol=1e-6, atol=1e-8)
    if masked:      # a masked input step has no influence at all
        assert not np.any(np.asarray(gx)[0, 0]) and not np.any(np.asarray(gx)[1, -1])


@pytest.mark.parametrize("masked", [False, True])
def test_lstm_layer_forward_mode_jvp_equals_directional_difference(x64, masked):
    """jax.jvp through the layer (the custom_jvp rule itself) along a random direction of every
    parameter and the input against the NumPy float64 central difference along it."""
    rng, p, x, np_f, jax_f = _lstm_problem(11, masked)
    for _ in range(2):
        d = _direction(rng, p, x)
        _, got = jax.jvp(jax_f, (jax.tree.map(jnp.asarray, p), jnp.asarray(x)),
                         (jax.tree.map(jnp.asarray, d[0]), jnp.asarray(d[1])))
        eps = 1e-6
        want = (np_f(*_moved(p, x, [d], [eps])) - np_f(*_moved(p, x, [d], [-eps]))) / (2 * eps)
        np.testing.assert_allclose(got, want, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.slow
def test_lstm_layer_hessian_vector_product_equals_second_differences(x64, masked):
    """jax.jvp of jax.grad (Per-FedAvg HF's Hessian-vector product, algorithms/perfedavg.py):
    for random directions u, v of (params, x), uᵀ ∇²f v against the NumPy float64 mixed second
    difference [f(+u+v) − f(+u−v) − f(−u+v) + f(−u−v)] / (4ε²)."""
    rng, p, x, np_f, jax_f = _lstm_problem(12, masked)
    v = _direction(rng, p, x)
    _, (hv_p, hv_x) = jax.jvp(jax.grad(jax_f, (0, 1)),
                              (jax.tree.map(jnp.asarray, p), jnp.asarray(x)),
                              (jax.tree.map(jnp.asarray, v[0]), jnp.asarray(v[1])))
    eps = 1e-4
    for _ in range(3):
        u = _direction(rng, p, x)
        got = sum(float(np.sum(u[0][k] * hv_p[k])) for k in p) + float(np.sum(u[1] * hv_x))
        want = sum(s * t * np_f(*_moved(p, x, [u, v], [s * eps, t * eps]))
                   for s in (1, -1) for t in (1, -1)) / (4 * eps * eps)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # ... and only through the recurrent kernel, the path the hand-written derivative changes.
    only_u = {k: np.zeros_like(a) for k, a in p.items()}
    only_u["kernel_rec"] = v[0]["kernel_rec"]
    _, (hv_p, _) = jax.jvp(jax.grad(jax_f, (0, 1)),
                           (jax.tree.map(jnp.asarray, p), jnp.asarray(x)),
                           (jax.tree.map(jnp.asarray, only_u), jnp.zeros_like(x)))
    u = {k: np.zeros_like(a) for k, a in p.items()}
    u["kernel_rec"] = rng.normal(size=p["kernel_rec"].shape)
    zero_x = np.zeros_like(x)
    got = float(np.sum(u["kernel_rec"] * hv_p["kernel_rec"]))
    want = sum(s * t * np_f(*_moved(p, x, [(u, zero_x), (only_u, zero_x)], [s * eps, t * eps]))
               for s in (1, -1) for t in (1, -1)) / (4 * eps * eps)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow     # (the LSTM layer's own Hessian-vector product: quick)
def test_char_lstm_loss_gradient_and_hessian_vector_product_equal_numpy_float64(x64):
    """The CharLSTM's masked next-character loss (tasks.sequence_cross_entropy, mean over real
    tokens, trailing PAD) through both LSTM layers: loss, the recurrent kernels' gradients and
    a Hessian-vector product against a NumPy float64 model written here (embedding → two
    `_np_lstm` layers → dense → cross-entropy) and its central / mixed second differences."""
    v = 6
    m = sequence.CharLSTM(v, v, embed=3, hidden=4)
    x = np.array([[1, 2, 3, 5, 4, 0], [4, 4, 1, 2, 0, 0]])
    y = np.array([[2, 3, 5, 4, 1, 0], [4, 1, 2, 3, 0, 0]])
    p = jax.jit(m.init)(jax.random.key(5), jnp.asarray(x))["params"]
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)

    def np_loss(q):
        h = q["Embed_0"]["embedding"][x]
        for layer in ("LSTM_0", "LSTM_1"):
            h = _np_lstm(q[layer], h, x != 0)
        z = h @ q["Dense_0"]["kernel"] + q["Dense_0"]["bias"]
        z = z - z.max(-1, keepdims=True)
        nll = np.log(np.exp(z).sum(-1)) - np.take_along_axis(z, y[..., None], -1)[..., 0]
        return float(np.sum(nll * (y != 0)) / np.sum(y != 0))

    def jax_loss(q):
        out = m.apply({"params": q}, jnp.asarray(x))
        return (tasks.sequence_cross_entropy(out, jnp.asarray(y)).sum()
                / tasks.token_weight(jnp.asarray(y)).sum())

    jp = jax.tree.map(jnp.asarray, p)
    np.testing.assert_allclose(jax_loss(jp), np_loss(p), rtol=1e-12)
    grad = jax.grad(jax_loss)(jp)
    rng = np.random.default_rng(6)
    vec = jax.tree.map(lambda a: rng.normal(size=a.shape), p)
    _, hv = jax.jvp(jax.grad(jax_loss), (jp,), (jax.tree.map(jnp.asarray, vec),))
    shift = lambda q, d, s: jax.tree.map(lambda a, b: a + s * b, q, d)
    eps = 1e-6
    for layer in ("LSTM_0", "LSTM_1"):
        for idx in [(0, 0), (3, 15), (1, 6)]:
            one = jax.tree.map(np.zeros_like, p)
            one[layer]["kernel_rec"][idx] = 1.0
            want = (np_loss(shift(p, one, eps)) - np_loss(shift(p, one, -eps))) / (2 * eps)
            np.testing.assert_allclose(grad[layer]["kernel_rec"][idx], want, rtol=1e-6,
                                       atol=1e-9)
    eps = 1e-4
    u = jax.tree.map(lambda a: rng.normal(size=a.shape), p)
    got = sum(float(np.sum(a * b)) for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(hv)))
    want = sum(s * t * np_loss(shift(shift(p, u, s * eps), vec, t * eps))
               for s in (1, -1) for t in (1, -1)) / (4 * eps * eps)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_lstm_layer_gradient_with_respect_to_the_input_only(x64):
    """The hand-written derivative when the recurrent kernel's tangent is symbolically zero (the
    parameters are constants, only the input is differentiated) against NumPy central
    differences."""
    _, p, x, np_f, jax_f = _lstm_problem(13, True)
    jp = jax.tree.map(jnp.asarray, p)
    gx = jax.grad(lambda z: jax_f(jp, z))(jnp.asarray(x))
    eps = 1e-6
    want = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        up, dn = x.copy(), x.copy()
        up[idx] += eps
        dn[idx] -= eps
        want[idx] = (np_f(p, up) - np_f(p, dn)) / (2 * eps)
    np.testing.assert_allclose(gx, want, rtol=1e-6, atol=1e-8)


def test_lstm_layer_vmapped_over_clients_equals_each_clients_numpy_lstm(x64):
    rng = np.random.default_rng(3)
    ps = [_random_lstm_params(rng, 2, 3) for _ in range(3)]
    xs = rng.normal(size=(3, 2, 5, 2))
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *ps)
    got = jax.vmap(lambda q, x: sequence.LSTM(3).apply({"params": q}, x))(stacked, jnp.asarray(xs))
    for k in range(3):
        np.testing.assert_allclose(got[k], _np_lstm(ps[k], xs[k]), rtol=1e-12, atol=1e-13)


def test_lstm_init_forget_bias_one_rest_zero():
    p = jax.jit(sequence.LSTM(4).init)(jax.random.key(0), jnp.zeros((1, 2, 3)))["params"]
    np.testing.assert_array_equal(p["bias"], [0] * 4 + [1] * 4 + [0] * 8)    # [i | f | g | o]
    assert p["kernel_in"].shape == (3, 16) and p["kernel_rec"].shape == (4, 16)


# ---------------------------------------------------------------- published parameter counts

def _count(name, task, shape, **options):
    pieces = sequence.get(name, task, shape, **options)
    return tree_size(jax.eval_shape(pieces["init"], jax.random.key(0)))


def _lstm_count(d, h):
    return 4 * h * (d + h) + 4 * h       # W [D, 4H], U [H, 4H], one bias [4H]


def test_char_lstm_parameter_count_is_fedjax_shakespeare():
    v = 90      # FedJAX's 86 characters + PAD, BOS, EOS, OOV
    by_hand = v * 8 + _lstm_count(8, 256) + _lstm_count(256, 256) + (256 * v + v)
    assert by_hand == 820_522                     # fedjax/models/shakespeare_test.py
    assert _count("char_lstm", Task("sequence", v, "tokens", v), (80,)) == by_hand


def test_word_lstm_parameter_count_is_tff_stackoverflow_nwp():
    v = 10_004  # 10,000 words + PAD, BOS, EOS, OOV
    by_hand = v * 96 + _lstm_count(96, 670) + (670 * 96 + 96) + (96 * v + v)
    assert by_hand == 4_050_748                   # fedjax/models/stackoverflow_test.py
    assert _count("word_lstm", Task("sequence", v, "tokens", v), (20,)) == by_hand


def test_femnist_cnn_parameter_count_is_fedjax_emnist():
    by_hand = (9 * 32 + 32) + (9 * 32 * 64 + 64) + (12 * 12 * 64 * 128 + 128) + (128 * 62 + 62)
    assert by_hand == 1_206_590                   # fedjax/models/emnist_test.py
    assert _count("femnist_cnn", Task("classify", 62, "image"), (28, 28, 1)) == by_hand


def test_tag_logreg_and_sent_lstm_parameter_counts():
    # TFF: Dense(500) on 10,000 bag-of-words features. Ids: PAD 0, words 1..10000, OOV 10001.
    tp = Task("multilabel", 500, "tokens", 10_002)
    assert _count("tag_logreg", tp, (40,), num_words=10_000) == 10_000 * 500 + 500
    # data/text.py's layout (PAD 0, words 1..10000, OOV 10001 outside the 10,001 input ids):
    # the default range.
    tp = Task("multilabel", 500, "tokens", 10_001)
    assert _count("tag_logreg", tp, (64,)) == 10_000 * 500 + 500
    v = 1000    # LEAF: Embed(V, 100), two LSTMs of 100, Dense 128, Dense 2
    want = v * 100 + 2 * _lstm_count(100, 100) + (100 * 128 + 128) + (128 * 2 + 2)
    assert _count("sent_lstm", Task("classify", 2, "tokens", v), (25,)) == want


# ---------------------------------------------------------------- model compositions vs NumPy

@pytest.mark.slow
def test_char_lstm_equals_embedding_two_numpy_lstms_and_dense():
    v, c = 7, 6
    for output_tanh, last_only in ((False, False), (True, True)):
        m = sequence.CharLSTM(v, c, embed=3, hidden=4, output_tanh=output_tanh,
                              last_only=last_only)
        x = np.array([[1, 2, 3, 6, 5], [4, 4, 1, 0, 0]])
        p = jax.jit(m.init)(jax.random.key(1), jnp.asarray(x))["params"]
        p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
        h = p["Embed_0"]["embedding"][x]
        for layer in ("LSTM_0", "LSTM_1"):
            h = _np_lstm(p[layer], h, x != 0)
            h = np.tanh(h) if output_tanh else h
        if last_only:
            h = h[:, -1]
        want = h @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"]
        got = jax.jit(m.apply)({"params": jax.tree.map(jnp.asarray, p)}, jnp.asarray(x))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_padding_changes_neither_loss_nor_gradient_nor_accuracy_through_a_model():
    """CharLSTM + sequence_cross_entropy on a padded batch (extra PAD positions, a PAD-only
    example) against the per-sequence computation on the unpadded tokens."""
    v = 6
    model = sequence.CharLSTM(v, v, embed=3, hidden=5, layers=1)
    rng = np.random.default_rng(4)
    seqs = [rng.integers(1, v, size=n) for n in (4, 2)]
    targets = [rng.integers(1, v, size=len(s)) for s in seqs]
    params = model.init(jax.random.key(0), jnp.zeros((1, 6), jnp.int32))["params"]
    metric = tasks.token_accuracy(())

    @jax.jit
    def evaluate(p, x, y):
        """(Σ loss, its gradient, Σ hits, Σ count, Σ weight) of one batch."""
        def total(q):
            out = model.apply({"params": q}, x)
            return tasks.sequence_cross_entropy(out, y).sum(), out

        (loss, out), grad = jax.value_and_grad(total, has_aux=True)(p)
        hits, count = metric(out, y)
        return loss, grad, hits.sum(), count.sum(), tasks.token_weight(y).sum()

    # Reference: each sequence alone, unpadded, summed.
    alone = [evaluate(params, jnp.asarray(s[None]), jnp.asarray(t[None]))
             for s, t in zip(seqs, targets)]
    want_loss = sum(a[0] for a in alone)
    want_grad = jax.tree.map(lambda *g: sum(g), *[a[1] for a in alone])
    want_hits = sum(float(a[2]) for a in alone)
    for length, extra in ((7, 2),):
        x = np.zeros((len(seqs) + extra, length), np.int32)
        y = np.zeros_like(x)
        for i, (s, t) in enumerate(zip(seqs, targets)):
            x[i, : len(s)], y[i, : len(t)] = s, t
        loss, grad, hits, count, weight = evaluate(params, jnp.asarray(x), jnp.asarray(y))
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                     grad, want_grad)
        assert float(weight) == float(count) == sum(map(len, seqs))
        assert float(hits) == want_hits


@pytest.mark.slow
def test_sent_lstm_ignores_padding_anywhere():
    m = sequence.SentLSTM(9, embed=4, hidden=3, fc=5)
    x = np.array([[3, 1, 4, 1, 5]])
    p = jax.jit(m.init)(jax.random.key(2), jnp.asarray(x))["params"]
    apply = jax.jit(lambda q, z: m.apply({"params": q}, z))
    want = apply(p, jnp.asarray(x))
    # Trailing, leading and inner PAD (one shape, so one compilation).
    padded = [[3, 1, 4, 1, 5, 0, 0, 0], [0, 0, 0, 3, 1, 4, 1, 5], [3, 1, 0, 4, 1, 0, 5, 0]]
    np.testing.assert_allclose(apply(p, jnp.asarray(padded)), np.repeat(want, 3, axis=0),
                               rtol=1e-5, atol=1e-6)
    assert want.shape == (1, 2)


@pytest.mark.slow
def test_transformer_is_causal_and_last_only_reads_the_last_real_token():
    m = sequence.CausalTransformer(11, 11, max_len=8, width=16, heads=2, layers=2)
    rng = np.random.default_rng(5)
    x = rng.integers(1, 11, size=(2, 8))
    p = jax.jit(m.init)(jax.random.key(3), jnp.asarray(x))["params"]
    apply = jax.jit(lambda q, z: m.apply({"params": q}, z))
    out = apply(p, jnp.asarray(x))
    for t in (0, 3, 6):
        x2 = x.copy()
        x2[:, t + 1:] = rng.integers(0, 11, size=(2, 7 - t))    # change everything after t
        out2 = apply(p, jnp.asarray(x2))
        np.testing.assert_allclose(out2[:, : t + 1], out[:, : t + 1], rtol=1e-5, atol=1e-6)
        assert not np.allclose(out2[:, t + 1:], out[:, t + 1:])   # the future did change
    last = sequence.CausalTransformer(11, 11, max_len=8, width=16, heads=2, layers=2,
                                      last_only=True)
    # Trailing PAD: the last real position's output (sequence 0 has 5 real tokens of 8).
    x_pad = x.copy()
    x_pad[0, 5:] = 0
    got = jax.jit(lambda q, z: last.apply({"params": q}, z))(p, jnp.asarray(x_pad))
    want = np.stack([apply(p, jnp.asarray(x_pad[:1, :5]))[0, 4], out[1, -1]])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# Inner and leading PAD (0): with causal attention only these can reach a later real query.
INNER_PAD = np.array([[3, 0, 5, 0, 0, 7, 2, 0], [0, 4, 4, 0, 9, 1, 0, 6]])


@pytest.mark.slow
def test_transformer_real_positions_never_read_pad_keys():
    # Every value a PAD position carries comes from the PAD token's embedding row (and its
    # learned position): redrawing that row arbitrarily must leave the outputs at the real
    # positions bit for bit unchanged (their attention weight on PAD keys is exactly 0), while
    # the PAD positions' own outputs change (the perturbation reaches the network).
    m = sequence.CausalTransformer(11, 11, max_len=8, width=16, heads=2, layers=2)
    x = jnp.asarray(INNER_PAD)
    p = jax.jit(m.init)(jax.random.key(4), x)["params"]
    apply = jax.jit(lambda q: m.apply({"params": q}, x))
    rng = np.random.default_rng(6)
    table = np.asarray(p["Embed_0"]["embedding"]).copy()
    table[0] = rng.normal(size=table.shape[1]) * 3.0                  # PAD's embedding redrawn
    q = dict(p, Embed_0={"embedding": jnp.asarray(table)})
    out, out2 = np.asarray(apply(p)), np.asarray(apply(q))
    real = INNER_PAD != 0
    np.testing.assert_array_equal(out2[real], out[real])
    assert np.abs(out2[~real] - out[~real]).min() > 1e-4


@pytest.mark.slow
def test_transformer_without_positions_reads_inner_padded_tokens_as_the_unpadded_sequence():
    # With the positional embedding zeroed the model sees only tokens and the causal order, so a
    # sequence with PADs inside equals, at its real positions, the same tokens without the PADs:
    # an independent reference for "attends to the earlier real tokens and itself only".
    m = sequence.CausalTransformer(11, 11, max_len=8, width=16, heads=2, layers=2)
    x = jnp.asarray(INNER_PAD)
    p = jax.jit(m.init)(jax.random.key(4), x)["params"]
    p = dict(p, pos_embedding=jnp.zeros_like(p["pos_embedding"]))
    apply = jax.jit(lambda q, z: m.apply({"params": q}, z))
    out = np.asarray(apply(p, x))
    for row in range(len(INNER_PAD)):
        real = INNER_PAD[row] != 0
        alone = apply(p, jnp.asarray(INNER_PAD[row][real])[None])[0]
        np.testing.assert_allclose(out[row][real], alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("features", ["frequency", "count", "binary"])
def test_tag_logreg_equals_numpy_bag_of_words(features):
    v, tags, first, num = 9, 4, 1, 7         # ids 1..7 words, 8 OOV (no feature), 0 PAD
    x = np.array([[1, 1, 3, 8, 0, 0], [7, 2, 2, 2, 8, 8], [0, 0, 0, 0, 0, 0]])
    m = sequence.TagLogReg(v, tags, features=features, first_word=first, num_words=num)
    p = m.init(jax.random.key(4), jnp.asarray(x))["params"]["Dense_0"]
    kernel, bias = np.asarray(p["kernel"], np.float64), np.asarray(p["bias"], np.float64)
    want = []
    for row in x:
        bag = np.zeros(num)
        words = [t for t in row if t != 0]
        for t in words:
            if first <= t < first + num:
                bag[t - first] += 1
        if features == "frequency":
            bag /= max(len(words), 1)        # OOV words count in the denominator (TFF)
        elif features == "binary":
            bag = np.minimum(bag, 1)
        want.append(bag @ kernel + bias)
    got = m.apply({"params": {"Dense_0": p}}, jnp.asarray(x))
    np.testing.assert_allclose(got, np.array(want), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- heads and `get`

TASKS = {
    "char_lstm": (Task("sequence", 12, "tokens", 12), (10,)),
    "word_lstm": (Task("sequence", 12, "tokens", 12), (10,)),
    "transformer": (Task("sequence", 12, "tokens", 12), (10,)),
    "tag_logreg": (Task("multilabel", 5, "tokens", 12), (10,)),
    "sent_lstm": (Task("classify", 2, "tokens", 12), (10,)),
    "femnist_cnn": (Task("classify", 62, "image"), (8, 8, 1)),
}
SMALL = {"char_lstm": dict(hidden=8), "word_lstm": dict(hidden=8, embed=4),
         "transformer": dict(width=8, heads=2, layers=1), "tag_logreg": {},
         "sent_lstm": dict(hidden=4, embed=4, fc=3), "femnist_cnn": {}}


@pytest.mark.parametrize("name", sequence.SEQUENCE_MODELS)
def test_split_head_is_the_output_projection(name):
    task, shape = TASKS[name]
    pieces = sequence.get(name, task, shape, **SMALL[name])
    params = jax.eval_shape(pieces["init"], jax.random.key(0))
    mask = personal_mask(params, "head")
    head = [p for p, m in zip(leaf_paths(params), jax.tree.leaves(mask)) if m]
    top = sorted(params)
    last_dense = "Dense_1" if name == "femnist_cnn" else "Dense_0"
    assert head == [f"{last_dense}/bias", f"{last_dense}/kernel"], (head_pattern(params), top)
    # ... and it maps the model's last hidden layer onto the outputs.
    assert params[last_dense]["kernel"].shape[-1] == task.num_classes


@pytest.mark.parametrize("name", [n if i == 0 else pytest.param(n, marks=pytest.mark.slow)
                                  for i, n in enumerate(sequence.SEQUENCE_MODELS)])
def test_get_runs_and_gives_the_tasks_output_shape(name):
    task, shape = TASKS[name]
    pieces = sequence.get(name, task, shape, **SMALL[name])
    params = jax.jit(pieces["init"])(jax.random.key(0))
    x = (jnp.ones((2, *shape), jnp.int32) if task.inputs == "tokens"
         else jnp.ones((2, *shape), jnp.float32))
    out = jax.jit(pieces["apply"])(params, x)
    assert out.shape == ((2, shape[0], task.num_classes) if task.kind == "sequence"
                         else (2, task.num_classes))
    assert set(pieces) == {"init", "apply", "features", "name", "loss", "weight", "metric"}


def test_get_last_position_for_a_classify_task_on_tokens():
    pieces = sequence.get("char_lstm", Task("classify", 12, "tokens", 12), (10,), hidden=8)
    params = jax.eval_shape(pieces["init"], jax.random.key(0))
    assert jax.eval_shape(pieces["apply"], params, jnp.ones((3, 10), jnp.int32)).shape == (3, 12)


def test_get_refuses_mismatches():
    seq, shape = TASKS["char_lstm"]
    with pytest.raises(ValueError, match="unknown model"):
        sequence.get("gpt", seq, shape)
    with pytest.raises(ValueError, match="no option"):
        sequence.get("char_lstm", seq, shape, width=3)
    with pytest.raises(ValueError, match="token inputs"):
        sequence.get("char_lstm", Task("classify", 10, "image"), (28, 28, 1))
    with pytest.raises(ValueError, match="does not fit"):
        sequence.get("tag_logreg", seq, shape)
    with pytest.raises(ValueError, match="image inputs"):
        sequence.get("femnist_cnn", seq, shape)


def test_femnist_cnn_is_stateless_and_uses_our_layers():
    variables = jax.eval_shape(nets.FemnistCNN().init, jax.random.key(0),
                               jnp.zeros((1, 28, 28, 1)))
    assert set(variables) == {"params"}
    assert sorted(variables["params"]) == ["Conv2D_0", "Conv2D_1", "Dense_0", "Dense_1"]
    assert variables["params"]["Dense_0"]["kernel"].shape == (12 * 12 * 64, 128)


def test_model_options_are_checked_by_name_and_kind_before_a_model_is_built():
    from fedjax_pfl.errors import OptionError
    from fedjax_pfl.models.sequence import check_options

    check_options("char_lstm", {"embed": 4, "hidden": 8, "layers": 1, "output_tanh": True})
    check_options("transformer", {"width": 12, "heads": 3})          # 12 = 3 heads of 4
    check_options("mlp", {})                                           # none given: nothing to check
    for name, options, words in [
            ("char_lstm", {"hidden": "8"}, "model_options hidden must be an integer >= 1, got '8'"),
            ("char_lstm", {"hidden": True}, "model_options hidden must be an integer >= 1"),
            ("sent_lstm", {"fc": -1}, "model_options fc must be an integer >= 1, got -1"),
            ("tag_logreg", {"features": "tfidf"}, "model_options features must be one of"),
            ("transformer", {"width": 12, "heads": 5},
             "model_options width 12 must be a multiple of heads 5"),
            ("word_lstm", {"layers": 2}, "model_options layers: model word_lstm has no such option"),
            ("mlp", {"hidden": 3}, "model_options ['hidden']: model mlp takes no model options")]:
        with pytest.raises(OptionError) as exc:
            check_options(name, options)
        assert str(exc.value).startswith(words), (name, options, str(exc.value))
        assert exc.value.arguments[0] == ("model_options", "")
