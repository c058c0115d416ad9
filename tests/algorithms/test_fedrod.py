"""FedRoD: the balanced softmax against NumPy (zero-count classes), the class counts against the
host-side `label_counts`, the prediction = generic + personal logits, rounds against a NumPy
float64 transcription of the reference code's two optimizer steps per batch, backends equal."""

import functools

import jax
import jax.numpy as jnp
import mlp_reference as ref
import numpy as np
import pytest
from helpers import make_raw, tree_allclose

from fedjax_pfl import algorithms, models
from fedjax_pfl.algorithms import fedrod
from fedjax_pfl.data.federated import FederatedData, label_counts
from fedjax_pfl.models import nets

MLP = models.from_flax(nets.MLP(3, hidden=(4,)), (5,))
SIZES = [7, 23, 12, 9]


def skewed_raw():
    """make_raw's clients, with client 0 holding no training sample of class 2 and client 2 none
    of classes 0 and 1 (only class 2): the −∞ entries of log π are exercised."""
    x, y, train, test, scale, shift = make_raw(SIZES)
    y = y.copy()
    y[train[0]] = np.where(y[train[0]] == 2, 0, y[train[0]])
    y[train[2]] = 2
    return x, y, train, test, scale, shift


RAW = skewed_raw()
DATA = FederatedData.from_arrays(*RAW[:4], num_classes=3, name="toy")


def np_bsm(logits, y, counts):
    """Balanced softmax in float64: −log softmax(z + log n_c)_y, classes with n_c = 0 removed."""
    z = np.where(counts > 0, logits + np.log(np.maximum(counts, 1)), -np.inf)
    top = z.max(axis=1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(z - top).sum(axis=1))
    return lse - z[np.arange(len(y)), y]


@pytest.mark.slow
def test_balanced_softmax_against_numpy(x64):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 4)) * 3
    counts = np.array([5, 0, 1, 12])
    y = np.array([0, 2, 3, 3, 0, 2])
    got = fedrod.balanced_softmax_loss(jnp.asarray(logits), jnp.asarray(y), fedrod.log_prior(counts))
    # The prior is normalised (π = n/Σn) where the reference adds log n: softmax does not care.
    np.testing.assert_allclose(got, np_bsm(logits, y, counts), rtol=1e-12)
    # Hand case: counts (1, 3), logits 0: softmax(log ¼, log ¾) → −log ¼ for label 0.
    np.testing.assert_allclose(fedrod.balanced_softmax_loss(jnp.zeros((1, 2)), jnp.array([0]),
                                                            fedrod.log_prior(jnp.array([1, 3]))),
                               [np.log(4.0)], rtol=1e-12)
    # A class without samples gets probability 0 and an exactly zero, finite gradient.
    grad = jax.grad(lambda z: jnp.sum(fedrod.balanced_softmax_loss(z, jnp.asarray(y),
                                                                   fedrod.log_prior(counts))))
    g = np.asarray(grad(jnp.asarray(logits)))
    assert np.all(np.isfinite(g)) and np.all(g[:, 1] == 0.0)
    np.testing.assert_array_equal(fedrod.log_prior(counts)[1], -np.inf)


def test_class_counts_match_label_counts():
    padded = DATA.pad_clients(8)                                 # 4 empty padding clients
    counts = np.asarray(jax.jit(fedrod.train_label_counts)(padded))
    np.testing.assert_array_equal(counts, label_counts(padded, "train"))
    assert counts[0, 2] == 0 and counts[2, :2].sum() == 0 and counts[4:].sum() == 0


@functools.lru_cache(maxsize=None)
def _run(backend, rounds=2, **hp):
    algo = algorithms.get("fedrod", model=MLP, backend=backend, lr=0.1, batch_size=4,
                          participation=0.5, **hp)
    state = algo.init(jax.random.key(0), DATA)
    step = algo.round_fn if backend == "loop" else jax.jit(algo.round_fn)
    for r in range(rounds):
        state, _ = step(state, DATA, jax.random.key(r))
    return state, algo.evaluate(state, DATA)


