"""The frozen-base seam (models/frozen.py, core/program.py): a model's frozen parameters are a
shared input of every compiled program, never a client row, a gradient or a constant."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_data

from fedjax_pfl import algorithms, core
from fedjax_pfl.models import frozen as frozen_lib
from fedjax_pfl.models.model import Model

F, C = 5, 3


def frozen_linear(base_w, base_b):
    """logits = x (W + w) + b_frozen with W, b frozen and w [F, C] trained, starting at 0: at
    initialisation the logits are x W + b, whatever the trainable start."""
    frozen = frozen_lib.Frozen({"W": jnp.asarray(base_w), "b": jnp.asarray(base_b)})

    def apply(params, x):
        base = frozen.get()
        return x.reshape(len(x), -1) @ (base["W"] + params["w"]) + base["b"]

    return Model(init=lambda key: {"w": jnp.zeros((F, C))}, apply=apply, name="frozen_linear",
                 frozen=frozen)


def _base(seed=0, width=C):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(F, width)).astype(np.float32),
            rng.normal(size=(width,)).astype(np.float32))


def test_the_initial_evaluation_is_the_frozen_model_against_numpy():
    data = make_data([7, 23, 11, 5])
    w, b = _base()
    program = core.Program(algorithms.get("fedavg", model=frozen_linear(w, b), lr=0.1,
                                          participation=0.5, batch_size=4), data, mesh=None)
    state = program.init(jax.random.key(0))
    got = program.evaluate(state)["client"]
    # The test rows of each client, as the dataset lays them out.
    x = np.asarray(data.x, np.float64)
    y = np.asarray(data.y)
    want_loss, want_correct = [], []
    for i in range(data.num_real_clients):
        s, n = int(data.clients.test_start[i]), int(data.clients.test_count[i])
        logits = x[s:s + n] @ w + b
        z = logits - logits.max(1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(1, keepdims=True))
        want_loss.append(-logp[np.arange(n), y[s:s + n]].sum())
        want_correct.append((logits.argmax(1) == y[s:s + n]).sum())
    n = data.num_real_clients
    np.testing.assert_allclose(np.asarray(got.loss_sum)[:n], want_loss, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(got.correct)[:n], want_correct)


@pytest.mark.parametrize("placement, backend", [("device", "chunked"), ("host", "chunked"),
                                                ("device", "loop")])
@pytest.mark.slow
def test_the_base_is_no_state_and_never_changes(placement, backend):
    data = make_data([7, 23, 11, 5, 9, 14])
    w, b = _base(1)
    model = frozen_linear(w, b)
    algo = algorithms.get("fedavg", model=model, lr=0.2, participation=0.5, batch_size=4,
                          backend=backend)
    program = core.Program(algo, data, mesh=None, jit=backend != "loop",
                           state_placement=placement)
    state = program.init(jax.random.key(0))
    keys = jax.random.key(5)
    losses = []
    for r in range(4):
        state, metrics = program.run_rounds(state, keys, r, 1)
        losses.append(float(np.mean(metrics[0]["train_loss"])))
    assert losses[-1] < losses[0]
    # Nothing of the base's shape is in the state: only the trained w [F, C] and scalars.
    shapes = [tuple(np.shape(a)) for a in jax.tree.leaves(
        state if placement == "device" else state.device)]
    assert (F, C) in shapes and (C,) not in shapes
    np.testing.assert_array_equal(np.asarray(model.frozen.value["W"]), w)
    np.testing.assert_array_equal(np.asarray(program._frozen[model.frozen.key]["W"]), w)
    np.testing.assert_array_equal(np.asarray(program._frozen[model.frozen.key]["b"]), b)


def _round_text(width):
    data = make_data([7, 23, 11, 5])
    w, b = _base(2, width)
    frozen = frozen_lib.Frozen({"W": jnp.asarray(w), "b": jnp.asarray(b)})

    def apply(params, x):        # logits = x W[:, :C] + w: the base's size does not matter
        return x.reshape(len(x), -1) @ (frozen.get()["W"][:, :C] + params["w"])

    model = Model(init=lambda key: {"w": jnp.zeros((F, C))}, apply=apply, frozen=frozen)
    program = core.Program(algorithms.get("fedavg", model=model, participation=0.5,
                                          batch_size=4), data, mesh=None)
    program.compile(jax.random.key(0))
    return program._round_compiled.as_text(), program


@pytest.mark.slow
def test_the_base_is_an_argument_of_the_compiled_round_not_a_constant():
    small, _ = _round_text(C)
    large, program = _round_text(20_000)          # 100,000 floats of base
    # As a constant the base would be printed into the program (≥ 100,000 numbers); as an
    # argument it is one parameter line whatever its size.
    assert len(large) < len(small) + 2_000
    assert "f32[5,20000]" in large.replace(" ", "")
    plan = program.memory_plan()
    assert plan.frozen == 5 * 20_000 * 4 + 20_000 * 4
    assert plan.per_device >= plan.frozen


def test_the_memory_plan_counts_the_base_once_whatever_the_clients():
    w, b = _base(3, 1000)

    def plan(clients):
        data = make_data([5] * clients)
        frozen = frozen_lib.Frozen({"W": jnp.asarray(w)})
        model = Model(init=lambda key: {"w": jnp.zeros((F, C))},
                      apply=lambda p, x: x @ (frozen.get()["W"][:, :C] + p["w"]), frozen=frozen)
        program = core.Program(algorithms.get("ditto", model=model, participation=0.5,
                                              batch_size=4), data, mesh=None)
        return program.memory_plan()

    four, eight = plan(4), plan(8)
    assert four.frozen == eight.frozen == F * 1000 * 4
    # Ditto's per-client state is its personal w (and nothing of the base).
    assert four.state_per_client == eight.state_per_client == F * C * 4


@pytest.mark.slow
def test_a_jitted_helper_reused_by_two_programs_reads_each_programs_base():
    """The engine's jitted helpers (local training, evaluation) are traced once and reused: the
    base a program binds enters them as an argument (`frozen.jit`), so the second program (the
    evaluation after the round, a second Program of the same algorithm) does not read the
    first trace's value."""
    data = make_data([7, 23, 11, 5])
    w, b = _base(4)
    algo = algorithms.get("fedavg", model=frozen_linear(w, b), lr=0.1, participation=0.5,
                          batch_size=4, backend="vmap")
    for _ in range(2):
        program = core.Program(algo, data, mesh=None)
        state = program.init(jax.random.key(0))
        state, _ = program.run_rounds(state, jax.random.key(1), 0, 1)
        assert np.isfinite(np.asarray(program.evaluate(state)["client"].loss_sum)).all()


def test_outside_a_program_the_concrete_base_is_read():
    frozen = frozen_lib.Frozen({"W": jnp.ones((2, 2))})
    np.testing.assert_array_equal(frozen.get()["W"], np.ones((2, 2)))
    with frozen_lib.binding({frozen.key: {"W": jnp.zeros((2, 2))}}):
        np.testing.assert_array_equal(frozen.get()["W"], np.zeros((2, 2)))
    np.testing.assert_array_equal(frozen.get()["W"], np.ones((2, 2)))
