"""Poisson sampling (`--sampling poisson`, core/poisson.py): each real client takes part
independently with probability q; a round holds K slots, K = min{k : P(Binomial(N, q) > k) ≤
1e-12}, the participants ascending and the empty slots holding a padding client; the private
server step (the server chain's `noised_mean`) adds only the participants' clipped updates and divides
by q·N; the accountant is the Poisson-subsampled Gaussian (add or remove one client)."""

import math

import dp_accounting
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import linear_model, make_data

from fedjax_pfl import algorithms, core
from fedjax_pfl.algorithms import engine as engine_lib
from fedjax_pfl.ops import dp


def _log_binom_tail(n: int, q: float, k: int) -> float:
    """log P(Binomial(n, q) > k) in float64 from log-gamma terms (independent of scipy)."""
    terms = [math.lgamma(n + 1) - math.lgamma(j + 1) - math.lgamma(n - j + 1)
             + j * math.log(q) + (n - j) * math.log1p(-q) for j in range(k + 1, n + 1)]
    if not terms:
        return -math.inf
    top = max(terms)
    return top + math.log(sum(math.exp(t - top) for t in terms))


@pytest.mark.parametrize("n, q", [(100, 0.1), (20, 0.2), (3400, 0.01), (50, 0.9)])
def test_capacity_is_the_smallest_tail_below_the_overflow_probability(n, q):
    k = core.poisson_capacity(n, q)
    bound = math.log(core.OVERFLOW_PROBABILITY)
    assert _log_binom_tail(n, q, k) <= bound < _log_binom_tail(n, q, k - 1)
    assert core.poisson_capacity(n, 1.0) == n


def _draws(n, q, capacity, rounds, seed=0):
    keys = jax.random.split(jax.random.key(seed), rounds)
    fn = jax.jit(jax.vmap(lambda k: core.sample_poisson(k, n, q, capacity, n)))
    return np.asarray(fn(keys))


def test_slots_hold_the_participants_ascending_then_the_padding_client():
    n, q = 30, 0.2
    slots = _draws(n, q, core.poisson_capacity(n, q), 200)
    for row in slots:
        real = row[row < n]
        assert np.all(row[len(real):] == n)                 # empty slots at the end, = pad id
        assert np.all(np.diff(real) > 0)                    # ascending, no client twice


def test_each_client_independently_with_probability_q():
    # R rounds: a client's count of rounds ~ Binomial(R, q); the round's size ~ Binomial(N, q).
    # Tolerances are 5 standard deviations (a fixed seed; a wrong sampler fails by far more).
    n, q, rounds = 40, 0.15, 4000
    slots = _draws(n, q, core.poisson_capacity(n, q), rounds)
    member = np.zeros((rounds, n), bool)
    for r, row in enumerate(slots):
        member[r, row[row < n]] = True
    freq = member.mean(axis=0)
    assert np.all(np.abs(freq - q) <= 5 * math.sqrt(q * (1 - q) / rounds))
    sizes = member.sum(axis=1)
    mean, var = n * q, n * q * (1 - q)
    assert abs(sizes.mean() - mean) <= 5 * math.sqrt(var / rounds)
    # The variance of a Binomial round size (fixed-size sampling would give 0): the sample
    # variance's standard error is about var·sqrt(2/R) (plus the excess kurtosis, small here).
    assert abs(sizes.var() - var) <= 5 * var * math.sqrt(2 / rounds)
    # Independence between clients: P(i and j) = q² for every pair (fixed-size M of N gives
    # M(M−1)/(N(N−1)) instead).
    both = (member.T.astype(float) @ member.astype(float)) / rounds
    pairs = both[~np.eye(n, dtype=bool)]
    assert abs(pairs.mean() - q * q) <= 5 * math.sqrt(q * q / (rounds * n * (n - 1) / 2)) + 1e-3
    # The size's distribution against Binomial(N, q): total variation below 0.05.
    pmf = np.array([math.comb(n, k) * q**k * (1 - q) ** (n - k) for k in range(n + 1)])
    empirical = np.bincount(sizes, minlength=n + 1) / rounds
    assert 0.5 * np.abs(empirical - pmf).sum() < 0.05


