"""CP layers and networks: equal to dense layers with the reconstructed weights
(docs/algorithms/tdpfed.md#tests, T13–T15), parameter counts of CP-DNN / CP-VGG8 (T12, T31)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfl import models
from fedjax_pfl.models import cp
from fedjax_pfl.ops import cp_reconstruct


def rand(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


@pytest.mark.parametrize("factored", [True, False])
def test_cp_dense_equals_dense_with_the_reconstructed_kernel(factored):
    layer = cp.CPDense(7, rank=3, factored=factored)
    x = rand((5, 11), 0)
    params = layer.init(jax.random.key(0), x)["params"]
    a_in, a_out = params["kernel"].factors
    assert a_in.shape == (11, 3) and a_out.shape == (7, 3)
    w = np.asarray(a_in, np.float64) @ np.asarray(a_out, np.float64).T        # [I_in, I_out]
    expected = np.asarray(x, np.float64) @ w + np.asarray(params["bias"], np.float64)
    np.testing.assert_allclose(layer.apply({"params": params}, x), expected, rtol=1e-5, atol=1e-5)


def dense_conv(x, kernel, padding, strides=(1, 1)):
    return jax.lax.conv_general_dilated(x, kernel, strides, padding,
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                        precision=jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize("padding", ["VALID", "SAME"])
@pytest.mark.parametrize("strides", [(1, 1), (2, 1)])
@pytest.mark.slow
def test_four_stage_conv_equals_dense_conv(padding, strides):
    """Asymmetric everything (kernel 3×2, input 9×7, I_S = 4 ≠ I_T = 6) pins the factor roles:
    A^(1) kernel rows, A^(2) kernel columns, A^(3) input channels, A^(4) output channels."""
    factors = [rand((3, 5), 1), rand((2, 5), 2), rand((4, 5), 3), rand((6, 5), 4)]
    x = rand((2, 9, 7, 4), 5)
    kernel = jnp.einsum("pr,qr,sr,tr->pqst", *factors)                         # HWIO
    got = cp.cp_conv_factored(x, factors, strides=strides, padding=padding)
    np.testing.assert_allclose(got, dense_conv(x, kernel, padding, strides), rtol=2e-4, atol=2e-4)
    # Swapping two factors' roles breaks the equality (so the roles are really tested).
    swapped = [factors[0], factors[1], factors[2], factors[3]]
    swapped[0], swapped[1] = rand((3, 5), 6), factors[1]
    assert np.abs(cp.cp_conv_factored(x, swapped, strides=strides, padding=padding)
                  - got).max() > 1e-2


def test_spatial_stages_commute_and_bias_belongs_after_the_last_stage():
    a1, a2, a3, a4 = rand((3, 4), 7), rand((3, 4), 8), rand((2, 4), 9), rand((5, 4), 10)
    x = rand((1, 6, 6, 2), 11)
    u = jnp.pad(x @ a3, ((0, 0), (1, 1), (1, 1), (0, 0)))
    width_first = sum(u[:, :, q:q + 6, :] * a2[q] for q in range(3))
    width_first = sum(width_first[:, p:p + 6, :, :] * a1[p] for p in range(3))
    height_first = sum(u[:, p:p + 6, :, :] * a1[p] for p in range(3))
    height_first = sum(height_first[:, :, q:q + 6, :] * a2[q] for q in range(3))
    np.testing.assert_allclose(width_first, height_first, rtol=1e-5, atol=1e-5)
    # A bias added after stage 1 under SAME padding is zero-padded away at the border, so its
    # effect on the output varies with position: no constant output bias reproduces it.
    bias = jnp.ones(4)
    u_b = jnp.pad(x @ a3 + bias, ((0, 0), (1, 1), (1, 1), (0, 0)))
    v = sum(u_b[:, :, q:q + 6, :] * a2[q] for q in range(3))
    v = sum(v[:, p:p + 6, :, :] * a1[p] for p in range(3))
    offset = v @ a4.T - cp.cp_conv_factored(x, [a1, a2, a3, a4], padding="SAME")
    assert np.abs(offset[0, 0, 0] - offset[0, 3, 3]).max() > 1e-3


@pytest.mark.parametrize("factored", [True, False])
@pytest.mark.slow
def test_cp_conv_layer_equals_dense_conv(factored):
    layer = cp.CPConv(6, (3, 3), rank=4, padding="SAME", factored=factored)
    x = rand((2, 8, 8, 3), 12)
    params = layer.init(jax.random.key(1), x)["params"]
    kernel = cp_reconstruct(params["kernel"].factors)
    expected = dense_conv(x, kernel, "SAME") + params["bias"]
    np.testing.assert_allclose(layer.apply({"params": params}, x), expected, rtol=2e-4, atol=2e-4)


@pytest.mark.slow      # whole-network builds: ~5 s each
@pytest.mark.parametrize("name,shape,dense", [
    ("mlp", (28, 28, 1), "mlp"),
    pytest.param("vgg8", (32, 32, 3), "vgg8", marks=pytest.mark.slow),  # ~20 s: VGG8's init
])
@pytest.mark.parametrize("factored", [True, False])
def test_cp_networks_equal_the_dense_network_with_reconstructed_weights(name, shape, dense, factored):
    cp_model = models.get("cp_" + name, shape, 10, cr=2.0)
    if not factored:
        module = cp.CPMLP(10, cr=2.0, factored=False) if name == "mlp" else cp.CPVGG8(10, cr=2.0, factored=False)
        cp_model = models.from_flax(module, shape)
    dense_model = models.get(dense, shape, 10)
    # Parameters from one compiled init, and the dense network's structure from its shapes alone:
    # eager inits, op by op, were ~8 of VGG8's ~12 CPU s here; what is compared is the same.
    params = jax.jit(cp_model.init)(jax.random.key(2))
    recon = cp.reconstruct(params)
    assert jax.tree.structure(recon) == jax.tree.structure(
        jax.eval_shape(dense_model.init, jax.random.key(0)))
    x = jax.random.uniform(jax.random.key(3), (3, *shape), minval=-1, maxval=1)
    got = jax.jit(cp_model.apply)(params, x)
    np.testing.assert_allclose(got, jax.jit(dense_model.apply)(recon, x), rtol=2e-3, atol=2e-4)
    # And vmapped over clients (a stack of two parameter sets).
    two = jax.tree.map(lambda a: jnp.stack([a, 2 * a]), params)
    out = jax.jit(jax.vmap(cp_model.apply, in_axes=(0, None)))(two, x)
    np.testing.assert_allclose(out[0], got, rtol=1e-5, atol=1e-5)


# docs/algorithms/tdpfed.md#t12, #t31: floats per model, weights + biases.
COUNTS = {("mlp", (28, 28, 1)): {1: 79_510, 1.5: 52_926, 2: 39_556},
          ("vgg8", (32, 32, 3)): {1: 1_112_650, 1.5: 741_534, 2: 556_745}}


@pytest.mark.parametrize("key", list(COUNTS))
@pytest.mark.slow
def test_parameter_counts_at_each_compression_rate(key):
    name, shape = key
    dense_model = models.get(name, shape, 10)
    for cr, expected in COUNTS[key].items():
        net = jax.eval_shape(models.get("cp_" + name, shape, 10, cr=cr).init, jax.random.key(0))
        assert cp.num_floats(net) == expected
        assert cp.dense_num_floats(net) == COUNTS[key][1]
        # The generic factorisation that TDPFed applies to any dense model gives the same counts.
        generic = jax.eval_shape(
            lambda k: cp.cp_init_like(k, dense_model.init(k), cr), jax.random.key(1))
        assert cp.num_floats(generic) == expected


@pytest.mark.slow
def test_cp_init_like_matches_the_dense_variance_and_keeps_biases():
    dense = models.get("mlp", (28, 28, 1), 10).init(jax.random.key(0))
    tree = cp.cp_init_like(jax.random.key(1), dense, 2.0)
    assert cp.ranks(tree) == {"Dense_0/kernel": 44, "Dense_1/kernel": 5}
    np.testing.assert_array_equal(tree["Dense_0"]["bias"], dense["Dense_0"]["bias"])
    recon = cp.reconstruct(tree)["Dense_0"]["kernel"]
    ratio = float(jnp.var(recon) / jnp.var(dense["Dense_0"]["kernel"]))
    assert 0.8 < ratio < 1.25
    assert cp.cp_init_like(jax.random.key(1), dense, 1) is dense


def test_vgg8_needs_32x32_images():
    with pytest.raises(ValueError, match="--model vgg8 needs images of at least 32x32"):
        models.get("vgg8", (28, 28, 1), 10)
