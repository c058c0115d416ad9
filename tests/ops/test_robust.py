"""Robust aggregators (`ops.robust`) against brute-force float64 NumPy references written here
from the papers' definitions: sorted columns for the median and the trimmed mean, every subset
of neighbours for Krum's scores, Bulyan's recursion and coordinate stage spelled out, the
smoothed Weiszfeld iteration, centered clipping and norm bounding as their equations; the
properties that pin them (β = 0 is the mean, Multi-Krum with m = M and f = 0 is the mean, the
median of identical updates is that update, a large radius is the weighted mean); masked slots
never influence a result, even holding NaN."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfl.ops import robust

M = 9


def updates(m=M, seed=0, outliers=()):
    """A two-leaf tree of m updates ([m, 3, 2] and [m, 4]), the `outliers` rows far away."""
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=(m, 3, 2)), rng.normal(size=(m, 4))
    for i in outliers:
        a[i] += 40.0
        b[i] -= 25.0
    return {"a": jnp.asarray(a, jnp.float32), "b": jnp.asarray(b, jnp.float32)}


def flat(tree, m=None) -> np.ndarray:
    """[m, d] float64 (or [d] for a tree without the client axis)."""
    leaves = jax.tree.leaves(tree)
    if m is None:
        return np.concatenate([np.asarray(x, np.float64).ravel() for x in leaves])
    return np.concatenate([np.asarray(x, np.float64).reshape(m, -1) for x in leaves], axis=1)


WEIGHTS = jnp.asarray([3.0, 1.0, 7.0, 2.0, 5.0, 1.0, 4.0, 6.0, 2.0], jnp.float32)


# -- references (float64, the papers' definitions) ----------------------------------------------


def ref_median(x):
    s = np.sort(x, axis=0)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def ref_trimmed(x, beta):
    n = len(x)
    k = int(np.floor(beta * n + 1e-9))
    s = np.sort(x, axis=0)
    return s[k:n - k].mean(axis=0)


def ref_krum_scores(x, f):
    """Every subset of n − f − 2 others: the score is the smallest sum of squared distances."""
    n = len(x)
    k = n - f - 2
    scores = []
    for i in range(n):
        others = [j for j in range(n) if j != i]
        d = {j: float(np.sum((x[i] - x[j]) ** 2)) for j in others}
        scores.append(min(sum(d[j] for j in subset) for subset in itertools.combinations(others, k)))
    return np.array(scores)


def ref_multi_krum(x, f, m):
    order = np.argsort(ref_krum_scores(x, f), kind="stable")
    return x[order[:m]].mean(axis=0), set(order[:m].tolist())


def ref_bulyan(x, f):
    n = len(x)
    theta, beta = n - 2 * f, n - 4 * f
    remaining, chosen = list(range(n)), []
    for _ in range(theta):
        scores = ref_krum_scores(x[remaining], f) if len(remaining) - f - 2 > 0 else np.zeros(
            len(remaining))
        pick = remaining[int(np.argmin(scores))]
        chosen.append(pick)
        remaining.remove(pick)
    sel = np.sort(x[sorted(chosen)], axis=0)
    med = ref_median(sel)
    out = np.empty(x.shape[1])
    for j in range(x.shape[1]):
        order = np.argsort(np.abs(sel[:, j] - med[j]), kind="stable")
        out[j] = sel[order[:beta], j].mean()
    return out, set(chosen)


def ref_weiszfeld(x, alpha, iters, nu):
    alpha = alpha / alpha.sum()
    v = alpha @ x
    for _ in range(iters):
        b = alpha / np.maximum(nu, np.linalg.norm(x - v, axis=1))
        v = (b / b.sum()) @ x
    return v


def ref_centered_clip(x, alpha, v, tau, iters):
    alpha = alpha / alpha.sum()
    for _ in range(iters):
        z = x - v
        norms = np.linalg.norm(z, axis=1)
        t = np.median(norms) if tau is None else tau
        v = v + alpha @ (z * np.minimum(1.0, t / norms)[:, None])
    return v


def ref_norm_bound(x, alpha, radius):
    alpha = alpha / alpha.sum()
    norms = np.linalg.norm(x, axis=1)
    rho = np.median(norms) if radius is None else radius
    return alpha @ (x / np.maximum(1.0, norms / rho)[:, None])


def close(got, want, rtol=2e-5, atol=2e-6):
    np.testing.assert_allclose(flat(got), want, rtol=rtol, atol=atol)


# -- each rule against its reference ------------------------------------------------------------


@pytest.mark.parametrize("m", [M, 8])
def test_median_is_the_sorted_columns_middle(m):
    u = updates(m)
    close(robust.coordinate_median(u), ref_median(flat(u, m)), atol=0)


@pytest.mark.parametrize("beta", [0.0, 0.12, 0.3, 0.45])
def test_trimmed_mean_is_the_mean_of_the_middle_of_the_sorted_columns(beta):
    u = updates()
    close(robust.trimmed_mean(u, beta), ref_trimmed(flat(u, M), beta))


@pytest.mark.parametrize("f", [0, 1, 2, 3])
def test_krum_scores_are_the_best_subset_of_neighbours(f):
    u = updates(outliers=(2, 6))
    np.testing.assert_allclose(np.asarray(robust.krum_scores(u, f)),
                               ref_krum_scores(flat(u, M), f), rtol=2e-5, atol=1e-4)


@pytest.mark.parametrize("f,m", [(1, 1), (2, 1), (2, 4), (2, None), (3, 6)])
def test_krum_and_multi_krum_average_the_lowest_scored(f, m):
    u = updates(outliers=(0, 5))
    x = flat(u, M)
    want, chosen = ref_multi_krum(x, f, M - f if m is None else m)
    assert not chosen & {0, 5}                           # the outliers are never chosen
    got = robust.krum(u, f) if m == 1 else robust.multi_krum(u, f, m)
    close(got, want)
    assert set(np.flatnonzero(np.asarray(robust.krum_select(u, f, m))).tolist()) == chosen


@pytest.mark.parametrize("f", [0, 1, 2])
@pytest.mark.slow
def test_bulyan_recursive_krum_then_the_values_nearest_the_median(f):
    u = updates(m=11, seed=3, outliers=(4,))
    x = flat(u, 11)
    want, chosen = ref_bulyan(x, f)
    assert set(np.flatnonzero(np.asarray(robust.bulyan_select(u, f))).tolist()) == chosen
    close(robust.bulyan(u, f), want)


@pytest.mark.parametrize("iters", [1, 3, 20])
def test_geometric_median_is_the_smoothed_weiszfeld_iteration(iters):
    u = updates(outliers=(3,))
    x = flat(u, M)
    close(robust.geometric_median(u, WEIGHTS, iters=iters, nu=1e-6),
          ref_weiszfeld(x, np.asarray(WEIGHTS, np.float64), iters, 1e-6))


def test_geometric_median_many_steps_minimises_the_weighted_distance_sum():
    """An independent check of the fixed point: no small move lowers Σ α_i ‖v − x_i‖."""
    u = updates(outliers=(3,))
    x, a = flat(u, M), np.asarray(WEIGHTS, np.float64)
    v = flat(robust.geometric_median(u, WEIGHTS, iters=200))
    cost = lambda y: a @ np.linalg.norm(x - y, axis=1)
    rng = np.random.default_rng(1)
    for _ in range(20):
        step = rng.normal(size=v.shape) * 1e-2
        assert cost(v + step) >= cost(v) - 1e-6


@pytest.mark.parametrize("tau,iters", [(0.5, 1), (2.0, 3), (None, 2)])
def test_centered_clip_follows_its_iteration(tau, iters):
    u = updates(outliers=(1,))
    x = flat(u, M)
    center = jax.tree.map(lambda l: 0.3 * l[4], u)
    close(robust.centered_clip(u, center, WEIGHTS, tau=tau, iters=iters),
          ref_centered_clip(x, np.asarray(WEIGHTS, np.float64), flat(center), tau, iters))


@pytest.mark.parametrize("radius", [0.5, 2.0, None])
def test_norm_bound_clips_each_update_then_takes_the_weighted_mean(radius):
    u = updates(outliers=(7,))
    close(robust.norm_bound(u, WEIGHTS, radius=radius),
          ref_norm_bound(flat(u, M), np.asarray(WEIGHTS, np.float64), radius))


# -- properties ---------------------------------------------------------------------------------


def test_trimmed_mean_with_beta_zero_is_the_uniform_mean():
    u = updates()
    close(robust.trimmed_mean(u, 0.0), flat(u, M).mean(axis=0))


def test_multi_krum_with_m_all_and_f_zero_is_the_mean():
    u = updates(outliers=(2,))
    close(robust.multi_krum(u, f=0, m=M), flat(u, M).mean(axis=0))


def test_bulyan_with_f_zero_is_the_mean():
    u = updates()
    close(robust.bulyan(u, 0), flat(u, M).mean(axis=0))


@pytest.mark.slow
def test_the_median_of_identical_updates_is_that_update_bit_for_bit():
    """(and Krum's choice; the averaging rules to rounding: a mean of 3 equal floats is not
    always the float)"""
    one = updates(1, seed=4)
    same = jax.tree.map(lambda x: jnp.repeat(x, 7, axis=0), one)
    for got in (robust.coordinate_median(same), robust.coordinate_median(
            jax.tree.map(lambda x: x[:6], same)), robust.krum(same, 1)):
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(one), strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w[0]))
    for got in (robust.trimmed_mean(same, 0.2), robust.bulyan(same, 1),
                robust.geometric_median(same), robust.multi_krum(same, 1)):
        close(got, flat(one))


def test_norm_bound_and_centered_clip_with_a_large_radius_are_the_weighted_mean():
    u = updates(outliers=(2,))
    want = (np.asarray(WEIGHTS, np.float64) / float(np.sum(WEIGHTS))) @ flat(u, M)
    close(robust.norm_bound(u, WEIGHTS, radius=1e9), want)
    zero = jax.tree.map(lambda x: jnp.zeros_like(x[0]), u)
    close(robust.centered_clip(u, zero, WEIGHTS, tau=1e9, iters=1), want)


def test_the_unweighted_rules_ignore_the_weights():
    u = updates(outliers=(2,))
    for kind in ("median", "trimmed_mean", "krum", "multi_krum", "bulyan"):
        a = robust.aggregate(kind, u, None, f=1)
        b = robust.aggregate(kind, u, WEIGHTS, f=1)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_the_robust_rules_hold_against_far_outliers():
    """Two of eleven updates 40 away: the mean moves by ~9, the robust rules stay near the
    others' (within their spread, ~1)."""
    u = updates(m=11, outliers=(2, 6))
    honest = np.delete(flat(u, 11), [2, 6], axis=0).mean(axis=0)
    assert np.abs(flat(u, 11).mean(axis=0) - honest).max() > 5
    center = jax.tree.map(lambda x: jnp.zeros_like(x[0]), u)
    for kind in robust.AGGREGATORS[1:]:
        got = flat(robust.aggregate(kind, u, None, f=2, beta=0.25, center=center, tau=1.0,
                                    radius=3.0, iters=None))
        assert np.abs(got - honest).max() < 1.5, kind


