"""core.Program: fused rounds, bfloat16 client state, the memory plan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import linear_model, make_data, tree_allclose

from fedjax_pfl import algorithms, core


def program(name, data, **kw):
    algo = algorithms.get(name, model=linear_model(), participation=0.5, batch_size=4, **kw.pop("hp", {}))
    return core.Program(algo, data, mesh=None, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["local", "pfedsop"])
def test_fused_rounds_equal_one_round_per_call(ragged_data, name):
    keys = jax.random.key(3)
    one = program(name, ragged_data)
    fused = program(name, ragged_data, rounds_per_call=3)
    s1, s3 = one.init(jax.random.key(0)), fused.init(jax.random.key(0))
    metrics_one = []
    for r in range(6):
        s1, m = one.run_rounds(s1, keys, r, 1)
        metrics_one += m
    metrics_fused = []
    for r in (0, 3):
        s3, m = fused.run_rounds(s3, keys, r, 3)
        metrics_fused += m
    tree_allclose(s1, s3, rtol=1e-6, atol=1e-7)
    for a, b in zip(metrics_one, metrics_fused):
        np.testing.assert_array_equal(a["sampled"], b["sampled"])
        np.testing.assert_allclose(a["train_loss"], b["train_loss"], rtol=1e-6)


@pytest.mark.slow
def test_bfloat16_state_is_stored_in_bfloat16_and_computed_in_float32(ragged_data):
    p = program("pfedsop", ragged_data, state_dtype="bfloat16")
    state = p.init(jax.random.key(0))
    assert state.clients.x["w"].dtype == jnp.bfloat16            # per-client rows: storage
    assert state.x0["w"].dtype == jnp.float32                    # server-side: unchanged
    assert core.gather(state.clients.x, jnp.array([0, 2]))["w"].dtype == jnp.float32
    state, _ = p.run_rounds(state, jax.random.key(1), 0, 1)
    assert state.clients.x["w"].dtype == jnp.bfloat16            # stays bfloat16 across rounds
    full = program("pfedsop", ragged_data)
    ref, _ = full.run_rounds(full.init(jax.random.key(0)), jax.random.key(1), 0, 1)
    # One round from bfloat16-rounded models: within bfloat16's 8 bits of mantissa.
    np.testing.assert_allclose(np.asarray(state.clients.x["w"], np.float32),
                               np.asarray(ref.clients.x["w"]), rtol=2e-2, atol=2e-2)


@pytest.mark.slow
def test_memory_plan_counts_the_client_state(ragged_data):
    p = program("local", ragged_data, hp={"momentum": 0.9, "momentum_buffer": "persist"})
    p.compile(jax.random.key(0))
    plan = p.memory_plan()
    d = 5 * 3 + 3                                  # linear model: w [5, 3] and b [3]
    assert plan.state_per_client == 2 * 4 * d      # params + momentum buffer, float32
    assert plan.client_state_per_device == 4 * plan.state_per_client
    assert plan.working_set > 0 and plan.devices == 1
    half = program("local", ragged_data, state_dtype="bfloat16",
                   hp={"momentum": 0.9, "momentum_buffer": "persist"}).memory_plan()
    assert half.state_per_client == plan.state_per_client // 2
    tight = core.MemoryPlan(**{**plan.__dict__, "available": plan.total - 1})
    with pytest.raises(core.MemoryPlanError, match="--state-dtype bfloat16"):
        core.check_memory(tight)
    assert tight.max_clients() < 4
    core.check_memory(plan)                          # fits: no error
    assert "per client, sharded" in plan.describe()


@pytest.mark.slow
def test_padding_clients_are_never_sampled_and_not_evaluated():
    data = make_data([7, 23, 12]).pad_clients(4)
    assert data.num_clients == 4 and data.num_real_clients == 3
    algo = algorithms.get("fedavg", model=linear_model(), participation=1.0)
    state = algo.init(jax.random.key(0), data)
    state, m = jax.jit(algo.round_fn)(state, data, jax.random.key(1))
    np.testing.assert_array_equal(m["sampled"], [0, 1, 2])
    ev = algo.evaluate(state, data)["client"]
    assert int(ev.count[3]) == 0 and np.isnan(float(ev.accuracy[3]))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pgfedmo", "tdpfed", "feddyn", "apfl", "fedrod", "fedpc"])
def test_bfloat16_state_runs_every_state_layout(ragged_data, name):
    # α matrices, factor trees, correction states, mixing weights, class priors: every kind of
    # per-client leaf stored in bfloat16 must come back as float32 for the round's loops
    # (pgfedmo once failed: its α block entered a while_loop as bfloat16; fedpc its z rows an
    # ADMM scan).
    half = program(name, ragged_data, state_dtype="bfloat16")
    full = program(name, ragged_data)
    got, _ = half.run_rounds(half.init(jax.random.key(0)), jax.random.key(1), 0, 2)
    ref, _ = full.run_rounds(full.init(jax.random.key(0)), jax.random.key(1), 0, 2)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        if jnp.issubdtype(r.dtype, jnp.floating):
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                       rtol=5e-2, atol=5e-2)


def test_round_keys_of_a_batch_are_each_keys_own_fold():
    """A sweep's runs have one key each: round r's key of key k is fold_in(k, r), key by key."""
    from fedjax_pfl.core.program import round_key

    keys = jnp.stack([jax.random.key(s) for s in (0, 7, 3)])
    got = jax.random.key_data(jax.jit(round_key)(keys, jnp.int32(5)))
    want = np.stack([jax.random.key_data(jax.random.fold_in(jax.random.key(s), 5)) for s in (0, 7, 3)])
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(jax.random.key_data(round_key(jax.random.key(7), 5)), want[1])


def test_the_checks_of_several_iterations_or_their_flags():
    """Row flags (MISSED = 1, CROSSED = 2) of a scan's iterations, or of a sweep's runs split over
    devices, combine bit by bit; misdealt counts add up."""
    from fedjax_pfl.core import checks

    with checks.collecting() as found:
        checks.note_each({"rows": jnp.array([0, 1, 0, 2, 0], jnp.int32),
                          "misdealt": jnp.array([[0, 1], [2, 0]], jnp.int32)})
        checks.note_each({"rows": jnp.array([0, 0], jnp.int32)})
    out = checks.combined(found)
    assert int(out["rows"]) == 3 and out["misdealt"].tolist() == [2, 1]
    with checks.collecting() as found:
        checks.note_each({"rows": jnp.array([2, 0, 2], jnp.int32)})
    assert int(checks.combined(found)["rows"]) == checks.CROSSED