def test_an_overflow_keeps_a_uniformly_chosen_capacity_of_the_included():
    n, q, capacity, rounds = 20, 0.5, 3, 3000
    keys = jax.random.split(jax.random.key(1), rounds)
    slots = _draws(n, q, capacity, rounds, seed=1)
    # The inclusion draws (u_i < q, the first of each key's two streams), recomputed here.
    draws = jax.vmap(lambda k: jax.random.uniform(jax.random.split(k)[0], (n,)))(keys)
    counts = np.zeros(n)
    for included, row in zip(np.asarray(draws) < q, slots):
        real = row[row < n]
        assert len(real) == min(included.sum(), capacity)
        assert included[real].all()
        counts[real] += 1
    # Every client equally likely to be kept: each ~ R·K/N (almost every round overflows).
    share = counts / counts.sum()
    assert np.all(np.abs(share - 1 / n) <= 5 * math.sqrt((1 / n) / counts.sum()))


def test_which_clients_an_overflow_keeps_is_independent_of_their_inclusion_draws():
    """Client i is included when its uniform u_i < q; the same key at a lower rate q' (no
    capacity limit) includes exactly those with u_i < q'. Given who was included (m clients, e of
    them also below q'), an overflow keeps a uniformly chosen K of the m whatever their u_i, so
    the number kept from the e is hypergeometric: mean K·e/m, variance
    K·(e/m)(1 − e/m)(m − K)/(m − 1). Summed over the rounds that overflow, the count is within
    5 standard deviations of its mean. (Keeping the K smallest u_i, an overflow choice read from
    the inclusion draw, keeps only clients below q' whenever e ≥ K: a z-score above 100 here.)"""
    n, q, q_low, capacity, rounds = 20, 0.5, 0.25, 3, 3000
    keys = jax.random.split(jax.random.key(4), rounds)
    kept = np.asarray(jax.jit(jax.vmap(lambda k: core.sample_poisson(k, n, q, capacity, n)))(keys))
    every = jax.jit(jax.vmap(lambda k, rate: core.sample_poisson(k, n, rate, n, n),
                             in_axes=(0, None)))
    included, low = np.asarray(every(keys, q)), np.asarray(every(keys, q_low))
    observed = mean = var = 0.0
    overflowed = 0
    for row, inc, lo in zip(kept, included, low):
        row, inc, lo = set(row[row < n]), set(inc[inc < n]), set(lo[lo < n])
        assert lo <= inc and row <= inc and len(row) == min(len(inc), capacity)
        m, e = len(inc), len(lo)
        if m <= capacity:
            continue
        overflowed += 1
        observed += len(row & lo)
        mean += capacity * e / m
        var += capacity * (e / m) * (1 - e / m) * (m - capacity) / (m - 1)
    assert overflowed > 0.9 * rounds
    assert abs(observed - mean) <= 5 * math.sqrt(var), (observed, mean, var)


def test_empty_slots_add_nothing_to_the_clipped_sum():
    rng = np.random.default_rng(0)
    start = {"w": rng.normal(size=(4, 3)).astype(np.float32), "b": rng.normal(size=3).astype(np.float32)}
    models = {k: (v[None] + rng.normal(size=(5, *v.shape))).astype(np.float32)
              for k, v in start.items()}
    mask = np.array([True, False, True, True, False])
    models["w"][1] = np.nan                     # an empty slot's row may be anything, NaN too
    models["b"][4] = np.inf
    clip = 1.5
    total, norms = jax.jit(dp.clipped_update_sum)(models, start, clip, mask)
    want = {k: np.zeros(v.shape) for k, v in start.items()}
    for i in np.flatnonzero(mask):
        delta = {k: models[k][i].astype(np.float64) - start[k] for k in start}
        norm = math.sqrt(sum((d ** 2).sum() for d in delta.values()))
        assert norms[i] == pytest.approx(norm, rel=1e-5)
        for k in start:
            want[k] += delta[k] * min(1.0, clip / norm)
    for k in start:
        np.testing.assert_allclose(total[k], want[k], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(norms)[~mask], 0.0)


SIZES = [12, 30, 7, 19, 25, 3, 40, 11, 9, 22]
HP = dict(participation=0.3, batch_size=4, lr=0.1, local_steps=2, sampling="poisson")