# -- masks --------------------------------------------------------------------------------------

MASK = np.array([1, 0, 1, 1, 0, 1, 1, 1, 1], bool)       # seven participants


@pytest.mark.parametrize("kind", robust.AGGREGATORS[1:])
@pytest.mark.slow
def test_masked_slots_never_influence_the_result(kind):
    """The masked rule equals the rule on the participants alone, and the empty slots' contents
    (here NaN, and then huge values) change nothing."""
    u = updates(outliers=(5,))
    kept = jax.tree.map(lambda x: x[MASK], u)
    w_kept = WEIGHTS[MASK]
    center = jax.tree.map(lambda x: 0.1 * x[0], u)
    settings = dict(f=1, m=4, beta=0.15, center=center, tau=1.5, iters=3)
    want = robust.aggregate(kind, kept, w_kept, **settings)
    mask = jnp.asarray(MASK)
    for junk in (np.nan, 1e30):
        dirty = jax.tree.map(lambda x: jnp.where(
            mask.reshape((-1,) + (1,) * (x.ndim - 1)), x, junk), u)
        got = jax.jit(lambda u, w, mk: robust.aggregate(kind, u, w, mk, **settings))(
            dirty, WEIGHTS, mask)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-6,
                                       err_msg=f"{kind} junk={junk}")


