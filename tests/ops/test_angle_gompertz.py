"""Angle, Gompertz weight and blend: docs/algorithms/pfedsop.md#tests, T1–T10 and T33."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from jax.flatten_util import ravel_pytree

from fedjax_pfl import ops

LAMBDAS = (0.5, 1.0, 2.5, 5.0)
PHIS = (0.0, np.pi / 4, 1.0, np.pi / 2, 2.0, 3 * np.pi / 4, np.pi)
# docs/algorithms/pfedsop.md#t3, computed in float64 from β = 1 − exp(−exp(−λ(φ − 1))).
TABLE = {
    0.5: (0.807704, 0.671517, 0.632121, 0.528443, 0.454761, 0.398051, 0.290174),
    1.0: (0.934012, 0.710433, 0.632121, 0.431683, 0.307799, 0.227126, 0.110831),
    2.5: (0.999995, 0.819138, 0.632121, 0.213396, 0.078806, 0.033131, 0.004718),
    5.0: (1.000000, 0.946291, 0.632121, 0.055986, 0.006715, 0.001135, 0.000022),
}


def numpy_beta(phi, lam):
    return 1.0 - np.exp(-np.exp(-lam * (phi - 1.0)))


class GompertzTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*LAMBDAS)
    def test_reference_table(self, lam):
        got = self.variant(ops.gompertz_weight)(jnp.asarray(PHIS), lam)
        np.testing.assert_allclose(got, TABLE[lam], atol=5e-7)
        np.testing.assert_allclose(got, numpy_beta(np.asarray(PHIS), lam), rtol=1e-5, atol=1e-7)

    def test_bounds_and_monotone_decreasing(self):
        phi = jnp.linspace(0, np.pi, 2001)
        for lam in LAMBDAS + (0.1, 10.0):
            beta = np.asarray(ops.gompertz_weight(phi, lam), np.float64)
            assert np.all((beta >= 0) & (beta <= 1))
            np.testing.assert_allclose(beta[0], 1 - np.exp(-np.exp(lam)), rtol=1e-5)
            np.testing.assert_allclose(beta[-1], numpy_beta(np.pi, lam), rtol=1e-4, atol=1e-12)
            strict = beta[(beta > 1e-6) & (beta < 1 - 1e-6)]
            assert np.all(np.diff(strict) < 0)

    def test_behaviour_in_lambda(self):
        lams = np.array([0.5, 1.0, 2.0, 4.0])
        np.testing.assert_allclose(ops.gompertz_weight(1.0, lams), 1 - 1 / np.e, rtol=1e-6)
        assert np.all(np.diff(ops.gompertz_weight(0.6, lams)) > 0)   # φ < 1: grows with λ
        assert np.all(np.diff(ops.gompertz_weight(1.4, lams)) < 0)   # φ > 1: shrinks with λ
        half = 1 - np.log(np.log(2)) / lams
        np.testing.assert_allclose(ops.gompertz_weight(half, lams), 0.5, rtol=1e-6)

    def test_not_the_literal_latex_parse(self):
        # T7: 1 − e^{eλ(φ−1)} would give −3.7189 at φ = π/2, λ = 1.
        beta = float(ops.gompertz_weight(np.pi / 2, 1.0))
        assert beta == pytest.approx(0.431683, abs=1e-6)
        assert beta != pytest.approx(1 - np.exp(np.e * (np.pi / 2 - 1)), abs=1e-3)


class AngleTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_bounds_and_exact_copy(self):
        rng = np.random.default_rng(0)
        for _ in range(20):
            a = {"w": jnp.asarray(rng.normal(size=(7, 3)), jnp.float32),
                 "b": jnp.asarray(rng.normal(size=5), jnp.float32)}
            b = jax.tree.map(lambda x: x * 3.0 + 0.1, a)
            sim = self.variant(ops.cosine_similarity)(a, b)
            phi = self.variant(ops.cosine_angle)(a, b)
            assert -1 <= float(sim) <= 1 and 0 <= float(phi) <= np.pi
        a = {"w": jnp.asarray(rng.normal(size=10_000), jnp.float32) * 1e3}
        phi = float(self.variant(ops.cosine_angle)(a, a))
        assert not np.isnan(phi) and phi == pytest.approx(0.0, abs=1e-3)

    def test_zero_vector_gives_right_angle_without_nan(self):
        zero, v = {"w": jnp.zeros(3)}, {"w": jnp.array([1.0, 2.0, 3.0])}
        assert float(ops.cosine_angle(zero, v)) == pytest.approx(np.pi / 2)
        assert float(ops.cosine_angle(zero, zero)) == pytest.approx(np.pi / 2)
        g = jax.grad(lambda z: ops.cosine_angle({"w": z}, v))(jnp.zeros(3))
        assert np.all(np.isfinite(g))

    def test_scale_invariance_and_symmetry(self):
        rng = np.random.default_rng(1)
        a = {"w": jnp.asarray(rng.normal(size=9))}
        b = {"w": jnp.asarray(rng.normal(size=9))}
        base = float(ops.gompertz_weight(ops.cosine_angle(a, b), 1.0))
        scaled = ops.cosine_angle(ops.tree_scale(2.5, a), ops.tree_scale(0.3, b))
        assert float(ops.gompertz_weight(scaled, 1.0)) == pytest.approx(base, rel=1e-5)
        assert float(ops.cosine_similarity(a, b)) == pytest.approx(float(ops.cosine_similarity(b, a)))

    @jax.enable_x64(True)
    def test_global_norms_not_per_layer(self):
        # T33: leaf-wise with global norms equals the ravelled vector; per-layer differs.
        rng = np.random.default_rng(2)
        a = {"w": rng.normal(size=(4, 3)), "b": rng.normal(size=3) * 10}
        b = {"w": rng.normal(size=(4, 3)), "b": rng.normal(size=3)}
        fa, fb = ravel_pytree(a)[0], ravel_pytree(b)[0]
        flat = np.arccos(np.dot(fa, fb) / np.linalg.norm(fa) / np.linalg.norm(fb))
        assert float(ops.cosine_angle(a, b)) == pytest.approx(flat, rel=1e-12)
        per_layer = np.mean([np.arccos(np.dot(a[k].ravel(), b[k].ravel()) /
                                       np.linalg.norm(a[k]) / np.linalg.norm(b[k])) for k in a])
        assert abs(per_layer - flat) > 1e-3


def blend(delta_i, delta_glob, lam=1.0):
    beta = ops.gompertz_weight(ops.cosine_angle(delta_i, delta_glob), lam)
    return ops.tree_lerp(delta_i, delta_glob, beta), beta


@pytest.mark.parametrize("delta_i,delta_glob,beta,expected", [
    ([1.0, 0.0], [0.0, 1.0], 0.431683, [0.568317, 0.431683]),      # T10: φ = π/2
    ([1.0, 0.0], [1.0, 1.0], 0.710433, [1.0, 0.710433]),           # T10: φ = π/4
    ([1.0, 2.0], [-1.0, -2.0], 0.110831, [0.778339, 1.556677]),    # T8: φ = π, Δᵖ = (1 − 2β)Δ_i
])
def test_blend_worked_examples(delta_i, delta_glob, beta, expected):
    got, b = blend({"w": jnp.array(delta_i)}, {"w": jnp.array(delta_glob)})
    assert float(b) == pytest.approx(beta, abs=1e-6)
    np.testing.assert_allclose(got["w"], expected, atol=1e-6)


def test_blend_weights_the_global_update():
    # T8: Δ_i = cΔ (φ = 0) gives (1 − β₀)cΔ + β₀Δ with β₀ = 0.934012.
    d = jnp.array([0.3, -1.2, 2.0])
    got, b = blend({"w": 4.0 * d}, {"w": d})
    assert float(b) == pytest.approx(0.934012, abs=2e-6)
    np.testing.assert_allclose(got["w"], (1 - 0.934012) * 4.0 * d + 0.934012 * d, rtol=1e-5)
    same, _ = blend({"w": d}, {"w": d}, lam=3.0)       # T9: Δ_i == Δ leaves it unchanged
    np.testing.assert_allclose(same["w"], d, rtol=1e-6)
