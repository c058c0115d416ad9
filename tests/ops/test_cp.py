"""CP ops against naive numpy references (docs/algorithms/tdpfed.md#tests, T1–T12,
T16–T18, T26–T28)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_pfl import ops


def factors_np(shape, rank, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(n, rank)) for n in shape]


def naive_reconstruct(factors):
    """x[i1..iN] = Σ_r Π_n A^(n)[i_n, r], by explicit loops over every index and rank."""
    shape = tuple(f.shape[0] for f in factors)
    rank = factors[0].shape[1]
    out = np.zeros(shape)
    for idx in itertools.product(*map(range, shape)):
        out[idx] = sum(np.prod([f[i, r] for f, i in zip(factors, idx)]) for r in range(rank))
    return out


def kr_np(mats):
    """Khatri–Rao product, the first matrix slowest (numpy, independent of ops.khatri_rao)."""
    out = mats[0]
    for m in mats[1:]:
        out = np.einsum("ir,jr->ijr", out, m).reshape(-1, m.shape[1])
    return out


def unfold_np(x, n):
    return np.moveaxis(x, n, 0).reshape(x.shape[n], -1)


@pytest.mark.parametrize("shape", [(4, 3), (3, 4, 2), (2, 3, 4, 3)])
def test_reconstruct_matches_nested_loops(x64, shape):
    f = factors_np(shape, 3)
    got = ops.cp_reconstruct([jnp.asarray(a) for a in f])
    assert got.shape == shape
    np.testing.assert_allclose(got, naive_reconstruct(f), rtol=1e-12, atol=1e-12)


def test_order_two_is_a_matrix_product_and_rank_one_an_outer_product(x64):
    a1, a2 = factors_np((5, 4), 3)
    np.testing.assert_allclose(ops.cp_reconstruct([a1, a2]), a1 @ a2.T, rtol=1e-12)
    u, v, w = factors_np((2, 3, 4), 1)
    np.testing.assert_allclose(ops.cp_reconstruct([u, v, w]),
                               np.einsum("i,j,k->ijk", u[:, 0], v[:, 0], w[:, 0]), rtol=1e-12)


def test_additive_over_rank_and_multilinear(x64):
    f = factors_np((3, 4, 2), 5, seed=1)
    left = [a[:, :2] for a in f]
    right = [a[:, 2:] for a in f]
    np.testing.assert_allclose(ops.cp_reconstruct(f),
                               ops.cp_reconstruct(left) + ops.cp_reconstruct(right), rtol=1e-12)
    g = factors_np((3, 4, 2), 5, seed=2)
    mixed = [f[0] + 2.5 * g[0], f[1], f[2]]
    np.testing.assert_allclose(ops.cp_reconstruct(mixed),
                               ops.cp_reconstruct(f) + 2.5 * ops.cp_reconstruct([g[0], f[1], f[2]]),
                               rtol=1e-12, atol=1e-12)


def test_gauge_invariances(x64):
    f = factors_np((3, 4, 5), 4, seed=3)
    ref = ops.cp_reconstruct(f)
    scaled = [f[0].copy(), f[1].copy(), f[2]]
    scaled[0][:, 1] *= 3.0
    scaled[1][:, 1] /= 3.0
    perm = np.array([2, 0, 3, 1])
    flipped = [-f[0], -f[1], f[2]]
    for g in (scaled, [a[:, perm] for a in f], flipped):
        np.testing.assert_allclose(ops.cp_reconstruct(g), ref, rtol=1e-12, atol=1e-12)
        theta = np.random.default_rng(0).normal(size=ref.shape)
        np.testing.assert_allclose(ops.cp_fit_loss(g, theta), ops.cp_fit_loss(f, theta), rtol=1e-12)


@pytest.mark.parametrize("shape", [(4, 3), (3, 4, 2), (2, 3, 4, 3)])
def test_unfolding_convention(x64, shape):
    """C-order unfolding pairs with the INCREASING-order Khatri–Rao product
    (docs/algorithms/tdpfed.md#cp); the paper's reverse order (Kolda's Fortran convention) must not
    match it."""
    f = factors_np(shape, 3, seed=4)
    x = np.asarray(ops.cp_reconstruct(f))
    for n in range(len(shape)):
        others = [a for m, a in enumerate(f) if m != n]
        np.testing.assert_allclose(unfold_np(x, n), f[n] @ kr_np(others).T, rtol=1e-10)
        np.testing.assert_allclose(ops.unfold(x, n), unfold_np(x, n))
        np.testing.assert_allclose(ops.khatri_rao(others), kr_np(others), rtol=1e-12)
        np.testing.assert_allclose(ops.mttkrp(x, f, n), unfold_np(x, n) @ kr_np(others), rtol=1e-10)
        if len(others) > 1:
            reverse = f[n] @ kr_np(others[::-1]).T
            assert np.abs(unfold_np(x, n) - reverse).max() > 1e-3


def test_gram_identity(x64):
    f = factors_np((3, 4, 5, 2), 3, seed=5)
    for n in range(4):
        h = kr_np([a for m, a in enumerate(f) if m != n])
        np.testing.assert_allclose(ops.hadamard_gram(f, n), h.T @ h, rtol=1e-10)


@pytest.mark.parametrize("shape", [(5, 4), pytest.param((3, 3, 4, 2), marks=pytest.mark.slow)])
@pytest.mark.slow
def test_fit_gradient_closed_form(x64, shape):
    """∇_{A^(n)} ½‖θ − ⟦A⟧‖² = A^(n)V_n − θ_(n)H_n = unfold(⟦A⟧ − θ, n) H_n (T16), and
    jax.grad of the naive objective agrees; the paper's eq. (15) sign does not (T17)."""
    f = factors_np(shape, 3, seed=6)
    theta = np.random.default_rng(7).normal(size=shape)

    def naive_loss(factors):  # elementwise sum over the rank, written without ops
        recon = sum(_outer([a[:, r] for a in factors]) for r in range(3))
        return 0.5 * jnp.sum((theta - recon) ** 2)

    autodiff = jax.grad(naive_loss)([jnp.asarray(a) for a in f])
    closed = ops.cp_fit_grad(f, theta)
    x = naive_reconstruct(f)
    for n in range(len(shape)):
        h = kr_np([a for m, a in enumerate(f) if m != n])
        np.testing.assert_allclose(closed[n], autodiff[n], rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(closed[n], unfold_np(x - theta, n) @ h, rtol=1e-9, atol=1e-9)
        paper_eq15 = unfold_np(theta, n) @ h + f[n] @ (h.T @ h)
        assert np.abs(paper_eq15 - np.asarray(autodiff[n])).max() > 1e-2
    # A small step along −∇ decreases the fit loss.
    step = [a - 1e-3 * g for a, g in zip(f, closed)]
    assert ops.cp_fit_loss(step, theta) < ops.cp_fit_loss(f, theta)
    # modes=(n,) keeps only factor n's gradient.
    only = ops.cp_fit_grad(f, theta, modes=(1,))
    np.testing.assert_allclose(only[1], closed[1])
    assert all(np.all(np.asarray(g) == 0) for m, g in enumerate(only) if m != 1)


def _outer(vectors):
    out = vectors[0]
    for v in vectors[1:]:
        out = out[..., None] * v
    return out


@pytest.mark.slow
def test_fixed_point_does_not_move_under_gd_or_adam(x64):
    f = [jnp.asarray(a) for a in factors_np((4, 3, 2), 2, seed=8)]
    theta = ops.cp_reconstruct(f)
    grads = ops.cp_fit_grad(f, theta)
    for g in grads:
        np.testing.assert_allclose(g, 0.0, atol=1e-12)
    # The gradient is zero up to rounding (~1e-16): GD moves by η·g, fresh Adam by at most
    # η·|g|/ε (ε = 1e-8), both negligible.
    for opt, bound in ((optax.sgd(0.1), 1e-15), (optax.adam(0.1), 1e-7)):
        updates, _ = opt.update(list(grads), opt.init(f), f)
        for u in updates:
            np.testing.assert_allclose(u, 0.0, atol=bound)


def test_exact_representability(x64):
    rng = np.random.default_rng(9)
    w = rng.normal(size=(6, 3)) @ rng.normal(size=(3, 5))          # rank 3
    u, s, vt = np.linalg.svd(w)
    a1, a2 = u[:, :3] * np.sqrt(s[:3]), vt[:3].T * np.sqrt(s[:3])
    np.testing.assert_allclose(ops.cp_reconstruct([a1, a2]), w, atol=1e-12)
    # Any N-way tensor with R = Π_{m≠n} I_m: A^(n) = the mode-n fibres, the others one-hot.
    x = rng.normal(size=(2, 3, 4))
    n = 2
    fibres = unfold_np(x, n)                                         # [4, 6]
    cols = list(itertools.product(range(2), range(3)))
    onehot0 = np.array([[1.0 if c[0] == i else 0.0 for c in cols] for i in range(2)])
    onehot1 = np.array([[1.0 if c[1] == j else 0.0 for c in cols] for j in range(3)])
    np.testing.assert_allclose(ops.cp_reconstruct([onehot0, onehot1, fibres]), x, atol=1e-12)


def test_adam_factor_fitting_recovers_a_low_rank_tensor():
    """Gradient-based CP fitting (what TDPFed's factor steps do) reaches 1e-3 relative error on
    an exactly rank-2 tensor at rank 3 within a fixed budget (T9)."""
    target = ops.cp_reconstruct([jnp.asarray(a, jnp.float32) for a in factors_np((5, 4, 3), 2, 10)])
    f = [jnp.asarray(0.5 * a, jnp.float32) for a in factors_np((5, 4, 3), 3, seed=11)]
    opt = optax.adam(0.02)
    state = opt.init(f)

    @jax.jit
    def step(f, state):
        updates, state = opt.update(list(ops.cp_fit_grad(f, target)), state, f)
        return optax.apply_updates(f, updates), state

    for _ in range(3000):
        f, state = step(f, state)
    assert float(ops.cp_relative_error(f, target)) < 1e-3


@pytest.mark.slow
def test_als_recovers_an_exact_rank_r_tensor_to_float32_precision():
    true = [jnp.asarray(a, jnp.float32) for a in factors_np((6, 5, 4), 3, seed=12)]
    x = ops.cp_reconstruct(true)
    rng = np.random.default_rng(13)
    init = [a + 0.2 * jnp.asarray(rng.normal(size=a.shape), jnp.float32) for a in true]
    fitted, err = jax.jit(ops.cp_als, static_argnums=(1, 3))(x, 3, init, 100)
    assert float(err) < 1e-5
    np.testing.assert_allclose(float(err), float(ops.cp_relative_error(fitted, x)), rtol=1e-6)
    # Vmappable: a batch of two tensors fitted at once gives the same as one by one.
    xs = jnp.stack([x, 2 * x])
    inits = [jnp.stack([a, a]) for a in init]
    batched, errs = jax.vmap(lambda t, *i: ops.cp_als(t, 3, i, 100))(xs, *inits)
    np.testing.assert_allclose(batched[0][0], fitted[0], rtol=1e-4, atol=1e-5)
    assert float(errs[1]) < 1e-5


def test_als_with_rank_above_a_mode_size_stays_finite():
    x = ops.cp_reconstruct([jnp.asarray(a, jnp.float32) for a in factors_np((3, 3, 4), 2, 14)])
    init = [jnp.asarray(a, jnp.float32) for a in factors_np((3, 3, 4), 7, seed=15)]  # R = 7 > 4
    fitted, err = ops.cp_als(x, 7, init, 50)
    assert np.isfinite(float(err)) and float(err) < 1e-3


# Table I of the paper: (dims, R1 at ×1.5, R2 at ×2); dims as our kernels store them.
TABLE_I = {
    "DNN fc1": ((784, 100), 59, 44), "DNN fc2": ((100, 10), 6, 5),
    "VGG conv1": ((3, 3, 3, 32), 14, 11), "VGG conv2": ((3, 3, 32, 64), 120, 90),
    "VGG conv3": ((3, 3, 64, 128), 248, 186), "VGG conv4": ((3, 3, 128, 256), 504, 378),
    "VGG conv5": ((3, 3, 256, 256), 759, 569), "VGG fc1": ((256, 256), 85, 64),
    "VGG fc2": ((256, 256), 85, 64), "VGG fc3": ((256, 10), 6, 5),
}


@pytest.mark.parametrize("layer", sorted(TABLE_I))
def test_rank_rule_reproduces_table_one(layer):
    dims, r1, r2 = TABLE_I[layer]
    assert ops.cp_rank_for_compression(dims, 1.5) == r1
    assert ops.cp_rank_for_compression(dims, 2.0) == r2
    # Floor would give a different rank for three of the twenty entries
    # (docs/algorithms/tdpfed.md#ranks).
    assert ops.cp_num_params(dims, r2) == r2 * sum(dims)


def test_weight_totals_and_overall_compression():
    """T12: DNN 52,816 / 39,446 CP weights vs 79,400; VGG8 740,276 / 555,487 vs 1,111,392."""
    for model, r1_total, r2_total, dense_total in (("DNN", 52_816, 39_446, 79_400),
                                                   ("VGG", 740_276, 555_487, 1_111_392)):
        layers = [v for k, v in TABLE_I.items() if k.startswith(model)]
        assert sum(int(np.prod(d)) for d, _, _ in layers) == dense_total
        assert sum(ops.cp_num_params(d, r1) for d, r1, _ in layers) == r1_total
        assert sum(ops.cp_num_params(d, r2) for d, _, r2 in layers) == r2_total


def test_afm_equals_act_when_clients_differ_in_one_mode_only(x64):
    """Multilinearity (T26): averaging factors that differ in ONE mode equals averaging
    the reconstructed tensors; with two differing modes it does not; and a sign-flipped gauge
    makes factor averaging collapse (T27)."""
    f = factors_np((3, 4, 2), 2, seed=16)
    g = [f[0], factors_np((4,), 2, seed=17)[0], f[2]]
    afm = ops.cp_reconstruct([(a + b) / 2 for a, b in zip(f, g)])
    act = (ops.cp_reconstruct(f) + ops.cp_reconstruct(g)) / 2
    np.testing.assert_allclose(afm, act, rtol=1e-12, atol=1e-12)
    h = [factors_np((3,), 2, seed=18)[0], g[1], f[2]]
    afm2 = ops.cp_reconstruct([(a + b) / 2 for a, b in zip(f, h)])
    assert np.abs(afm2 - (ops.cp_reconstruct(f) + ops.cp_reconstruct(h)) / 2).max() > 1e-3
    flipped = [-f[0], -f[1], f[2]]
    np.testing.assert_allclose(ops.cp_reconstruct([(a + b) / 2 for a, b in zip(f, flipped)]), 0.0,
                               atol=1e-12)


def test_compression_records_the_rate_used_where_the_rank_rule_clamps_to_one():
    """784-100-10 (TDPFed's MLP) at CR 20: 78400/(20·884) = 4.43 → R = 4; 1000/(20·110) = 0.45
    rounds to 0, kept at 1 (clamped). Used: (78400 + 1000) / (4·884 + 1·110) = 79400/3646."""
    from fedjax_pfl.ops.cp import compression

    got = compression({"Dense_0/kernel": (784, 100), "Dense_1/kernel": (100, 10)}, 20.0)
    assert got == {"given": 20.0, "used": pytest.approx(79400 / 3646),
                   "ranks": {"Dense_0/kernel": 4, "Dense_1/kernel": 1},
                   "clamped": ["Dense_1/kernel"]}
    # CR 2 (Table I: ranks 44 and 5): nothing clamped, the rate used ~2 by the rounding alone
    table = compression({"a": (784, 100), "b": (100, 10)}, 2.0)
    assert table["ranks"] == {"a": 44, "b": 5} and table["clamped"] == []
    assert table["used"] == pytest.approx(79400 / (44 * 884 + 5 * 110))
    # exactly half rounds up to rank 1: not clamped (1000/(CR·110) = 0.5 at CR = 1000/55)
    assert compression({"b": (100, 10)}, 1000 / 55)["clamped"] == []