@pytest.mark.slow
def test_the_private_mean_divides_the_participants_updates_by_q_n():
    """FedAvg at C = ∞, z = 0: θ' = θ + Σ_{k∈S} (θ_k − θ)/(q·N), each θ_k trained from θ."""
    data = make_data(SIZES).pad_clients(1, minimum=1)
    algo = algorithms.get("fedavg", model=linear_model(), dp_clip=math.inf, **HP)
    state = jax.jit(algo.init)(jax.random.key(0), data)
    key = jax.random.key(7)
    after, metrics = jax.jit(algo.round_fn)(state, data, key)
    slots = np.asarray(metrics["sampled"])
    real = slots[slots < len(SIZES)]
    assert 0 < len(real) < len(slots) and np.all(slots[len(real):] >= len(SIZES))
    # Each participant's model, trained alone (a client's training does not depend on who else
    # was sampled: its keys fold in its id), from the round's training key.
    engine = engine_lib.Engine(linear_model(), engine_lib.EngineConfig(
        **{k: v for k, v in HP.items() if k != "sampling"}))
    train_key = jax.random.split(key)[1]
    ids = jnp.asarray(real, jnp.int32)
    trained = engine.train(engine_lib.Round(data, key, ids, {"train": train_key}), state.params,
                           shared_start=True)
    q_n = HP["participation"] * len(SIZES)
    for leaf_after, leaf_before, rows in zip(jax.tree.leaves(after.params),
                                             jax.tree.leaves(state.params),
                                             jax.tree.leaves(trained.params)):
        before = np.asarray(leaf_before, np.float64)
        want = before + (np.asarray(rows, np.float64) - before).sum(axis=0) / q_n
        np.testing.assert_allclose(np.asarray(leaf_after), want, rtol=1e-5, atol=1e-6)
    losses = np.asarray(metrics["train_loss"])
    np.testing.assert_allclose(losses[: len(real)], np.asarray(trained.loss), rtol=1e-6)
    assert int(metrics["client_steps"]) == 2 * len(real)    # empty slots take no step


PRIVATE = [n for n in algorithms.names() if algorithms.spec(n).private_uplink]
QUICK = ("scaffold",)                      # (its empty slots' Δc = 0/0 must not leak)
OVERRIDES = {"fedper": {"head": "^b$"},     # as in test_private_uplinks: a non-empty uplink
             "fedavg_sar": {"mask": "fixed"}}  # the same uplink floats for every client
OWN_BOUND = ("feddyn",)                     # θ also moves by −h/α (test_private_server_steps)


@pytest.mark.matrix
@pytest.mark.parametrize("name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow)
                                  for n in PRIVATE])
@pytest.mark.slow
def test_every_private_algorithm_under_poisson_sampling(name):
    """No noise, every update clipped to C: the shared state moves at most C·|S|/(q·N) and stays
    finite (an empty slot's client took no step: SCAFFOLD's Δc would be 0/0); the rows of
    clients that neither took part nor trained are unchanged bit for bit; noise changes the
    shared state and no client row; the comm_* metrics count the participants, not the slots."""
    data = make_data(SIZES).pad_clients(1, minimum=1)
    n_real = len(SIZES)
    hp = {"participation": 0.3, "batch_size": 4, "lr": 0.1,
          **algorithms.spec(name).test_hparams, **OVERRIDES.get(name, {}), "sampling": "poisson"}
    spec = algorithms.spec(name)
    static = spec.resolve({**hp, "dp_clip": 1.0})
    algo = spec.build(linear_model(), static)

    @jax.jit
    def private(clip, z, state, key):
        built = spec.build(linear_model(), {**static, "dp_clip": clip, "dp_noise_multiplier": z})
        return built.round_fn(state, data, key)

    before = jax.device_get(jax.jit(algo.init)(jax.random.key(0), data))
    mask = core.client_mask(before)
    key, clip = jax.random.key(5), 1e-3
    quiet, m_quiet = jax.device_get(private(clip, 0.0, before, key))
    trained = np.asarray(m_quiet.get("trained", []))         # pFedMe, TDPFed: every client
    noisy, m_noisy = jax.device_get(private(clip, 5.0, before, key))
    slots = np.asarray(m_quiet["sampled"])
    took_part = slots[slots < n_real]
    assert len(took_part) > 0 and np.all(slots[len(took_part):] == n_real)
    for leaf in jax.tree.leaves(quiet):
        if jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating):
            assert np.all(np.isfinite(np.asarray(leaf)[:n_real] if leaf.ndim else leaf))
    shared, rows = helpers.shared_floats, helpers.client_rows
    step = math.sqrt(sum(((a - b) ** 2).sum() for a, b in
                         zip(shared(quiet, mask), shared(before, mask))))
    bound = clip * len(took_part) / (hp["participation"] * n_real)
    assert 0 < step <= bound * (1 + 1e-4) or (name in OWN_BOUND and step > 0)
    untouched = np.setdiff1d(np.arange(n_real), np.concatenate([took_part, trained]))
    assert len(untouched) > 0 or len(trained) >= n_real
    for a, b in zip(rows(quiet, mask), rows(before, mask), strict=True):
        np.testing.assert_array_equal(a[untouched], b[untouched])
    assert any(not np.array_equal(a, b) for a, b in
               zip(shared(noisy, mask), shared(quiet, mask)))
    for a, b in zip(rows(noisy, mask), rows(quiet, mask), strict=True):
        np.testing.assert_array_equal(a[:n_real], b[:n_real])
    # The comm_* metrics count the participants, not the K slots: a round of another |S| (same
    # program, another key) sends the same floats per participant (FedAvg-s.a.r.'s "fixed" masks
    # keep as many coordinates for every client); the downlink of those that train every client
    # is unchanged.
    took = lambda m: int(np.sum(np.asarray(m["sampled"]) < n_real))
    other = next(m for m in (jax.device_get(private(clip, 0.0, before, jax.random.key(s)))[1]
                             for s in range(6, 40)) if 0 < took(m) != len(took_part))
    for name_, scale in (("comm_up_floats", took(other) / len(took_part)),
                         ("comm_down_floats", 1.0 if len(trained) else took(other) / len(took_part))):
        assert float(m_quiet[name_]) > 0
        np.testing.assert_allclose(float(other[name_]), float(m_quiet[name_]) * scale, rtol=1e-6)


