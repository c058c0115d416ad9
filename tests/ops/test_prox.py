"""prox_norm, soft_threshold, project_l1_ball: docs/algorithms/fedpc.md#f1 and T1.

Expected values come from scipy's generic SLSQP on the epigraph form (tests/support/convex_reference.py) and
from a bisection on the ℓ1-ball threshold, both in float64.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from convex_reference import norm_epigraph_minimize, norm_np

from fedjax_pfl.ops import prox


def draft_w_update(v, tau, p):
    """The draft's W-column formula (1 − 1/‖(ρ/λ)v‖_q)_+ v with τ = λ/ρ, for comparison only."""
    q = {"1": np.inf, "2": 2, "inf": 1}[p]
    norm_q = np.linalg.norm(v / tau, ord=q)
    return max(1.0 - 1.0 / norm_q, 0.0) * v


def bisection_l1_projection(v, radius):
    """Proj onto {‖w‖₁ ≤ r}: sign(v) max(|v| − θ, 0) with θ found by bisection on
    Σ max(|v_i| − θ, 0) = r (no sorting)."""
    a = np.abs(v)
    if a.sum() <= radius:
        return v.copy()
    lo, hi = 0.0, a.max()
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if np.maximum(a - mid, 0).sum() > radius else (lo, mid)
    return np.sign(v) * np.maximum(a - 0.5 * (lo + hi), 0.0)


class ProxNormTest(parameterized.TestCase):
    @chex.variants(with_jit=True)
    @parameterized.product(p=("1", "2", "inf"), tau=(0.0, 0.3, 1.0, 5.0), seed=(0,))
    def test_matches_brute_force_convex_solve(self, p, tau, seed):
        v = np.random.default_rng(seed).normal(size=5) * 1.5
        expected = norm_epigraph_minimize(np.eye(5), -v, [np.eye(5)], tau, p, x0=v)
        with jax.enable_x64(True):
            got = np.asarray(self.variant(prox.prox_norm, static_argnums=2)(jnp.asarray(v), tau, p))
        np.testing.assert_allclose(got, expected, atol=1e-7)
        objective = lambda w: tau * norm_np(w, p) + 0.5 * np.sum((w - v) ** 2)
        assert objective(got) <= objective(expected) + 1e-12

    @parameterized.parameters("1", "inf")
    def test_the_drafts_formula_is_wrong_for_p_1_and_inf(self, p):
        # [fix] (1 − 1/‖(ρ/λ)v‖_q)_+ v is the prox only for p = 2.
        v = np.array([2.0, -0.5, 0.3, 1.2])
        tau = 0.4
        expected = norm_epigraph_minimize(np.eye(4), -v, [np.eye(4)], tau, p, x0=v)
        with jax.enable_x64(True):
            np.testing.assert_allclose(prox.prox_norm(jnp.asarray(v), tau, p), expected, atol=1e-7)
        assert np.abs(draft_w_update(v, tau, p) - expected).max() > 0.1

    def test_the_drafts_formula_is_right_for_p_2(self):
        v = np.array([2.0, -0.5, 0.3, 1.2])
        with jax.enable_x64(True):
            np.testing.assert_allclose(prox.prox_norm(jnp.asarray(v), 0.4, 2),
                                       draft_w_update(v, 0.4, "2"), rtol=1e-12)

    def test_hand_cases(self):
        v = jnp.array([3.0, -1.0, 0.5])
        np.testing.assert_allclose(prox.soft_threshold(v, 1.0), [2.0, 0.0, 0.0])
        # p = 2: ‖v‖ = √10.25; τ = 1 scales by 1 − 1/√10.25.
        np.testing.assert_allclose(prox.prox_norm(v, 1.0, 2), (1 - 1 / np.sqrt(10.25)) * v, rtol=1e-6)
        # p = ∞: subtract the projection on the ℓ1 ball of radius 1 = [1, 0, 0] (θ = 2).
        np.testing.assert_allclose(prox.prox_norm(v, 1.0, "inf"), [2.0, -1.0, 0.5], rtol=1e-6)
        # τ ≥ dual norm of v: the prox is 0 (‖v‖_∞ = 3 for p = 1, ‖v‖₁ = 4.5 for p = ∞).
        np.testing.assert_allclose(prox.prox_norm(v, 3.0, 1), 0.0)
        np.testing.assert_allclose(prox.prox_norm(v, 4.5, np.inf), 0.0, atol=1e-6)

    @parameterized.parameters("1", "2", "inf")
    def test_moreau_decomposition(self, p):
        # v = prox_{τ‖·‖_p}(v) + τ·Proj_{‖·‖_q ≤ 1}(v/τ), with each projection written directly.
        v = np.random.default_rng(3).normal(size=7)
        tau = 0.6
        u = v / tau
        proj = {"1": np.clip(u, -1, 1), "2": u / max(1.0, np.linalg.norm(u)),
                "inf": bisection_l1_projection(u, 1.0)}[p]
        with jax.enable_x64(True):
            got = np.asarray(prox.prox_norm(jnp.asarray(v), tau, p))
        np.testing.assert_allclose(got + tau * proj, v, atol=1e-10)


class ProjectL1BallTest(parameterized.TestCase):
    @parameterized.product(radius=(0.1, 1.0, 3.0, 100.0), seed=(0, 1, 2))
    def test_matches_bisection(self, radius, seed):
        v = np.random.default_rng(seed).normal(size=9)
        with jax.enable_x64(True):
            got = np.asarray(prox.project_l1_ball(jnp.asarray(v), radius))
        np.testing.assert_allclose(got, bisection_l1_projection(v, radius), atol=1e-10)
        assert np.abs(got).sum() <= radius + 1e-9

    def test_edge_cases(self):
        v = jnp.array([0.2, -0.1])
        np.testing.assert_array_equal(prox.project_l1_ball(v, 1.0), v)          # inside: v itself
        np.testing.assert_array_equal(prox.project_l1_ball(v, 0.0), [0.0, 0.0])
        np.testing.assert_allclose(prox.project_l1_ball(jnp.array([1.0, 1.0]), 1.0), [0.5, 0.5])
        assert prox.project_l1_ball(jnp.zeros((0,)), 1.0).shape == (0,)


@pytest.mark.parametrize("p", ["1", "2", "inf"])
@pytest.mark.slow
def test_vmaps_over_the_columns_of_a_d2_by_m_matrix(p):
    v = jnp.asarray(np.random.default_rng(4).normal(size=(6, 5)), jnp.float32)    # d2 = 6, M = 5
    tau = jnp.float32(0.7)
    batched = jax.vmap(prox.prox_norm, in_axes=(1, None, None), out_axes=1)(v, tau, p)
    one = jax.jit(prox.prox_norm, static_argnums=2)
    for m in range(5):
        np.testing.assert_allclose(batched[:, m], one(v[:, m], tau, p), rtol=1e-6)


def test_norm_order_names():
    assert [prox.norm_order(p) for p in (1, 2.0, np.inf, "inf", "2")] == ["1", "2", "inf", "inf", "2"]
    with pytest.raises(ValueError, match="p must be one of 1, 2, inf, got 3"):
        prox.norm_order(3)
