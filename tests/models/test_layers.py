"""The im2col and Winograd convolutions equal lax.conv, parameter counts match the papers,
stateless only."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfl import models
from fedjax_pfl.ops import tree_size


@pytest.mark.parametrize("padding", ["VALID", "SAME", ((2, 1), (0, 3))])
@pytest.mark.parametrize("strides", [(1, 1), (2, 2), (1, 3)])
@pytest.mark.parametrize("kernel", [(5, 5), (3, 2), (1, 1)])
@pytest.mark.slow
def test_im2col_conv_equals_lax_conv(padding, strides, kernel):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 11, 13, 3)).astype(np.float32)
    k = rng.normal(size=(*kernel, 3, 4)).astype(np.float32)
    got = models.conv2d_im2col(jnp.asarray(x), jnp.asarray(k), strides=strides, padding=padding)
    want = jax.lax.conv_general_dilated(x, k, strides, padding,
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_im2col_conv_under_vmap_over_client_kernels():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 2, 9, 9, 2)).astype(np.float32)      # 3 clients
    k = rng.normal(size=(3, 3, 3, 2, 5)).astype(np.float32)
    got = jax.vmap(lambda a, b: models.conv2d_im2col(a, b, padding="SAME"))(x, k)
    for c in range(3):
        want = jax.lax.conv_general_dilated(x[c], k[c], (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))
        np.testing.assert_allclose(got[c], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("padding,strides,kernel", [
    ("VALID", (1, 1), (3, 4, 3, 5)),   # kh·kw·C_in = 36 > C_out = 5: kernel gradient (GᵀP)ᵀ
    ("SAME", (1, 1), (2, 2, 1, 6)),    # 4 ≤ 6: PᵀG
    # (both kernel-gradient forms above in the quick suite; strides and uneven padding in the full)
    pytest.param(((2, 1), (0, 3)), (2, 1), (3, 4, 3, 5), marks=pytest.mark.slow),
])
@pytest.mark.slow
def test_im2col_conv_gradients_equal_autodiff_of_lax_conv(x64, padding, strides, kernel):
    # The custom VJPs of patches_matmul (kernel gradient as (GᵀP)ᵀ or PᵀG, whichever operand
    # is narrower) and, at stride 1, of im2col_patches (col2im by in-place window adds) against
    # autodiff of XLA's own convolution, an independent implementation: the input and kernel
    # gradients, per client under vmap, and the forward-over-reverse product that Per-FedAvg HF
    # takes.
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(2, 3, 9, 10, kernel[2])))    # 2 clients, batch 3
    k = jnp.asarray(rng.normal(size=(2, *kernel)))
    v = jnp.asarray(rng.normal(size=k.shape[1:]))

    def loss(conv):
        return lambda k, x: jnp.sum(jnp.tanh(conv(x, k)) ** 2)

    ours = loss(lambda x, k: models.conv2d_im2col(x, k, strides=strides, padding=padding))
    ref = loss(lambda x, k: jax.lax.conv_general_dilated(
        x, k, strides, padding, dimension_numbers=("NHWC", "HWIO", "NHWC")))
    for c in range(2):
        got = jax.grad(ours, argnums=(0, 1))(k[c], x[c])
        want = jax.grad(ref, argnums=(0, 1))(k[c], x[c])
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(jax.vmap(jax.grad(ours))(k, x), jax.vmap(jax.grad(ref))(k, x),
                               rtol=1e-10, atol=1e-10)
    hvp = lambda f: jax.jvp(jax.grad(f), (k[0],), (v,))[1]
    np.testing.assert_allclose(hvp(lambda k: ours(k, x[0])), hvp(lambda k: ref(k, x[0])),
                               rtol=1e-9, atol=1e-9)


def _direct_correlation(d, g, m):
    # y_i = Σ_k d_{i+k} g_k by the definition, loops in float64.
    return np.array([sum(d[i + k] * g[k] for k in range(len(g))) for i in range(m)])


@pytest.mark.parametrize("m,r", [(2, 3), (4, 3), (6, 3), (2, 5), (3, 5), (4, 5), (2, 7), (2, 2)])
def test_winograd_matrices_compute_the_correlation(m, r):
    # Lavin & Gray 2016 eq. 7: Aᵀ[(G g) ⊙ (Bᵀ d)] is the correlation of an n = m + r - 1 tile
    # with an r-tap filter, checked against the sum itself for random tiles and filters.
    a_t, g_mat, b_t = models.layers.winograd_matrices(m, r)
    n = m + r - 1
    assert a_t.shape == (m, n) and g_mat.shape == (n, r) and b_t.shape == (n, n)
    rng = np.random.default_rng(m * 10 + r)
    for _ in range(5):
        d, g = rng.normal(size=n), rng.normal(size=r)
        np.testing.assert_allclose(a_t @ ((g_mat @ g) * (b_t @ d)), _direct_correlation(d, g, m),
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("padding,kernel,tile", [
    ("VALID", (5, 5), None), ("SAME", (5, 5), 2), (((2, 1), (0, 3)), (5, 5), 3),
    ("SAME", (3, 3), None), (((2, 1), (0, 3)), (3, 3), 2), ("VALID", (3, 2), 3),
    (((2, 1), (0, 3)), (2, 7), None), ("SAME", (2, 7), 2),
])
@pytest.mark.slow
def test_winograd_conv_equals_lax_conv(x64, padding, kernel, tile):
    # Output widths 9 to 14: three of the cases end in a partial last tile.
    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 11, 13, 3))
    k = rng.normal(size=(*kernel, 3, 4))
    got = models.conv2d_winograd(jnp.asarray(x), jnp.asarray(k), padding=padding, tile=tile)
    want = jax.lax.conv_general_dilated(x, k, (1, 1), padding,
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("padding,kernel", [("VALID", (5, 5, 3, 6)),
                                            pytest.param("SAME", (3, 3, 2, 5), marks=pytest.mark.slow)])
@pytest.mark.slow
def test_winograd_conv_gradients_equal_autodiff_of_lax_conv(x64, padding, kernel):
    # As the im2col test above: input and kernel gradients per client, under vmap over
    # per-client kernels, and forward-over-reverse (Per-FedAvg HF).
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(2, 3, 12, 12, kernel[2])))   # 2 clients, batch 3
    k = jnp.asarray(rng.normal(size=(2, *kernel)))
    v = jnp.asarray(rng.normal(size=k.shape[1:]))

    def loss(conv):
        return lambda k, x: jnp.sum(jnp.tanh(conv(x, k)) ** 2)

    ours = loss(lambda x, k: models.conv2d_winograd(x, k, padding=padding))
    ref = loss(lambda x, k: jax.lax.conv_general_dilated(
        x, k, (1, 1), padding, dimension_numbers=("NHWC", "HWIO", "NHWC")))
    for c in range(2):
        got = jax.jit(jax.grad(ours, argnums=(0, 1)))(k[c], x[c])
        want = jax.jit(jax.grad(ref, argnums=(0, 1)))(k[c], x[c])
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(jax.jit(jax.vmap(jax.grad(ours)))(k, x),
                               jax.jit(jax.vmap(jax.grad(ref)))(k, x), rtol=1e-10, atol=1e-10)
    hvp = lambda f: jax.jit(lambda v: jax.jvp(jax.grad(f), (k[0],), (v,))[1])(v)
    np.testing.assert_allclose(hvp(lambda k: ours(k, x[0])), hvp(lambda k: ref(k, x[0])),
                               rtol=1e-9, atol=1e-9)


def test_winograd_float32_error_stays_near_im2col():
    # The FedAvg CNN's conv 2 (F(4, 5), the transforms' largest entries 16 and 5.25) in float32,
    # against lax.conv in float64: the transforms may cost accuracy, but not more than a few
    # times the direct sum's rounding.
    rng = np.random.default_rng(6)
    x = rng.normal(size=(10, 12, 12, 32))
    k = rng.uniform(-1, 1, size=(5, 5, 32, 64)) / np.sqrt(800)
    with jax.enable_x64(True):
        want = np.asarray(jax.lax.conv_general_dilated(
            x, k, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")))
    x32, k32 = jnp.asarray(x, jnp.float32), jnp.asarray(k, jnp.float32)
    scale = np.max(np.abs(want))
    err_winograd = np.max(np.abs(np.asarray(models.conv2d_winograd(x32, k32)) - want)) / scale
    err_im2col = np.max(np.abs(np.asarray(models.conv2d_im2col(x32, k32)) - want)) / scale
    assert err_winograd < 1e-5
    assert err_winograd < 8 * err_im2col


@pytest.mark.slow
def test_conv2d_dispatches_to_the_impl_it_names():
    x = jnp.asarray(np.random.default_rng(8).normal(size=(2, 12, 12, 32)), jnp.float32)
    k = jnp.asarray(np.random.default_rng(9).normal(size=(5, 5, 32, 8)) / 30, jnp.float32)
    winograd, im2col = models.conv2d_winograd(x, k), models.conv2d_im2col(x, k)
    assert not np.array_equal(winograd, im2col)         # they round differently
    np.testing.assert_array_equal(models.conv2d(x, k, impl="winograd"), winograd)
    np.testing.assert_array_equal(models.conv2d(x, k, impl="im2col"), im2col)
    np.testing.assert_array_equal(models.conv2d(x, k, strides=(2, 2), impl="winograd"),
                                  models.conv2d_im2col(x, k, strides=(2, 2)))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="auto picks Winograd on CPU only")
def test_conv2d_picks_winograd_where_it_pays():
    uses = models.layers.uses_winograd
    assert uses((5, 5, 32, 64), (1, 1), 8)              # the FedAvg CNN's conv 2
    assert not uses((5, 5, 1, 32), (1, 1), 24)          # its conv 1: kh·C_in = 5 < 8
    assert uses((5, 5, 1, 32), (1, 1), 24, "winograd")
    assert not uses((5, 5, 32, 64), (1, 1), 8, "im2col")
    assert uses((3, 3, 3, 32), (1, 1), 32)              # VGG8's conv 1: kh·C_in = 9
    assert not uses((3, 3, 64, 64), (2, 2), 16)         # strided
    assert not uses((3, 3, 64, 64), (2, 2), 16, "winograd")
    assert not uses((1, 1, 64, 64), (1, 1), 16, "winograd")
    assert not uses((3, 3, 64, 64), (1, 1), 1)         # one output column: 4 products, not 3
    with pytest.raises(ValueError, match="conv impl"):
        uses((3, 3, 64, 64), (1, 1), 16, "fft")
    with pytest.raises(ValueError, match="--conv"):
        models.get("cnn", (28, 28, 1), 10, conv="fft")


@pytest.mark.slow
def test_the_cnn_computes_the_same_function_with_either_conv():
    # Same parameters (structure and values), outputs equal up to float32 rounding.
    x = jnp.asarray(np.random.default_rng(7).normal(size=(3, 28, 28, 1)), jnp.float32)
    by = {conv: models.get("cnn", (28, 28, 1), 10, conv=conv) for conv in ("im2col", "winograd")}
    params = jax.jit(by["im2col"].init)(jax.random.key(0))     # compiled, not op by op
    assert jax.tree.structure(params) == jax.tree.structure(
        jax.eval_shape(by["winograd"].init, jax.random.key(0)))
    winograd, im2col = jax.jit(by["winograd"].apply)(params, x), jax.jit(by["im2col"].apply)(params, x)
    assert not np.array_equal(winograd, im2col)         # the option reached the layers
    np.testing.assert_allclose(winograd, im2col, rtol=1e-4, atol=1e-5)


def test_max_pool_matches_reduce_window():
    x = np.random.default_rng(2).normal(size=(2, 7, 6, 3)).astype(np.float32)
    want = jax.lax.reduce_window(x, -np.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    np.testing.assert_array_equal(models.max_pool_2x2(jnp.asarray(x)), want)


@pytest.mark.parametrize("shape,classes,total", [
    ((32, 32, 3), 10, 878_538), ((32, 32, 3), 100, 924_708),
    ((28, 28, 1), 11, 582_539), ((32, 32, 3), 65, 906_753)])
def test_fedavg_cnn_parameter_counts(shape, classes, total):
    # docs/algorithms/pgfed.md#model: CIFAR10, CIFAR100, OrganAMNIST, Office-home.
    params = jax.eval_shape(models.get("cnn", shape, classes).init, jax.random.key(0))
    assert tree_size(params) == total
    fc1 = 1600 if shape[0] == 32 else 1024
    assert params["Dense_0"]["kernel"].shape == (fc1, 512)


def test_mlp_is_784_100_10():
    params = jax.eval_shape(models.get("mlp", (28, 28, 1), 10).init, jax.random.key(0))
    assert tree_size(params) == 784 * 100 + 100 + 100 * 10 + 10 == 79_510


def _conv(cin, cout, k=3, bias=False):
    return k * k * cin * cout + (cout if bias else 0)


def test_resnet_parameter_counts_from_their_layer_lists():
    gn = lambda c: 2 * c  # GroupNorm scale and bias
    # ResNet-9 (w = 64): prep 3→64, 64→128, res 2×128→128, 128→256, 256→512, res 2×512→512, fc.
    r9 = sum(_conv(a, b) + gn(b) for a, b in [(3, 64), (64, 128), (128, 128), (128, 128),
                                               (128, 256), (256, 512), (512, 512), (512, 512)])
    r9 += 512 * 10 + 10
    assert tree_size(jax.eval_shape(models.get("resnet9", (32, 32, 3), 10).init, jax.random.key(0))) == r9
    # ResNet-18: stem, 4 stages × 2 basic blocks, 1×1 shortcuts at stages 2–4, fc.
    r18 = _conv(3, 64) + gn(64)
    cin = 64
    for w in (64, 128, 256, 512):
        for block in range(2):
            r18 += _conv(cin, w) + gn(w) + _conv(w, w) + gn(w)
            if cin != w:
                r18 += _conv(cin, w, k=1) + gn(w)
            cin = w
    r18 += 512 * 10 + 10
    assert r18 == 11_173_962  # the well-known ResNet-18 (CIFAR) count
    assert tree_size(jax.eval_shape(models.get("resnet18", (32, 32, 3), 10).init, jax.random.key(0))) == r18


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet9", pytest.param("resnet18", marks=pytest.mark.slow)])
def test_small_resnets_are_finite_and_translation_sensitive(name):
    m = models.get(name, (16, 16, 3), 7, width=8)
    forward = jax.jit(lambda x: m.apply(m.init(jax.random.key(0)), x))
    x = jax.random.normal(jax.random.key(1), (2, 16, 16, 3))
    out = forward(x)
    assert out.shape == (2, 7) and bool(jnp.all(jnp.isfinite(out)))
    assert not np.allclose(out[0], out[1])


def test_batchnorm_modules_are_rejected_and_small_inputs_explained():
    class WithBN(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.BatchNorm(use_running_average=False)(x)

    with pytest.raises(ValueError, match="batch_stats"):
        models.from_flax(WithBN(), (4,))
    with pytest.raises(ValueError, match="at least 16x16"):
        models.get("cnn", (8, 8, 1), 10)
    with pytest.raises(ValueError, match="unknown --model"):
        models.get("vgg", (8, 8, 1), 10)


@pytest.mark.parametrize("rows", [pytest.param(1, marks=pytest.mark.slow), 10,
                                  pytest.param(16, marks=pytest.mark.slow), 17,
                                  pytest.param(40, marks=pytest.mark.slow)])
@pytest.mark.slow
def test_dense_kernel_gradient_equals_autodiff_of_the_matmul(x64, rows):
    # The custom VJP (outer-product sum for ≤ 16 rows, dot above) against autodiff of x @ W,
    # for batched (3-D) inputs too, and under vmap over clients.
    from fedjax_pfl.models.layers import OUTER_PRODUCT_MAX_ROWS, matmul_small_batch_grad
    assert OUTER_PRODUCT_MAX_ROWS == 16
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.normal(size=(rows, 7)))
    w = jnp.asarray(rng.normal(size=(7, 5)))
    g = jnp.asarray(rng.normal(size=(rows, 5)))
    loss = lambda f: (lambda x, w: jnp.sum(f(x, w) * g))
    got = jax.grad(loss(matmul_small_batch_grad), argnums=(0, 1))(x, w)
    want = jax.grad(loss(jnp.matmul), argnums=(0, 1))(x, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    x3 = x.reshape(1, rows, 7)
    got3 = jax.grad(lambda w: jnp.sum(matmul_small_batch_grad(x3, w)))(w)
    np.testing.assert_allclose(got3, jnp.sum(x, 0)[:, None] * jnp.ones((1, 5)), rtol=1e-12)
    per_client = jax.vmap(jax.grad(lambda w, x: jnp.sum(jnp.tanh(matmul_small_batch_grad(x, w)))))
    ws, xs = jnp.stack([w, 2 * w]), jnp.stack([x, -x])
    ref = jax.vmap(jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w))))(ws, xs)
    np.testing.assert_allclose(per_client(ws, xs), ref, rtol=1e-12, atol=1e-12)
