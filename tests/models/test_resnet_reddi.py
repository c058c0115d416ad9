"""resnet18_reddi: Reddi et al. 2021's CIFAR-100 ResNet-18 (google-research/federated's
`create_resnet18`), checked against hand counts and float64 NumPy references of its layers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfl import models
from fedjax_pfl.models.resnet_reddi import ResNet18Reddi
from fedjax_pfl.ops import tree_size


def _hand_count(num_classes: int = 100) -> int:
    """Parameters of the repository's ResNet-18, layer by layer: a k×k conv has k·k·c_in·c_out
    weights (no bias), a GroupNorm 2·c (scale, bias), the Dense 512·C + C."""
    conv = lambda k, cin, cout: k * k * cin * cout  # noqa: E731
    gn = lambda c: 2 * c  # noqa: E731
    total = conv(7, 3, 64) + gn(64)                      # stem: 7×7/2 conv → GN → ReLU → pool
    cin = 64
    for stage, w in enumerate((64, 128, 256, 512)):
        for block in range(2):
            if (stage, block) != (0, 0):
                total += gn(cin)                         # pre-activation GN of the block input
            total += conv(3, cin, w) + gn(w) + conv(3, w, w)
            if cin != w:
                total += conv(1, cin, w) + gn(w)         # projection shortcut, stages 2–4
            cin = w
    return total + gn(512) + 512 * num_classes + num_classes   # final GN, Dense


@pytest.mark.slow
def test_parameter_count_equals_the_hand_count():
    assert _hand_count() == 11_227_812
    for side in (32, 24):   # GAP head: the count does not depend on the image size
        m = models.get("resnet18_reddi", (side, side, 3), 100)
        assert tree_size(jax.eval_shape(m.init, jax.random.key(0))) == _hand_count()
    m10 = models.get("resnet18_reddi", (32, 32, 3), 10)
    assert tree_size(jax.eval_shape(m10.init, jax.random.key(0))) == _hand_count(10)


@pytest.mark.parametrize("side", [32, 24])
def test_logits_shape(side):
    m = models.get("resnet18_reddi", (side, side, 3), 100)
    params = jax.eval_shape(m.init, jax.random.key(0))
    out = jax.eval_shape(m.apply, params, jax.ShapeDtypeStruct((5, side, side, 3), jnp.float32))
    assert out.shape == (5, 100)


def _np_group_norm(x, groups=32, eps=1e-3):
    """tfa GroupNormalization at init (scale 1, bias 0) in float64: per example and group of
    C/groups consecutive channels, (x − mean) / sqrt(var + eps) over H, W and the group."""
    b, h, w, c = x.shape
    g = np.asarray(x, np.float64).reshape(b, h, w, groups, c // groups)
    mean = g.mean(axis=(1, 2, 4), keepdims=True)
    var = g.var(axis=(1, 2, 4), keepdims=True)
    return ((g - mean) / np.sqrt(var + eps)).reshape(b, h, w, c)


def _np_max_pool_3x3_s2_same(x):
    """TF's MaxPooling2D(3, 2, 'same'): pad total max((⌈H/2⌉−1)·2 + 3 − H, 0), low half first."""
    b, h, w, c = x.shape
    ho, wo = -(-h // 2), -(-w // 2)
    ph, pw = max((ho - 1) * 2 + 3 - h, 0), max((wo - 1) * 2 + 3 - w, 0)
    xp = np.full((b, h + ph, w + pw, c), -np.inf)
    xp[:, ph // 2: ph // 2 + h, pw // 2: pw // 2 + w] = x
    return np.stack([[xp[:, 2 * i: 2 * i + 3, 2 * j: 2 * j + 3].max(axis=(1, 2))
                      for j in range(wo)] for i in range(ho)]).transpose(2, 0, 1, 3)


@pytest.fixture(scope="module")
def captured():
    """One forward pass on a 24×24 batch (the crop's shape) with every submodule's output."""
    module = ResNet18Reddi(100, conv="im2col")   # one path: quicker to compile
    x = jax.random.normal(jax.random.key(1), (2, 24, 24, 3))
    variables = jax.jit(module.init)(jax.random.key(0), x[:1])
    forward = jax.jit(lambda v, x: module.apply(v, x, capture_intermediates=True,
                                                mutable=["intermediates"]))
    out, state = forward(variables, x)
    inter = jax.tree.map(np.asarray, state["intermediates"])
    return np.asarray(x), jax.tree.map(np.asarray, variables["params"]), inter, np.asarray(out)


def _out(inter, *path):
    node = inter
    for p in path:
        node = node[p]
    return node["__call__"][0]


@pytest.mark.slow   # shares a ~13 s forward pass (fixture `captured`)
def test_stem_and_stage_spatial_sizes(captured):
    _, _, inter, out = captured
    assert _out(inter, "HeConv_0").shape == (2, 12, 12, 64)         # 24 → 12 (7×7/2, SAME)
    widths = (64, 64, 128, 128, 256, 256, 512, 512)
    for i, w in enumerate(widths):                                   # 12 → 6 (pool), no stride after
        assert _out(inter, f"PreActBlock_{i}").shape == (2, 6, 6, w)
    assert out.shape == (2, 100)
    full = jax.eval_shape(ResNet18Reddi(100).init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
    assert full["params"]["HeConv_0"]["kernel"].shape == (7, 7, 3, 64)


@pytest.mark.slow   # shares a ~13 s forward pass (fixture `captured`)
def test_stem_conv_is_7x7_stride_2_with_tf_same_padding(captured):
    x, params, inter, _ = captured
    k = params["HeConv_0"]["kernel"].astype(np.float64)
    # TF SAME at 24, k 7, s 2: output 12, padding total (12−1)·2 + 7 − 24 = 5, low 2, high 3.
    xp = np.pad(x.astype(np.float64), ((0, 0), (2, 3), (2, 3), (0, 0)))
    for i, j in [(0, 0), (5, 7), (11, 11)]:
        ref = np.einsum("bpqc,pqco->bo", xp[:, 2 * i: 2 * i + 7, 2 * j: 2 * j + 7], k)
        np.testing.assert_allclose(_out(inter, "HeConv_0")[:, i, j], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.slow   # shares a ~13 s forward pass (fixture `captured`)
def test_group_norms_have_32_groups_and_tfa_epsilon(captured):
    _, _, inter, _ = captured
    np.testing.assert_allclose(_out(inter, "GroupNorm_0"), _np_group_norm(_out(inter, "HeConv_0")),
                               rtol=1e-4, atol=1e-4)
    # inside a block: the second conv's pre-activation GN, on 128 channels (4 per group)
    blk = inter["PreActBlock_3"]
    np.testing.assert_allclose(_out(blk, "GroupNorm_1"), _np_group_norm(_out(blk, "HeConv_0")),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.slow   # shares a ~13 s forward pass (fixture `captured`)
def test_max_pool_and_identity_shortcut(captured):
    _, _, inter, _ = captured
    # Block 0 (no pre-activation, 64 → 64): out = pool(ReLU(GN(stem))) + its second conv's output.
    pooled = _np_max_pool_3x3_s2_same(np.maximum(_np_group_norm(_out(inter, "HeConv_0")), 0))
    residual = _out(inter, "PreActBlock_0", "HeConv_1")
    np.testing.assert_allclose(_out(inter, "PreActBlock_0"), pooled + residual, rtol=1e-4, atol=1e-4)
    # its first conv reads the pooled stem directly (no GN → ReLU in front of it)
    assert "GroupNorm_0" in inter["PreActBlock_0"] and "GroupNorm_1" not in inter["PreActBlock_0"]
    # Block 1: pre-activated, identity shortcut.
    np.testing.assert_allclose(_out(inter, "PreActBlock_1"),
                               _out(inter, "PreActBlock_0") + _out(inter, "PreActBlock_1", "HeConv_1"),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.slow   # shares a ~13 s forward pass (fixture `captured`)
def test_projection_shortcut_reads_the_raw_input(captured):
    _, params, inter, _ = captured
    x_in = _out(inter, "PreActBlock_1").astype(np.float64)          # 64 channels into stage 2
    w = params["PreActBlock_2"]["HeConv_2"]["kernel"].astype(np.float64)
    assert w.shape == (1, 1, 64, 128)
    shortcut = _np_group_norm(x_in @ w[0, 0])                        # GN(conv1×1(x)), not of ReLU(GN(x))
    residual = _out(inter, "PreActBlock_2", "HeConv_1")
    np.testing.assert_allclose(_out(inter, "PreActBlock_2"), shortcut + residual, rtol=1e-4, atol=1e-4)
    assert "HeConv_2" not in inter["PreActBlock_3"]                 # same shape: identity


@pytest.mark.slow   # shares a ~13 s forward pass (fixture `captured`)
def test_head_is_final_gn_relu_average_pool_dense(captured):
    _, params, inter, out = captured
    feats = np.maximum(_np_group_norm(_out(inter, "PreActBlock_7")), 0).mean(axis=(1, 2))
    head = params["Head_0"]
    np.testing.assert_allclose(out, feats @ head["kernel"] + head["bias"], rtol=1e-4, atol=1e-5)
    assert np.all(head["bias"] == 0) and 0.005 < head["kernel"].std() < 0.015   # N(0, 0.01²)


def test_width_and_norm_do_not_apply():
    with pytest.raises(ValueError, match="resnet18_reddi.*width=32"):
        models.get("resnet18_reddi", (32, 32, 3), 100, width=32)
    with pytest.raises(ValueError, match="norm='none'"):
        models.get("resnet18_reddi", (32, 32, 3), 100, norm="none")
