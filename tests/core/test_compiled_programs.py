"""What a program compiles, counted (`fedjax_pfl.compiles`): each program once and only if it
runs; the staged execution's narrow stages only where the cost model says they pay; the initial
state compiled at a low optimisation level with the same bits; concurrent compilation with the
results of compiling on first call."""

import importlib.metadata
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import linear_model, make_data, make_raw

from fedjax_pfl import algorithms, compiles, core
from fedjax_pfl.core import execution
from fedjax_pfl.data.federated import FederatedData


def _program(name, data, **hp):
    algo = algorithms.get(name, model=linear_model(), participation=0.5, batch_size=4,
                          **hp)
    return core.Program(algo, data, mesh=None)


def _ours(log) -> list[str]:
    """The programs named after the engine's functions (not JAX's own small ones)."""
    return sorted(n for n in log.names if re.fullmatch(
        r"jit\((rounds\d*(_staged)?|init_state|evaluate\w*)\)", n))


def _run(program, rounds=2):
    """The runner's use of a program: init, rounds, evaluation after each (CachedEvaluation)."""
    state = program.init(jax.random.key(0))
    evaluation = core.CachedEvaluation(program)
    for r in range(rounds):
        state, m = program.run_rounds(state, jax.random.key(1), r, 1)
        evaluation.changed(m[0]["sampled"])
        out = evaluation(state)
    return state, m, out


@pytest.mark.parametrize("name, evaluations", [
    ("fedavg", ["jit(evaluate)"]),
    # evaluate_parts: the two parts CachedEvaluation runs, never the full evaluation beside them
    ("ditto", ["jit(evaluate_rest)", "jit(evaluate_rows_ids)"]),
])
@pytest.mark.slow
def test_each_program_is_compiled_once_ahead_and_none_after(name, evaluations):
    data = make_data([8, 8, 8, 8, 8, 8])
    program = _program(name, data)
    with compiles.record() as ahead:
        program.compile(jax.random.key(1))
    assert _ours(ahead) == sorted(["jit(init_state)", "jit(rounds)"] + evaluations)
    with compiles.record() as later:
        _run(program)
    assert _ours(later) == [], later.names        # the first round and evaluation reuse them


def _bits(x) -> bytes:
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x).dtype.str.encode() + np.asarray(x).tobytes()


@pytest.mark.parametrize("model", ["linear", pytest.param("mlp", marks=pytest.mark.slow),
                                   pytest.param("cnn", marks=(pytest.mark.slow, pytest.mark.extended))])
@pytest.mark.slow
def test_the_initial_state_at_a_low_optimisation_level_has_the_same_bits(model):
    """The initial state's program compiled at `INIT_COMPILER_OPTIONS`' level against the same
    program at XLA's default level and emitters (this suite's flags set level 0 and the
    elemental emitters, so both are given explicitly): the main job's MLP, the CNN and the tests'
    linear model, under four algorithms' states. (Level 0 fails this: the MLP's second bias
    differs by 7e-9.)"""
    from fedjax_pfl import models
    from fedjax_pfl.core import program as program_lib

    data = make_data([5, 9, 3, 7], feature_dim=64)
    net = (linear_model(64) if model == "linear" else
           models.get(model, (28, 28, 1) if model == "cnn" else (64,), 3))
    if model == "cnn":                                   # 28×28 images, as the CNN takes
        x, y, train, test, _, _ = make_raw([5, 9, 3, 7], images=True)
        data = FederatedData.from_arrays(np.tile(x, (1, 4, 4, 1))[:, :28, :28], y, train, test,
                                         num_classes=3, input_scale=2 / 255, input_shift=-1.0)
    default = {"xla_backend_optimization_level": 2}
    low = dict(program_lib.INIT_COMPILER_OPTIONS)
    if tuple(int(v) for v in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 11):
        default["xla_cpu_use_fusion_emitters"] = low["xla_cpu_use_fusion_emitters"] = True
    for name in ("fedavg", "pfedsop", "pgfedmo", "ditto"):
        program = core.Program(algorithms.get(name, model=net, participation=0.5, batch_size=4),
                               data, mesh=None)
        lowered = program.placements.state.init_function(program.algo.init, program.data).lower(
            jax.random.key(4), program.data)
        a = lowered.compile(compiler_options=low)(jax.random.key(4), program.data)
        b = lowered.compile(compiler_options=default)(jax.random.key(4), program.data)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            assert _bits(x) == _bits(y), (name, model)


def test_the_initial_state_is_compiled_low_only_where_that_lowers_the_level(monkeypatch):
    from fedjax_pfl.core import program as program_lib

    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_parallel_codegen_split_count=1")
    assert program_lib.init_compiler_options() == {"xla_backend_optimization_level": 1}
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")    # (this suite's)
    assert program_lib.init_compiler_options() is None
    # Compiled ahead under the suite's flags: the bits of the program compiled at first call.
    data = make_data([5, 9, 3, 7])
    ahead, plain = _program("pgfedmo", data), _program("pgfedmo", data)
    ahead.compile(jax.random.key(1))
    assert ahead._init_compiled is not None
    a, b = ahead.init(jax.random.key(4)), plain.init(jax.random.key(4))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert _bits(x) == _bits(y)


@pytest.mark.slow
def test_concurrent_compilation_gives_the_results_of_compiling_on_first_call():
    data = make_data([5, 9, 3, 7, 11, 2])
    ahead, plain = _program("pgfedmo", data), _program("pgfedmo", data)
    ahead.compile(jax.random.key(1))
    for x, y in zip(jax.tree.leaves(_run(ahead, 3)), jax.tree.leaves(_run(plain, 3)), strict=True):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# -- the staging cost model ------------------------------------------------------------------


