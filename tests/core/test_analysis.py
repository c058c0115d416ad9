"""Bounds read off a traced program (`core.analysis.traced_bounds`) are upper bounds of what XLA's
memory and cost analyses of the compiled program report, and the automatic chunk size and
evaluation batch skip their compilation only where that makes no difference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfl import core, models
from fedjax_pfl.core import analysis, chunking, evaluate, execution, memo

S = jax.ShapeDtypeStruct
KEY = S((), jax.random.key(0).dtype)


def _mlp_loss(params, x, y):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    logits = h @ params["w2"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


MLP = {"w1": S((64, 32), jnp.float32), "b1": S((32,), jnp.float32), "w2": S((32, 10), jnp.float32)}


def _cnn_step(kernel, x):
    """A convolution, a pool, a dense layer and their gradient with respect to the kernel."""
    def loss(k):
        h = jax.lax.conv_general_dilated(x, k, (1, 1), "VALID",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        h = models.max_pool_2x2(jax.nn.relu(h))
        return jnp.sum(jnp.tanh(h) ** 2)
    return jax.grad(loss)(kernel)


def _masked_sgd(params, x, y, key, t):
    """Random masks (threefry), a scan of steps, a cond, argmax, scatter-add and gather."""
    def step(p, i):
        g = jax.grad(_mlp_loss)(p, x, y)
        keep = jax.random.bernoulli(jax.random.fold_in(key, i), 0.5, p["w1"].shape)
        g = {**g, "w1": jnp.where(keep, g["w1"], 0.0)}
        p = jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
        return p, jnp.argmax(x @ p["w1"], axis=1)
    params, picks = jax.lax.scan(step, params, jnp.arange(3))
    counts = jnp.zeros(32).at[picks.ravel()].add(1.0)
    scale = jax.lax.cond(t > 0, lambda: jnp.float32(2.0), lambda: jnp.arccos(0.5))
    return jax.tree.map(lambda a: a * scale, params), counts[y]


PROGRAMS = {
    "mlp gradient": (jax.grad(_mlp_loss), (MLP, S((16, 64), jnp.float32), S((16,), jnp.int32))),
    "cnn gradient": (_cnn_step, (S((5, 5, 3, 8), jnp.float32), S((4, 12, 12, 3), jnp.float32))),
    "masked sgd": (_masked_sgd, (MLP, S((16, 64), jnp.float32), S((16,), jnp.int32), KEY,
                                 S((), jnp.int32))),
    "random split and bits": (lambda k: jax.random.bits(jax.random.split(k, 64)[3], (256,)),
                              (KEY,)),
    "logistic and argmax": (lambda x: jnp.argmax(jax.nn.sigmoid(x), axis=1),
                            (S((32, 64), jnp.float32),)),
}


def _xla(fn, args):
    compiled = analysis.compiled_for_analysis(fn, *args)
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return memory.temp_size_in_bytes, memory.output_size_in_bytes, cost["flops"]


def _assert_bounds_hold(fn, args):
    """traced_bounds of fn is at least XLA's temporaries, outputs and flops; returns both."""
    temp, out, flops = _xla(fn, args)
    bounds = analysis.traced_bounds(fn, *args)
    assert bounds is not None
    assert bounds.temp_bytes >= temp and bounds.output_bytes >= out and bounds.flops >= flops, (
        bounds, (temp, out, flops))
    return bounds, flops


@pytest.mark.parametrize("name", PROGRAMS)
def test_traced_bounds_hold_xlas_analyses(name):
    bounds, flops = _assert_bounds_hold(*PROGRAMS[name])
    # Bounds, not wild guesses: within a small factor of XLA's flops (they decide chunks).
    assert bounds.flops <= 8 * flops


@pytest.mark.slow
def test_the_engines_own_probes_are_bounded(ragged_data, monkeypatch):
    """The steps the engine actually analyses (PGFed's local step with its α bookkeeping, its
    full pass, evaluation) for the MLP: the bounds hold there too."""
    from fedjax_pfl import algorithms

    seen = []
    original = chunking.traced_chunk_size
    monkeypatch.setattr(execution, "traced_chunk_size",
                        lambda fn, *args, **kw: seen.append((fn, args)) or original(fn, *args, **kw))
    algo = algorithms.get("pgfedmo", model=models.get("mlp", (5,), 3), batch_size=4,
                          participation=0.5, local_steps=3)
    program = core.Program(algo, core.prepare_data(ragged_data, None), mesh=None)
    state, _ = program.run_rounds(program.init(jax.random.key(0)), jax.random.key(1), 0, 1)
    program.evaluate(state)
    assert len(seen) >= 3
    for fn, args in seen:
        _assert_bounds_hold(fn, args)