@pytest.mark.slow
def test_prediction_is_the_sum_of_the_two_heads():
    state, evals = _run("vmap")
    p = ref.to_numpy(state.params)
    for i in range(len(SIZES)):
        x, y = ref.client_xy(RAW, i, "test")
        phi = jax.tree.map(lambda a: np.asarray(a[i], np.float64), state.heads)["Dense_1"]
        h = np.maximum(x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"], 0.0)      # relu body
        generic = h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]
        personal = h @ phi["kernel"] + phi["bias"]
        # For a linear head the sum of the heads is the head with the summed parameters.
        summed = h @ (p["Dense_1"]["kernel"] + phi["kernel"]) + p["Dense_1"]["bias"] + phi["bias"]
        np.testing.assert_allclose(generic + personal, summed, rtol=1e-12)
        z = generic + personal
        lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
        np.testing.assert_allclose(evals["client"].loss_sum[i], np.sum(lse - z[np.arange(len(y)), y]),
                                   rtol=2e-5)
        assert evals["client"].correct[i] == np.sum(z.argmax(1) == y)
        assert evals["global"].correct[i] == np.sum(generic.argmax(1) == y)
    assert not np.array_equal(evals["client"].correct, evals["global"].correct)
    # evaluate(..., ids) gives those clients' rows of the full evaluation.
    algo = algorithms.get("fedrod", model=MLP, lr=0.1, batch_size=4, participation=0.5)
    some = algo.evaluate(state, DATA, jnp.array([2, 0], jnp.int32))
    for key in ("client", "global"):
        tree_allclose(some[key], jax.tree.map(lambda a: a[np.array([2, 0])], evals[key]), rtol=1e-6)


@pytest.mark.slow
def test_rounds_match_numpy_transcription(x64):
    # Per full batch: step 1, the generic model on the balanced softmax; step 2, the personal head
    # on CE(detached generic logits + personal logits), with the PRE-step features (the
    # reference computes rep once, before step 1); both plain SGD at lr.
    lr, epochs = 0.3, 2
    algo = algorithms.get("fedrod", model=ref.TWO_LAYER, lr=lr, batch_size=32, participation=0.5,
                          local_epochs=epochs)
    state = algo.init(jax.random.key(0), DATA)
    generic = ref.to_numpy(ref.TWO_LAYER.init(jax.random.key(0)))
    phis = [dict(generic["Dense_1"]) for _ in SIZES]
    counts = label_counts(DATA, "train")
    seen = set()
    for r in range(3):
        state, m = jax.jit(algo.round_fn)(state, DATA, jax.random.key(r))
        sampled = np.asarray(m["sampled"]).tolist()
        trained = []
        for i in sampled:
            x, y = ref.client_xy(RAW, i)
            g, phi = generic, phis[i]
            for _ in range(epochs):
                h = ref.features(g, x)
                out_g = ref.logits(g, x)
                z = np.where(counts[i] > 0, out_g + np.log(np.maximum(counts[i], 1)), -np.inf)
                dz = ref.softmax(np.where(np.isinf(z), -1e300, z))
                dz[np.arange(len(y)), y] -= 1.0
                grad_g = ref.backprop(g, x, dz / len(y))                     # BSM gradient
                dz_p = ref.ce_dlogits(out_g + h @ phi["kernel"] + phi["bias"], y)
                grad_phi = {"kernel": h.T @ dz_p, "bias": dz_p.sum(0)}        # CE on detached parts
                g = ref.axpy(-lr, grad_g, g)
                phi = ref.axpy(-lr, grad_phi, phi)
            trained.append(g)
            phis[i] = phi
        generic = ref.weighted_mean(trained, [SIZES[i] for i in sampled])
        tree_allclose(state.params, generic, rtol=1e-10, atol=1e-12)
        for i in range(len(SIZES)):
            tree_allclose(jax.tree.map(lambda a: a[i], state.heads["Dense_1"]), phis[i],
                          rtol=1e-10, atol=1e-12)
        seen.update(sampled)
    assert {0, 2} <= seen                                   # the clients with absent classes
    np.testing.assert_array_equal(state.class_counts, counts)


@pytest.mark.slow      # the loop backend runs the round eagerly
def test_backends_agree():
    ref_state, ref_eval = _run("loop", momentum=0.5, momentum_buffer="persist")
    for backend in ("vmap", "chunked"):
        extra = {"chunk_size": 1} if backend == "chunked" else {}
        state, ev = _run(backend, momentum=0.5, momentum_buffer="persist", **extra)
        tree_allclose(state, ref_state, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(ev["client"].correct, ref_eval["client"].correct)


def test_help_explains_the_flag():
    import run as cli

    text = " ".join(cli.build_parser().format_help().split())
    assert "--fedrod-head" in text and "each client's personal head" in text
    assert "fedrod: FedRoD: a generic model trained with the balanced softmax" in text