def test_poisson_sampling_needs_the_private_step_and_a_padding_client():
    with pytest.raises(ValueError, match="--sampling poisson needs --dp-clip"):
        algorithms.get("fedavg", model=linear_model(), sampling="poisson")
    with pytest.raises(ValueError, match="does not privatise"):
        algorithms.get("pgfed", model=linear_model(), sampling="poisson", dp_clip=1.0)
    algo = algorithms.get("fedavg", model=linear_model(), dp_clip=1.0, **HP)
    data = make_data(SIZES)                                   # no padding client
    state = algo.init(jax.random.key(0), data)
    with pytest.raises(ValueError, match="padding client"):
        algo.round_fn(state, data, jax.random.key(1))
    with pytest.raises(ValueError, match="device placement only"):
        core.Program(algo, data, mesh=None, data_placement="host")
    # core.Program gives the data its padding client itself.
    program = core.Program(algo, data, mesh=None)
    assert program.data.num_clients == len(SIZES) + 1
    assert program.data.num_real_clients == len(SIZES)


@pytest.mark.slow
def test_the_run_accounts_poisson_sampling():
    """The run's ε after every round is the Poisson-subsampled Gaussian's (add or remove one),
    dp-accounting's RDP called directly here; its summary with --dp-accountant pld is PLD's."""
    from fedjax_pfl import runner
    from fedjax_pfl.runner import privacy

    n, q, z, rounds, delta = 40, 0.15, 1.3, 5, 1e-4
    cfg = runner.RunConfig(algo="fedavg", rounds=rounds, dp_delta=delta,
                           hparams={"dp_clip": 1.0, "sampling": "poisson", "participation": q,
                                    "dp_noise_multiplier": z})
    hparams = cfg.validate()
    _, plan = privacy.plan(cfg, hparams, n)
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    for t in (1, rounds):
        acc = dp_accounting.rdp.RdpAccountant()               # add or remove one (its default)
        acc.compose(dp_accounting.SelfComposedDpEvent(event, t))
        assert plan.epsilons[t - 1] == pytest.approx(acc.get_epsilon(delta), rel=1e-9)
    record = plan.record(rounds)
    assert (record["sampling"], record["rate"]) == ("poisson", q)
    assert record["slots"] == core.poisson_capacity(n, q)
    assert record["truncation_delta"] == pytest.approx(
        rounds * 1e-12 * (1 + math.exp(record["dp_epsilon"])))
    pld_cfg = runner.RunConfig(algo="fedavg", rounds=rounds, dp_delta=delta,
                               dp_accountant="pld", hparams=cfg.hparams)
    _, pld_plan = privacy.plan(pld_cfg, pld_cfg.validate(), n)
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.SelfComposedDpEvent(event, rounds))
    assert pld_plan.record(rounds)["dp_epsilon"] == pytest.approx(acc.get_epsilon(delta), rel=1e-9)
    assert pld_plan.epsilons == plan.epsilons               # the rows stay RDP's
    fixed = runner.RunConfig(algo="fedavg", rounds=rounds, dp_delta=delta, dp_accountant="pld",
                             hparams={"dp_clip": 1.0, "participation": q})
    with pytest.raises(ValueError, match="use rdp, or sampling poisson"):
        privacy.plan(fixed, fixed.validate(), n)