@pytest.mark.parametrize("fn", [
    lambda x: jax.lax.while_loop(lambda c: c.sum() < 10, lambda c: c + 1, x),   # trip count
    jnp.sort,
    jnp.cumsum,
], ids=["while", "sort", "cumsum"])
def test_unknown_costs_give_no_bound(fn):
    assert analysis.traced_bounds(fn, S((64,), jnp.float32)) is None
    assert chunking.traced_chunk_size(fn, S((64,), jnp.float32)) == 0


def test_traced_chunk_never_exceeds_the_compiled_one():
    for name, (fn, args) in PROGRAMS.items():
        for budgets in ({}, {"temp_budget_bytes": 2**16}, {"flop_target": 2e5}):
            assert (chunking.traced_chunk_size(fn, *args, **budgets)
                    <= chunking.auto_chunk_size(fn, *args, **budgets)), (name, budgets)


def test_automatic_chunk_compiles_only_when_the_bounds_do_not_decide(monkeypatch):
    fn, args = PROGRAMS["mlp gradient"]
    rows = {"x": jnp.zeros((6, 16, 64)), "y": jnp.zeros((6, 16), jnp.int32)}
    one_client = lambda p, r: fn(p, r["x"], r["y"])
    params = jax.tree.map(lambda s: jnp.full(s.shape, 0.01, s.dtype), MLP)
    specs = ((chunking.abstract(params),), (chunking.abstract_row(rows),))
    traced = chunking.traced_chunk_size(one_client, *specs[0], *specs[1],
                                        flop_target=chunking.WORK_TARGET_SLACK * chunking.CHUNK_FLOP_TARGET)
    assert 6 <= traced < 10**6

    calls = []
    real = chunking.compiled_for_analysis
    monkeypatch.setattr(chunking, "compiled_for_analysis",
                        lambda *a: calls.append(a) or real(*a))
    # (no remembered probe: another test of this session may have measured the same one)
    monkeypatch.setattr(memo, "directory", lambda: None)
    cache = execution.MapperCache()           # a mapper's own cache, empty
    # All 6 rows fit by the bounds: the answer is 6 (one chunk), nothing compiled.
    assert cache.auto_chunk(one_client, ("k",), specs, 6) == 6 and not calls
    # More rows than the bounds allow: XLA's analysis decides, as auto_chunk_size.
    many = traced + 1
    got = cache.auto_chunk(one_client, ("k",), specs, many)
    assert len(calls) == 1 and got == chunking.auto_chunk_size(one_client, *specs[0], *specs[1])
    # A mapper with the automatic chunk gives the vmap result either way.
    out = core.client_mapper("chunked", 0)(one_client, rows, shared=(params,))
    np.testing.assert_allclose(jax.tree.leaves(out)[0],
                               jax.tree.leaves(jax.vmap(one_client, (None, 0))(params, rows))[0],
                               rtol=1e-6)


def test_clients_within_twice_the_work_target_run_as_one_chunk_without_a_probe(monkeypatch):
    """Where only the work target keeps the traced bounds from one chunk, and by less than
    WORK_TARGET_SLACK = 2, the rows run as one chunk and nothing compiles; past it the probe
    decides. Work target here: 4 clients' traced flops, so the slack allows 8."""
    fn, args = PROGRAMS["mlp gradient"]
    one_client = lambda p, r: fn(p, r["x"], r["y"])
    row = {"x": S((16, 64), jnp.float32), "y": S((16,), jnp.int32)}
    specs = ((MLP,), (row,))
    bounds = analysis.traced_bounds(one_client, MLP, row)
    assert bounds.temp_bytes * 100 < chunking.CHUNK_TEMP_BUDGET_BYTES     # memory never binds
    monkeypatch.setattr(chunking, "CHUNK_FLOP_TARGET", 4 * bounds.flops)
    assert chunking.WORK_TARGET_SLACK == 2.0
    calls = []
    monkeypatch.setattr(chunking, "compiled_for_analysis", lambda *a: calls.append(a) or
                        pytest.fail("a probe compiled where the slack decides"))
    monkeypatch.setattr(memo, "directory", lambda: None)
    for rows in (4, 6, 8):
        assert execution.MapperCache().auto_chunk(one_client, ("k",), specs, rows) == rows
    assert not calls
    # 9 rows are more than twice the work target: XLA's analysis decides.
    probed = []
    monkeypatch.setattr(chunking, "measured_step", lambda *a: probed.append(a) or bounds)
    execution.MapperCache().auto_chunk(one_client, ("k",), specs, 9)
    assert len(probed) == 1


def test_evaluation_batch_of_a_small_model_needs_no_compilation(monkeypatch):
    model = models.get("mlp", (8, 8, 1), 10)
    monkeypatch.setattr(evaluate, "compiled_for_analysis",
                        lambda *a: pytest.fail("compiled for a model the bounds decide"))
    evaluate._auto_eval_batch.cache_clear()
    assert evaluate.auto_eval_batch(model, (8, 8, 1)) == evaluate.MAX_EVAL_BATCH