def _loop(lengths_of):
    return execution.ClientLoop(None, None, None, None, host_length=lengths_of)


def test_chunked_and_capped_work_by_hand():
    # 16 clients: 15 of 1 step and one of 100, one chunk of 16 lanes: every lane runs 100 steps
    # (1,600 lane-steps); staged, stage 1 runs all 16 lanes to the second-longest's 1 step and
    # stage 2 the longest alone for 99 more: 16 + 99 = 115.
    lengths = np.array([1] * 15 + [100])
    assert execution.chunked_work(lengths, 16) == 1600
    assert execution.capped_work(lengths, 16) == 115
    # Two chunks of 8 sorted by length: 8·1 + 8·100.
    assert execution.chunked_work(lengths, 8) == 808


def test_staging_is_chosen_only_where_it_saves_enough():
    skewed = lambda train, test: train          # one step per sample
    with execution.client_sizes(np.array([1] * 15 + [100]), np.zeros(16)):
        assert execution.worth_staging(_loop(skewed), 16, 16)          # saves 93 %
    with execution.client_sizes(np.array([7, 7, 8, 7, 7, 7]), np.zeros(6)):
        # 6 clients in one chunk: 6·8 = 48 lane-steps; staged 6·7 + 1 = 43 (10 % < 20 %)
        assert execution.chunked_work([7, 7, 8, 7, 7, 7], 6) == 48
        assert execution.capped_work([7, 7, 8, 7, 7, 7], 6) == 43
        assert not execution.worth_staging(_loop(skewed), 6, 6)
    # Unknown counts or lengths: staged, as before the cost model.
    assert execution.worth_staging(_loop(skewed), 6, 6)
    with execution.client_sizes(np.array([7, 8]), np.zeros(2)):
        assert execution.worth_staging(_loop(None), 2, 2)


def _loops_in_round(data) -> int:
    program = core.Program(algorithms.get("fedavg", model=linear_model(), participation=1.0,
                                          batch_size=1), data, mesh=None)
    program.compile(jax.random.key(1))
    return program._round_compiled.as_text().count(" while(")


@pytest.mark.slow
def test_the_round_carries_one_copy_of_the_loop_unless_staging_pays():
    """FedAvg (E = 1, B = 1: one step per sample) over 6 clients: equal clients get one stage;
    one client of 60 samples among five of 2 gets the narrow stage too (another while loop)."""
    equal = _loops_in_round(make_data([4, 4, 4, 4, 4, 5]))
    skewed = _loops_in_round(make_data([2, 2, 2, 2, 2, 60]))
    assert skewed > equal


@pytest.mark.slow
def test_a_run_compiles_its_programs_once_and_its_checkpoints_none(tmp_path):
    """A whole run as the command line makes it (PGFedMo, checkpoints every round, the
    persistent cache off): the round, the two evaluation parts and the initial state, once each;
    of JAX's own small programs (the root key, its fold-ins, the data's padding) at most 8, and
    none at all from the rounds, the evaluations and the checkpoints."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
    import run as cli

    from fedjax_pfl import runner

    cfg = cli.config_from_args(cli.parse([
        "--algo", "pgfedmo", "--rounds", "3", "--clients", "6", "--participation", "0.5",
        "--quiet", "--out", str(tmp_path), "--no-compile-cache", "--checkpoint-every", "1"]))
    with compiles.record() as log:
        summary = runner.run(cfg)
    assert _ours(log) == ["jit(evaluate_rest)", "jit(evaluate_rows_ids)", "jit(init_state)",
                          "jit(rounds)"]
    others = [n for n in log.names if n not in _ours(log)]
    assert len(others) <= 8, others
    assert summary["compile"]["programs"] == len(log.programs)
    assert sorted(os.listdir(tmp_path / "checkpoints"))[-1] == "round_000003"


# -- one-step loops ----------------------------------------------------------------------------


@pytest.mark.parametrize("counts", [[1, 0, 1, 1], [2, 0, 1, 1]])
def test_a_loop_of_at_most_one_step_compiles_without_a_while_loop(counts):
    """Where every client of the traced dataset takes ≤ 1 step, the mapper runs the step as
    straight-line code selected by the client's length: no while loop in the program, a client of
    0 steps keeps its init (100), one of 1 step adds its value. With a client of 2 steps the
    loop stays, and runs both steps."""
    values = np.array([3.0, 5.0, 7.0, 11.0], np.float32)
    rows = (jnp.arange(4, dtype=jnp.int32), jnp.array(counts, jnp.int32))       # (client, steps)

    def run(values_by_client, rows):
        def init(shared, row):
            return (jnp.float32(100.0), row[0])

        def step(shared, carry, t):
            total, client = carry
            return (total + shared[0][client, t], client)

        loop = execution.ClientLoop(init, step, lambda shared, carry: carry[0],
                                    lambda row: row[1], host_length=lambda train, test: train)
        mapper = execution.client_mapper("chunked", chunk_size=4)
        return mapper.run(loop, rows, shared=(values_by_client,))

    table = jnp.asarray(np.stack([values, values * 10], axis=1))           # [4 clients, 2 steps]
    with execution.client_sizes(np.array(counts), np.zeros(4)):
        compiled = jax.jit(run).lower(table, rows).compile()
    out = np.asarray(compiled(table, rows))
    expected = [100.0 + sum(float(table[i, t]) for t in range(c)) for i, c in enumerate(counts)]
    np.testing.assert_array_equal(out, np.array(expected, np.float32))
    assert (" while(" in compiled.as_text()) is (max(counts) > 1)