def test_an_empty_masked_round_aggregates_to_zero():
    u = updates()
    mask = jnp.zeros((M,), bool)
    for kind in ("median", "trimmed_mean", "geomed", "norm_bound"):
        got = robust.aggregate(kind, u, None, mask)
        assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(got)), kind


# -- refusals -----------------------------------------------------------------------------------


def test_too_few_clients_for_f_is_refused_in_one_line():
    u = updates(m=6)
    with pytest.raises(ValueError, match=r"^krum with f = 2 needs n > 2f \+ 2: at least 7 "
                                         r"clients a round, got 6$"):
        robust.krum(u, 2)
    with pytest.raises(ValueError, match=r"^bulyan with f = 1 needs n >= 4f \+ 3"):
        robust.bulyan(u, 1)
    with pytest.raises(ValueError, match=r"^beta must be in \[0, 0.5\), got 0.5$"):
        robust.trimmed_mean(u, 0.5)


def test_default_f_is_the_most_the_rule_tolerates():
    assert [robust.default_f("krum", m) for m in (3, 4, 5, 10, 100)] == [0, 0, 1, 3, 48]
    assert [robust.default_f("bulyan", m) for m in (3, 6, 7, 10, 100)] == [0, 0, 1, 1, 24]
    for m in (3, 5, 10, 100):
        robust.check_f("krum", robust.default_f("krum", m), m)
        robust.check_f("bulyan", robust.default_f("bulyan", m), m)
        with pytest.raises(ValueError):
            robust.check_f("krum", robust.default_f("krum", m) + 1, m)
