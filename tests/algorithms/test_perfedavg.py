"""Per-FedAvg: the Hessian–vector product against jax.hessian, FO = HF without the Hessian term,
the batch split, a round and the adapted evaluation by hand, backends equal, --help."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import linear_model, tree_allclose
from jax.flatten_util import ravel_pytree

from fedjax_pfl import algorithms, models
from fedjax_pfl.algorithms import perfedavg
from fedjax_pfl.core.local import masked_mean_loss
from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.models import nets
from fedjax_pfl.models.model import Model

MLP = models.from_flax(nets.MLP(3, hidden=(4,)), (5,))
QUADRATIC = Model(init=lambda key: {"w": jnp.array([0.5, -1.0])}, apply=lambda p, x: p["w"] - x,
                  loss=lambda out, y: 0.5 * jnp.sum(out**2, axis=-1))


def _losses(model, seed=0):
    rng = np.random.default_rng(seed)
    x, y = jnp.asarray(rng.normal(size=(8, 5))), jnp.asarray(rng.integers(0, 3, 8))
    mask = lambda lo, hi: (jnp.arange(8) >= lo) & (jnp.arange(8) < hi)
    f = lambda m: (lambda p: masked_mean_loss(model, p, x, y, m))
    return f(mask(0, 3)), f(mask(3, 8)), f(mask(0, 8))


@pytest.mark.slow
@pytest.mark.parametrize("model", [linear_model(), MLP], ids=["linear", "mlp"])
def test_hessian_vector_product_matches_jax_hessian(x64, model):
    _, _, loss = _losses(model)
    params = jax.tree.map(lambda p: p.astype(jnp.float64), model.init(jax.random.key(1)))
    vector = jax.tree.map(lambda p: jnp.cos(jnp.arange(p.size, dtype=p.dtype)).reshape(p.shape),
                          params)
    flat, unravel = ravel_pytree(params)
    # Jitted: eagerly, every primitive of the nested autodiff would compile on its own.
    hessian = jax.jit(jax.hessian(lambda f: loss(unravel(f))))(flat)           # dense d × d
    hvp = jax.jit(lambda p, v: perfedavg.hessian_vector_product(loss, p, v))
    got = ravel_pytree(hvp(params, vector))[0]
    np.testing.assert_allclose(got, hessian @ ravel_pytree(vector)[0], rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_first_order_is_hessian_free_without_the_hessian_term(x64):
    f_in, f_out, f_hess = _losses(MLP, seed=2)
    params = jax.tree.map(lambda p: p.astype(jnp.float64), MLP.init(jax.random.key(3)))  # flax: f32
    alpha = 0.4
    meta = jax.jit(lambda p, hf: perfedavg.meta_gradient(f_in, f_out, f_hess, p, alpha, hf),
                   static_argnums=1)       # jitted, as in the tests above
    loss_fo, g_fo = meta(params, False)
    loss_hf, g_hf = meta(params, True)
    flat, unravel = ravel_pytree(params)
    # FO by hand: the gradient on D' at w̃ = w − α∇f(w; D).
    adapted = flat - alpha * jax.jit(jax.grad(lambda f: f_in(unravel(f))))(flat)
    expected_fo = jax.jit(jax.grad(lambda f: f_out(unravel(f))))(adapted)
    np.testing.assert_allclose(ravel_pytree(g_fo)[0], expected_fo, rtol=1e-10, atol=1e-12)
    hessian = jax.jit(jax.hessian(lambda f: f_hess(unravel(f))))(flat)
    np.testing.assert_allclose(ravel_pytree(g_hf)[0], expected_fo - alpha * hessian @ expected_fo,
                               rtol=1e-10, atol=1e-12)
    assert loss_fo == loss_hf == f_in(params)
    assert np.abs(hessian @ expected_fo).max() > 1e-3                         # the term matters


def test_split_batch_halves_the_real_samples():
    first, rest = perfedavg.split_batch(jnp.arange(8) < 5)                      # c = 5
    np.testing.assert_array_equal(first, [1, 1, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(rest, [0, 0, 1, 1, 1, 0, 0, 0])
    first, rest = perfedavg.split_batch(jnp.arange(8) < 1)                      # c = 1: all in D'
    np.testing.assert_array_equal(first, np.zeros(8))
    np.testing.assert_array_equal(rest, [1, 0, 0, 0, 0, 0, 0, 0])


def constant_client_data():
    # Client A's rows are all [2, 0] (4 train, 1 test), client B's all [0, 3] (2 train, 1 test):
    # whatever the batch order and split, ∇f(u; D) = u − x_k on every batch.
    x = np.array([[2, 0]] * 5 + [[0, 3]] * 3, np.float64)
    return FederatedData.from_arrays(x, np.zeros(8), [np.arange(4), np.arange(5, 7)],
                                     [np.array([4]), np.array([7])], num_classes=1)


@pytest.mark.parametrize("variant", ["fo", pytest.param("hf", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_round_and_adapted_evaluation_by_hand(x64, variant):
    # Per-example loss ½‖u − x‖² has Hessian I: w̃ = w − α(w − x_k), ∇f(w̃) = (1 − α)(w − x_k);
    # FO steps w ← w − β(1 − α)(w − x_k), HF multiplies by (I − αI) once more: (1 − α)².
    alpha, beta = 0.25, 0.5
    algo = algorithms.get("perfedavg", model=QUADRATIC, variant=variant, alpha=alpha, lr=beta,
                          batch_size=4, local_steps=1, participation=1.0)
    data = constant_client_data()
    state = algo.init(jax.random.key(0), data)
    state, _ = jax.jit(algo.round_fn)(state, data, jax.random.key(1))
    factor = (1 - alpha) if variant == "fo" else (1 - alpha) ** 2
    w0, means = np.array([0.5, -1.0]), (np.array([2.0, 0.0]), np.array([0.0, 3.0]))
    ends = [w0 - beta * factor * (w0 - mean) for mean in means]
    w = (4 * ends[0] + 2 * ends[1]) / 6
    np.testing.assert_allclose(state.params["w"], w, rtol=1e-12)
    ev = algo.evaluate(state, data)
    adapted = [w - alpha * (w - mean) for mean in means]                       # one step of α
    np.testing.assert_allclose(ev["client"].loss_sum,
                               [0.5 * np.sum((adapted[k] - means[k]) ** 2) for k in range(2)],
                               rtol=1e-10)
    np.testing.assert_allclose(ev["global"].loss_sum,
                               [0.5 * np.sum((w - means[k]) ** 2) for k in range(2)], rtol=1e-10)


def _rounds(backend, data, variant):
    algo = algorithms.get("perfedavg", model=linear_model(), backend=backend, chunk_size=2,
                          lr=0.1, batch_size=4, local_epochs=2, participation=0.5, variant=variant,
                          alpha=0.05)
    step = algo.round_fn if backend == "loop" else jax.jit(algo.round_fn)
    state = algo.init(jax.random.key(0), data)
    for r in range(2):
        state, _ = step(state, data, jax.random.key(r))
    return state, algo.evaluate(state, data), algo.evaluate(state, data, jnp.array([2, 1]))


@pytest.mark.slow      # the loop backend runs rounds eagerly
@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_vmapped_and_chunked_equal_loop_backend(ragged_data, variant):
    ref, ref_eval, _ = _rounds("loop", ragged_data, variant)
    for backend in ("vmap", "chunked"):
        state, ev, sub = _rounds(backend, ragged_data, variant)
        tree_allclose(state.params, ref.params, rtol=2e-5, atol=1e-6)
        for key in ref_eval:
            np.testing.assert_allclose(ev[key].loss_sum, ref_eval[key].loss_sum, rtol=2e-5)
            np.testing.assert_allclose(sub[key].loss_sum, np.asarray(ev[key].loss_sum)[[2, 1]],
                                       rtol=1e-5)


def test_cli_help_explains_the_flags():
    import run as cli

    text = " ".join(cli.build_parser().format_help().split())
    assert "--perfedavg-variant {fo,hf} meta-gradient: 'fo' (first order" in text
    assert "--perfedavg-alpha FLOAT α, step size of the inner adaptation step" in text
    with pytest.raises(ValueError, match="--perfedavg-variant must be one of"):
        algorithms.get("perfedavg", model=linear_model(), variant="so")
