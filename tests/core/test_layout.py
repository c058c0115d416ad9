"""core.layout: per-client state is what a state declares (CLIENT_FIELDS), never a shape guess;
and the debug backend names the client, round and stage of a failure."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import linear_model, make_data
from jax.sharding import Mesh, PartitionSpec

from fedjax_pfl import algorithms, core
from fedjax_pfl.core import layout, transfer


class Inner(NamedTuple):
    rows: Any
    scalar: Any
    CLIENT_FIELDS = ("rows",)


class Outer(NamedTuple):
    bias: Any          # global, [10]: as long as the number of clients, and still global
    personal: Any      # per-client, [10, 3]
    inner: Inner       # declares its own per-client field
    CLIENT_FIELDS = ("personal",)


def _state(n=10):
    return Outer(bias=jnp.ones(n), personal={"w": jnp.ones((n, 3)), "b": jnp.ones(n)},
                 inner=Inner(rows=jnp.zeros((n, 2)), scalar=jnp.zeros(())))


def test_mask_marks_declared_fields_only_whatever_the_shapes():
    mask = layout.client_mask(_state(), num_clients=10)
    assert mask.bias is False                       # leading dim 10 = N, but not declared
    assert mask.personal == {"w": True, "b": True}
    assert mask.inner.rows is True and mask.inner.scalar is False


def test_a_declaration_that_disagrees_with_the_shapes_is_an_error():
    bad = _state()._replace(personal={"w": jnp.ones((4, 3))})
    with pytest.raises(ValueError, match=r"Outer\.personal is declared per-client .* \(4, 3\)"):
        layout.client_mask(bad, num_clients=10)

    class Typo(NamedTuple):
        x: Any
        CLIENT_FIELDS = ("y",)

    with pytest.raises(ValueError, match="Typo.CLIENT_FIELDS names \\['y'\\]"):
        layout.client_mask(Typo(jnp.ones(3)))


def test_shardings_and_storage_follow_the_declaration():
    mesh = Mesh(np.array(jax.devices()[:1]), ("clients",))
    shardings = layout.client_shardings(_state(), mesh, 10)
    assert shardings.bias.spec == PartitionSpec()
    assert shardings.personal["w"].spec == PartitionSpec("clients")
    assert shardings.inner.rows.spec == PartitionSpec("clients")
    stored = layout.cast_client_leaves(_state(), jnp.bfloat16, 10)
    assert stored.bias.dtype == jnp.float32          # a global leaf keeps its dtype
    assert stored.personal["w"].dtype == jnp.bfloat16
    assert stored.inner.scalar.dtype == jnp.float32
    per_client, rest = layout.client_state_bytes(_state(), lambda d: np.dtype(d).itemsize)
    assert per_client == 4 * (3 + 1 + 2)             # one client's rows: w[3], b, rows[2]
    assert rest == 4 * (10 + 1)                      # bias [10] and the scalar


@pytest.mark.slow
def test_a_global_output_bias_as_long_as_the_client_count_stays_global_in_bfloat16_runs():
    # N = 3 clients and 3 classes: FedAvg's global bias b [3] has the client count's length. The
    # old shape rule stored it as client rows in bfloat16 (and sharded it as rows).
    data = make_data([6, 5, 7], num_classes=3)
    algo = algorithms.get("fedavg", model=linear_model(num_classes=3), batch_size=4,
                          momentum=0.9, momentum_buffer="persist")
    program = core.Program(algo, data, mesh=None, state_dtype="bfloat16")
    state = program.init(jax.random.key(0))
    assert state.params["b"].dtype == jnp.float32 and state.params["w"].dtype == jnp.float32
    assert state.opt_state[0].trace["b"].dtype == jnp.bfloat16   # per-client momentum rows
    program.compile(jax.random.key(1))
    plan = program.memory_plan()
    d = 5 * 3 + 3
    assert plan.state_per_client == 2 * d            # the momentum rows, bfloat16
    assert plan.replicated_state >= 4 * d            # the global model, float32


@pytest.mark.slow
def test_debug_backend_names_the_round_the_stage_and_the_client():
    # Client 1's inputs hold a NaN; with jax_debug_nans the first op that makes a NaN raises,
    # which the debug backend (no jit: every op runs eagerly) reports with its context.
    data = make_data([4, 4, 4], num_classes=3)
    x = np.asarray(data.x).copy()
    x[int(data.clients.train_start[1])] = np.nan
    data = data.__class__(**{**{f: getattr(data, f) for f in data.__dataclass_fields__}, "x": jnp.asarray(x)})
    algo = algorithms.get("fedavg", model=linear_model(), batch_size=4, participation=1.0,
                          backend="debug")
    program = core.Program(algo, data, mesh=None, jit=False)
    state = program.init(jax.random.key(0))
    with jax.debug_nans(True):
        with pytest.raises(core.ClientError) as info:
            program.run_rounds(state, jax.random.key(1), 0, 1)
    err = info.value
    assert (err.round, err.stage, err.client) == (1, "local training", 1)
    assert str(err).startswith("round 1, local training, client 1: FloatingPointError")


@pytest.mark.slow
def test_debug_backend_trains_like_sgd_written_by_hand():
    # Each client holds exactly B = 4 samples and trains one epoch: one full-batch gradient step
    # whatever the batch order, so plain NumPy softmax regression gives the expected models.
    data = make_data([4, 4, 4], num_classes=3)
    lr = 0.1
    algo = algorithms.get("local", model=linear_model(), batch_size=4, participation=1.0,
                          backend="debug", lr=lr)
    state = algo.init(jax.random.key(0), data)
    w0, b0 = (np.asarray(state.params[k], np.float64) for k in ("w", "b"))
    state, metrics = algo.round_fn(state, data, jax.random.key(1))
    for i in range(3):
        rows = np.arange(int(data.clients.train_start[i]), int(data.clients.train_start[i]) + 4)
        x, y = np.asarray(data.x, np.float64)[rows], np.asarray(data.y)[rows]
        logits = x @ w0[i] + b0[i]
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        loss = -np.mean(np.log(p[np.arange(4), y]))
        g = (p - np.eye(3)[y]) / 4
        np.testing.assert_allclose(state.params["w"][i], w0[i] - lr * x.T @ g, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state.params["b"][i], b0[i] - lr * g.sum(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(metrics["train_loss"][i], loss, rtol=1e-5)


def test_program_refuses_a_data_placement_it_does_not_have():
    data = make_data([4, 4], num_classes=3)
    algo = algorithms.get("fedavg", model=linear_model(), batch_size=4)
    with pytest.raises(ValueError, match=r"--data-placement must be one of \['device', 'host', "
                                         r"'sharded', 'auto'\], got 'disk'"):
        core.Program(algo, data, mesh=None, data_placement="disk")
    assert core.Program(algo, data, mesh=None).data_placement == "device"


def test_program_refuses_a_state_whose_declaration_disagrees_with_its_shapes():
    class Bad(NamedTuple):
        params: Any
        extra: Any                   # [3], declared per-client in a run of N = 2 clients
        CLIENT_FIELDS = ("extra",)

    data = make_data([4, 4], num_classes=3)
    algo = algorithms.get("fedavg", model=linear_model(), batch_size=4)
    algo = algo._replace(init=lambda key, d: Bad(linear_model().init(key), jnp.zeros(3)))
    with pytest.raises(ValueError, match=r"Bad\.extra is declared per-client .* \(3,\), not \[2, \.\.\.\]"):
        core.Program(algo, data, mesh=None)


def test_the_fingerprint_that_processes_compare_before_replicating():
    """`transfer.fingerprint`, which the processes of a run compare before each provides its
    own copy of the dataset: equal for equal values (host or device arrays alike), different
    when a sampled row, a shape, a dtype or the structure differs. The rows sampled of a
    [10,000, 3] leaf are 4,096 evenly spaced ones, the first and last among them."""

    x = np.arange(30_000, dtype=np.float32).reshape(10_000, 3)
    tree = {"x": x, "y": np.arange(7, dtype=np.int32), "n": np.int32(3)}
    same = {"x": jnp.asarray(x), "y": np.arange(7, dtype=np.int32), "n": np.int32(3)}
    assert transfer.fingerprint(tree) == transfer.fingerprint(same)
    rows = np.unique(np.linspace(0, 9_999, transfer.FINGERPRINT_ROWS).astype(np.int64))
    assert rows[0] == 0 and rows[-1] == 9_999 and len(rows) == transfer.FINGERPRINT_ROWS
    for changed in ({**tree, "x": np.where(np.arange(10_000)[:, None] == rows[100], -1.0, x)},
                    {**tree, "x": np.where(np.arange(10_000)[:, None] == 9_999, -1.0, x)},
                    {**tree, "y": np.arange(8, dtype=np.int32)},
                    {**tree, "y": np.arange(7, dtype=np.int64)},
                    {**tree, "n": np.int32(4)},
                    {"x": x, "y": np.arange(7, dtype=np.int32)}):
        assert transfer.fingerprint(changed) != transfer.fingerprint(tree)
