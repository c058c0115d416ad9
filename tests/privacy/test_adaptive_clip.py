"""Adaptive clipping (`--dp-clip-quantile γ`, core/server.py's adaptive_clip link; Andrew et al.,
NeurIPS 2021, Algorithm 1): C_{t+1} = C_t·exp(−η(b̃_t − γ)) with b̃_t = (Σ_k 1[‖Δ_k‖ ≤ C_t] +
N(0, σ_b²))/D; the updates noised with z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2), so that z, the accounted
noise multiplier, covers both releases."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import linear_model, make_data

from fedjax_pfl import algorithms
from fedjax_pfl.algorithms import engine as engine_lib
from fedjax_pfl.core import server
from fedjax_pfl.ops import dp

# The quick suite keeps the clip's update against the update norms (fixed sampling) and the
# refusals; the full suite runs every test.

SIZES = [12, 30, 7, 19, 25, 3, 40, 11, 9, 22]
HP = dict(participation=0.5, batch_size=4, lr=0.1, local_steps=2)


def _algo(**hp):
    return algorithms.get("fedavg", model=linear_model(), **{**HP, **hp})


@pytest.mark.parametrize("sampling", ["fixed", pytest.param("poisson", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_the_clip_follows_the_count_of_unclipped_updates(sampling):
    """Without noise (z = 0, so σ_b = 0): b_t is the number of participants whose update norm,
    computed here in float64 from each client trained alone, is within C_t, over D (M, or q·N
    under Poisson sampling, whose empty slots count for nothing)."""
    data = make_data(SIZES).pad_clients(1, minimum=1)
    algo = _algo(dp_clip=0.2, dp_clip_quantile=0.3, dp_clip_lr=0.7, sampling=sampling)
    state = jax.jit(algo.init)(jax.random.key(0), data)
    key = jax.random.key(3)
    after, metrics = jax.jit(algo.round_fn)(state, data, key)
    ids = np.asarray(metrics["sampled"])
    if sampling == "poisson":
        assert np.sum(ids >= len(SIZES)) > 0              # empty slots in this round
    ids = jnp.asarray(ids[ids < len(SIZES)])
    engine = engine_lib.Engine(linear_model(), engine_lib.EngineConfig(**HP))
    rnd = engine_lib.Round(data, key, ids, {"train": jax.random.split(key)[1]})
    trained = engine.train(rnd, state.params, shared_start=True)
    norms = np.sqrt(sum(((np.asarray(rows, np.float64) - np.asarray(start, np.float64)) ** 2)
                        .reshape(len(ids), -1).sum(axis=1)
                        for rows, start in zip(jax.tree.leaves(trained.params),
                                               jax.tree.leaves(state.params))))
    within = np.sum(norms <= 0.2)
    assert 0 < within < len(ids)                      # the case tells the update apart
    b = within / (HP["participation"] * len(SIZES))   # D = M = q·N = 5 here
    assert float(metrics["dp_clip"]) == pytest.approx(0.2)
    assert float(metrics["dp_unclipped_noisy"]) == pytest.approx(b)
    assert float(after.server["adaptive_clip"].clip) == pytest.approx(0.2 * math.exp(-0.7 * (b - 0.3)), rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("clip, factor", [(1e-6, math.exp(0.2 * 0.5)),      # all clipped: b = 0
                                          (1e6, math.exp(-0.2 * 0.5))])     # none: b = 1
def test_the_geometric_step_in_closed_form(clip, factor):
    data = make_data(SIZES)
    algo = _algo(dp_clip=clip, dp_clip_quantile=0.5)
    state = jax.jit(algo.init)(jax.random.key(0), data)
    step = jax.jit(algo.round_fn)
    clips = []
    for r in range(3):
        state, _ = step(state, data, jax.random.key(r))
        clips.append(float(state.server["adaptive_clip"].clip))
    np.testing.assert_allclose(clips, clip * factor ** np.arange(1, 4), rtol=1e-5)


@pytest.mark.slow
def test_the_count_noise_has_standard_deviation_sigma_b():
    """σ_b = D/20 by default (D = M = 5 here): b̃·D − Σ 1[‖Δ‖ ≤ C] over 2,000 keys has standard
    deviation σ_b, within 5 standard errors (σ·5/√(2n))."""
    data = make_data(SIZES)
    algo = _algo(dp_clip=0.4, dp_clip_quantile=0.5, dp_noise_multiplier=0.1)
    state = jax.jit(algo.init)(jax.random.key(0), data)
    keys = jax.random.split(jax.random.key(9), 2000)
    _, m = jax.jit(jax.vmap(algo.round_fn, in_axes=(None, None, 0)))(state, data, keys)
    within = np.round((1 - np.asarray(m["dp_clipped_fraction"], np.float64)) * 5)
    noise = np.asarray(m["dp_unclipped_noisy"], np.float64) * 5 - within
    sigma = 5 / 20
    assert abs(noise.mean()) <= 5 * sigma / math.sqrt(len(keys))
    assert abs(noise.std() - sigma) <= 5 * sigma / math.sqrt(2 * len(keys))


@pytest.mark.slow
def test_a_round_is_the_fixed_clip_round_at_its_clip_with_the_update_noise():
    """Round t of the adaptive algorithm equals the fixed-clip private round at C_t with noise
    multiplier z_Δ (to float rounding: z_Δ is computed in float32 inside the round); and z_Δ
    with σ_b gives back the accounted z."""
    data = make_data(SIZES)
    z, sigma = 0.2, 5 / 20
    z_delta = (z ** -2 - (2 * sigma) ** -2) ** -0.5
    assert (z_delta ** -2 + (2 * sigma) ** -2) ** -0.5 == pytest.approx(z)
    assert float(dp.update_noise_multiplier(z, sigma)) == pytest.approx(z_delta)
    adaptive = _algo(dp_clip=0.4, dp_clip_quantile=0.5, dp_noise_multiplier=z)
    state = jax.jit(adaptive.init)(jax.random.key(0), data)
    state, _ = jax.jit(adaptive.round_fn)(state, data, jax.random.key(1))
    clip = float(state.server["adaptive_clip"].clip)
    fixed = _algo(dp_clip=clip, dp_noise_multiplier=float(np.float32(z_delta)))
    after, _ = jax.jit(adaptive.round_fn)(state, data, jax.random.key(2))
    want, _ = jax.jit(fixed.round_fn)(state._replace(server={}), data, jax.random.key(2))
    for a, b in zip(jax.tree.leaves(after.params), jax.tree.leaves(want.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("hp, words", [
    ({"dp_clip_quantile": 0.5}, "needs --dp-clip"),
    ({"dp_clip": float("inf"), "dp_clip_quantile": 0.5}, "finite --dp-clip"),
    ({"dp_clip": 1.0, "dp_clip_quantile": 1.5}, "in \\(0, 1\\)"),
])
def test_adaptive_clipping_settings_that_cannot_apply_are_refused(hp, words):
    with pytest.raises(ValueError, match=words):
        _algo(**hp)


def test_the_count_noise_must_exceed_half_the_noise_multiplier():
    algo = _algo(dp_clip=1.0, dp_clip_quantile=0.5, dp_noise_multiplier=1.0)   # σ_b = 5/20
    with pytest.raises(ValueError, match="must exceed z/2"):
        algo.init(jax.random.key(0), make_data(SIZES))
    ok = _algo(dp_clip=1.0, dp_clip_quantile=0.5, dp_noise_multiplier=1.0, dp_count_noise=0.6)
    ok.init(jax.random.key(0), make_data(SIZES))


@pytest.mark.slow
def test_evaluation_is_the_plain_algorithms():
    """Ditto's evaluation (split into the rows a round changes and the rest) under adaptive
    clipping: the fixed-clip algorithm's evaluation of the same models, entry for entry (the
    clip is server state; it changes no model's evaluation)."""
    data = make_data(SIZES)
    plain = algorithms.get("ditto", model=linear_model(), **HP, dp_clip=0.2)
    algo = algorithms.get("ditto", model=linear_model(), **HP, dp_clip=0.2, dp_clip_quantile=0.5)
    state = jax.jit(algo.init)(jax.random.key(0), data)
    state, _ = jax.jit(algo.round_fn)(state, data, jax.random.key(1))
    want = plain.evaluate(state._replace(server={}), data)
    parts = algo.evaluate_parts
    for got in (algo.evaluate(state, data),
                {**parts.rows(state, data), **parts.rest(state, data)}):
        assert set(got) == set(want)
        for name in want:
            for a, b in zip(jax.tree.leaves(got[name]), jax.tree.leaves(want[name]), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_client_state_on_the_host_gives_the_same_run(tmp_path):
    """The wrapper keeps the algorithm's declaration that it touches client rows only at the
    round's participants: Ditto with adaptive clipping and --state-placement host writes the
    rows of device placement."""
    import json

    from fedjax_pfl import runner

    rows = {}
    for placement in ("device", "host"):
        out = tmp_path / placement
        cfg = runner.RunConfig(algo="ditto", rounds=3, eval_every=3, out=str(out),
                               progress=False, state_placement=placement, model="logreg",
                               memory_check=False,
                               hparams={**HP, "dp_clip": 0.2, "dp_clip_quantile": 0.5,
                                        "dp_noise_multiplier": 0.1, "dp_count_noise": 1.0})
        runner.run(cfg, data=make_data(SIZES), data_info={}, log=lambda *_: None)
        rows[placement] = [{k: v for k, v in json.loads(line).items() if k != "round_time"}
                           for line in (out / "metrics.jsonl").read_text().splitlines()]
    # To float rounding: at the suite's fast-compile XLA settings (tests/conftest.py) the two
    # placements' programs round differently by an ulp, plain Ditto's too; they agree bit for
    # bit at XLA's defaults (tests/core/test_state_placement.py compares them there).
    for host, device in zip(rows["host"], rows["device"], strict=True):
        assert set(host) == set(device)
        for k, v in device.items():
            if k != "round_time":
                assert host[k] == (pytest.approx(v, rel=1e-6) if isinstance(v, float) else v), k
    assert len({r["dp_clip"] for r in rows["device"]}) == 3


@pytest.mark.slow
def test_the_count_noise_is_drawn_apart_from_the_update_noise():
    """The link chain of adaptive clipping on zero updates (all M = 4 within C_0, so b̃·D =
    M + σ_b·η) and a fixed noise multiplier: the update noise ε (the new model times D/(zC))
    is the Gaussian of the round key's DP_NOISE stream, as `noised_mean` documents, and the
    count's η the normal of its own DP_COUNT_NOISE stream, not a draw of the update noise's
    key; over 4,000 round keys η is uncorrelated with every coordinate of ε (|r| < 5/sqrt(n),
    the standard error of a sample correlation of independent normals)."""
    m, z, c0, sigma_b = 4, 0.7, 1.3, 0.9
    start = {"a": jnp.zeros((3,), jnp.float32), "b": jnp.zeros((2, 2), jnp.float32)}
    clients = jax.tree.map(lambda x: jnp.zeros((m, *x.shape), x.dtype), start)
    links = server.chain(server.adaptive_clip(c0, quantile=0.5, lr=0.2, count_noise=sigma_b),
                         server.noised_mean(z), server.apply_update())
    state = links.init(start)

    def one(key):
        context = server.Context(key=key, slots=m, mask=None, expected=float(m))
        model, _, metrics = links(start, clients, None, state, context)
        eps = jnp.concatenate([x.ravel() for x in jax.tree.leaves(model)]) * m / (z * c0)
        eta = (metrics["dp_unclipped_noisy"] * m - m) / sigma_b
        return eps, eta

    key = jax.random.key(5)
    eps, eta = jax.jit(one)(key)
    noise_key = jax.random.fold_in(key, server.DP_NOISE)
    want = dp.gaussian_noise(noise_key, start, 1.0)
    np.testing.assert_allclose(np.asarray(eps), np.concatenate(
        [np.asarray(x).ravel() for x in jax.tree.leaves(want)]), rtol=1e-4, atol=1e-5)
    own = float(jax.random.normal(jax.random.fold_in(key, server.DP_COUNT_NOISE), ()))
    assert float(eta) == pytest.approx(own, rel=1e-4, abs=1e-4)
    assert float(eta) != pytest.approx(float(jax.random.normal(noise_key, ())), abs=1e-3)
    rounds = 4000
    eps, eta = jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(6), rounds))
    eps, eta = np.asarray(eps, np.float64), np.asarray(eta, np.float64)
    for j in range(eps.shape[1]):
        assert abs(np.corrcoef(eps[:, j], eta)[0, 1]) < 5 / math.sqrt(rounds), j
