"""Per-client evaluation on each client's own test split, vectorised over clients.

`Evaluator.personal` evaluates a stack of N per-client models (personalised models);
`Evaluator.shared` evaluates one model (a global model) on every client without copying it N
times. Both return per-client sums (`ClientEval`), from which `core.metrics` derives the
statistics reported per round.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_pfl.core import rows as rows_lib
from fedjax_pfl.core.analysis import compiled_for_analysis, traced_bounds
from fedjax_pfl.core.balance import balanced_order
from fedjax_pfl.core.clients import gather, num_sampled_clients
from fedjax_pfl.core.execution import EAGER_BACKENDS, ClientLoop, ClientMapper, jit_unless_loop
from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.models.model import Model
from fedjax_pfl.ops import poison as poison_ops

Params = Any


class ClientEval(NamedTuple):
    """Per-client test results; every field has leading axis N."""

    correct: jax.Array   # number of correctly classified test samples (units: `Model.metric`)
    loss_sum: jax.Array  # Σ of per-example test losses (float32)
    count: jax.Array     # number of test samples (int32), or of scored units (`Model.metric`)
    loss_count: Any = None  # Σ of the loss units (`Model.weight`: tokens); None: `count`
    # Under a backdoor (`Backdoor`): the client's test samples of a true label other than the
    # target, and how many of them the model classifies as the target once triggered.
    backdoor_hits: Any = None
    backdoor_count: Any = None

    @property
    def accuracy(self) -> jax.Array:
        """correct / count; NaN for a client without test data."""
        return self.correct / jnp.where(self.count > 0, self.count, jnp.nan)

    @property
    def loss(self) -> jax.Array:
        """Mean test loss per client (per token with `Model.weight`); NaN without test data."""
        units = self.count if self.loss_count is None else self.loss_count
        return self.loss_sum / jnp.where(units > 0, units, jnp.nan)


class Backdoor(NamedTuple):
    """The backdoor an evaluation measures (--attack backdoor): its target label and the
    trigger's k (`ops.poison.stamp_trigger`, stamped as `trigger_of` says)."""

    target: int
    size: int


def trigger_of(data: FederatedData) -> tuple[str, Any]:
    """(how a trigger is stamped on `data`'s inputs, its value): images (inputs of rank ≥ 2)
    get the pixel value 1.0 (the top of every image dataset's normalised range here), features
    1.0, token inputs the vocabulary's last id."""
    if data.token_inputs:
        return "tokens", data.task.vocab_size - 1
    return ("image" if len(data.input_shape) >= 2 else "features"), 1.0


AUTO_EVAL_BATCH = 0
# On a CPU device, an evaluation batch whose forward-pass temporaries (im2col patches,
# activations) stay within about the L2 cache runs fastest: the FedAvg CNN on 28×28 images
# (~0.4 MB of temporaries per sample) evaluates 25 clients' test splits in 2.0 s at batch 8 and
# 3.5 s at batch 256 (benchmarks/RESULTS.md, "Evaluation"); the MLP is far below the budget
# at any batch, and keeps 256.
EVAL_TEMP_BUDGET_BYTES = 2 << 20
MAX_EVAL_BATCH = 256


def auto_eval_batch(model: Model, input_shape: tuple[int, ...],
                    temp_budget_bytes: int = EVAL_TEMP_BUDGET_BYTES, input_dtype=jnp.float32) -> int:
    """The evaluation batch for `model` on inputs of `input_shape`: the largest multiple of 8 in
    [8, 256] whose forward pass keeps b · (temporaries per sample) ≤ temp_budget_bytes, per sample
    from XLA's memory analysis of the forward pass at batch 8. Accelerators get 256."""
    if jax.default_backend() != "cpu":
        return MAX_EVAL_BATCH
    return _auto_eval_batch(model, tuple(input_shape), int(temp_budget_bytes),
                            jnp.dtype(input_dtype))


@functools.lru_cache(maxsize=64)
def _auto_eval_batch(model: Model, input_shape: tuple[int, ...], temp_budget_bytes: int,
                     input_dtype=jnp.dtype(jnp.float32)) -> int:
    probe = 8
    params = jax.eval_shape(model.init, jax.random.key(0))
    x = jax.ShapeDtypeStruct((probe, *input_shape), input_dtype)
    # No compilation where even an upper bound of the temporaries allows the largest batch.
    bounds = traced_bounds(model.apply, params, x)
    if bounds is not None and bounds.temp_bytes / probe * MAX_EVAL_BATCH <= temp_budget_bytes:
        return MAX_EVAL_BATCH
    try:
        analysis = compiled_for_analysis(model.apply, params, x).memory_analysis()
        per_sample = analysis.temp_size_in_bytes / probe
    except Exception:   # no memory analysis on this backend
        return MAX_EVAL_BATCH
    fits = int(temp_budget_bytes // max(per_sample, 1.0)) // 8 * 8
    return int(min(MAX_EVAL_BATCH, max(8, fits)))


def input_dtype(data: FederatedData):
    """The dtype the model receives: int32 token ids, or float32 inputs."""
    return jnp.int32 if data.token_inputs else jnp.float32


class Evaluator:
    """Evaluates models on clients' test splits in batches of `batch_size` test samples
    (`AUTO_EVAL_BATCH`, 0: `auto_eval_batch`).

    The batch is min(batch_size, the largest client's test set rounded up to a multiple of 8), so
    clients with a handful of test samples are not padded to a large batch. Each client is a
    `ClientLoop` of ⌈test_count / batch⌉ steps, run by the mapper in lanes (chunked) or vmapped.
    """

    def __init__(self, model: Model, *, batch_size: int, mapper: ClientMapper,
                 backdoor: Backdoor | None = None):
        """`backdoor`: each test batch is also evaluated with the trigger stamped on it, and
        the results count the samples whose label is not the target (`backdoor_count`) and
        those of them classified as the target (`backdoor_hits`): the attack success rate's
        parts (classification tasks)."""
        if batch_size < 0:
            raise ValueError(f"--eval-batch-size must be >= 0 (0: automatic), got {batch_size}")
        self.model = model
        self.backdoor = backdoor
        self.batch_size = int(batch_size)
        # Evaluation touches all N clients: never vmap them all at once (memory), use lanes.
        if mapper.backend == "vmap":
            mapper = mapper._replace(backend="chunked")
        self.mapper = mapper
        self._loops: dict = {}
        self._personal = jit_unless_loop(mapper, self._map_personal, static_argnums=3)
        self._shared = jit_unless_loop(mapper, self._map_shared, static_argnums=3)

    def batch_for(self, data: FederatedData) -> int:
        """The evaluation batch for `data`: min(batch_size, largest test split rounded up to 8)."""
        batch = self.batch_size
        if batch == AUTO_EVAL_BATCH:
            batch = auto_eval_batch(self.model, data.input_shape, input_dtype=input_dtype(data))
        return max(1, min(batch, -(-max(data.max_test, 1) // 8) * 8))

    def _loop_for(self, batch: int, personal: bool):
        if (batch, personal) not in self._loops:
            self._loops[(batch, personal)] = self._make_loop(batch, personal)
        return self._loops[(batch, personal)]

    def _map_personal(self, data, params, clients, batch, ids=None):
        # In the rows' own order, not `_balanced`'s: each device evaluates the clients whose
        # models it holds. Reordering them moved every client's model (an all-gather of all N
        # models onto every device: 9 GB a device for PGFedMo's 1,000 CNNs on the peers'
        # cifar10 job), to even out test samples between the devices.
        loop, probe = self._loop_for(batch, True)
        return self.mapper.run(loop, (params, clients), shared=(data, None), probe=probe, ids=ids,
                               stage="evaluation")

    def _map_shared(self, data, params, clients, batch, ids=None):
        loop, probe = self._loop_for(batch, False)
        return self._balanced(lambda rows, i: self.mapper.run(loop, rows, shared=(data, params),
                                                              probe=probe, ids=i,
                                                              stage="evaluation"),
                              (None, clients), clients, data, ids)

    def _balanced(self, run, rows, clients, data, ids):
        """With several devices, clients are evaluated in an order that gives each device an equal
        share of test samples; the (small) results are put back in client order. For one shared
        model only: the rows are the clients' (small) test splits, not their models. Data in
        per-device blocks (`core.rows.DeviceBlocks`) was staged for the rows' own order: no reordering."""
        devices = 1 if self.mapper.mesh is None else self.mapper.mesh.size
        if devices == 1 or self.mapper.backend in EAGER_BACKENDS or rows_lib.has_blocks(data):
            return run(rows, ids)
        order = balanced_order(clients.test_count, devices)
        out = run(_rows(rows, order), None if ids is None else ids[order])
        return _rows(out, jnp.argsort(order))

    def personal(self, data: FederatedData, params: Params, ids: jax.Array | None = None) -> ClientEval:
        """Client i's model params[i] on client i's test split, for every client (params leaves
        [N, ...]) or for the clients `ids` (then the result has leading axis len(ids))."""
        clients = data.clients
        if ids is not None:        # core.gather: client state may be held as ClientRows
            params, clients = gather(params, ids), _rows(clients, ids)
        return self._personal(data, params, clients, self.batch_for(data), ids)

    def rows(self, data: FederatedData, params: Params, ids: jax.Array) -> ClientEval:
        """params[k] (already one row per evaluated client) on client ids[k]'s test split."""
        return self._personal(data, params, _rows(data.clients, ids), self.batch_for(data), ids)

    def shared(self, data: FederatedData, params: Params, ids: jax.Array | None = None) -> ClientEval:
        """One model (e.g. the global model) on every client's test split (or the clients `ids`)."""
        clients = data.clients if ids is None else _rows(data.clients, ids)
        return self._shared(data, params, clients, self.batch_for(data), ids)

    def _make_loop(self, batch: int, personal: bool):
        model, backdoor = self.model, self.backdoor

        def init(shared, row) -> EvalCarry:
            params, client = row
            zero = jnp.zeros(())  # float64 under x64, float32 otherwise
            units = None if model.metric is None and model.weight is None else (zero, zero)
            return EvalCarry(params, client, zero, zero, units,
                             None if backdoor is None else (zero, zero))

        def triggered(data, params, x, labels, mask, sums):
            """The backdoor's (hits, count) after this batch: its samples of another label than
            the target, triggered, classified as the target."""
            inputs, value = trigger_of(data)
            outputs = model.apply(_as_float32(params),
                                  poison_ops.stamp_trigger(x, backdoor.size, value, inputs))
            keep = mask & (labels != backdoor.target)
            hit = keep & (jnp.argmax(outputs, axis=-1) == backdoor.target)
            return (sums[0] + jnp.sum(hit).astype(sums[0].dtype),
                    sums[1] + jnp.sum(keep).astype(sums[1].dtype))

        def step(shared, carry: EvalCarry, b) -> EvalCarry:
            data, common = shared
            client, correct, loss_sum = carry.client, carry.correct, carry.loss_sum
            params = carry.params if personal else common
            positions = b * batch + jnp.arange(batch)
            mask = positions < client.test_count
            rows = client.test_start + jnp.where(mask, positions, 0)
            x = data.inputs(rows)
            outputs = model.apply(_as_float32(params), x)
            labels = data.labels(rows)
            if backdoor is not None:
                carry = carry._replace(backdoor=triggered(data, params, x, labels, mask,
                                                          carry.backdoor))
            losses = model.loss(outputs, labels)
            loss_sum = loss_sum + jnp.sum(jnp.where(mask, losses, 0.0)).astype(loss_sum.dtype)
            if carry.units is None:
                hits = jnp.argmax(outputs, axis=-1) == labels
                correct = correct + jnp.sum(jnp.where(mask, hits, False)).astype(correct.dtype)
                return carry._replace(correct=correct, loss_sum=loss_sum)
            scored, loss_units = carry.units
            if model.metric is None:
                hits, count = jnp.argmax(outputs, axis=-1) == labels, jnp.ones(mask.shape)
            else:
                hits, count = model.metric(outputs, labels)
            weight = jnp.ones(mask.shape) if model.weight is None else model.weight(labels)
            masked = lambda v, acc: acc + jnp.sum(jnp.where(mask, v, 0)).astype(acc.dtype)
            units = (masked(count, scored), masked(weight, loss_units))
            return carry._replace(correct=masked(hits, correct), loss_sum=loss_sum, units=units)

        def finish(shared, carry: EvalCarry) -> ClientEval:
            hits, count = (None, None) if carry.backdoor is None else carry.backdoor
            if carry.units is None:
                return ClientEval(carry.correct, carry.loss_sum,
                                  carry.client.test_count.astype(jnp.int32),
                                  backdoor_hits=hits, backdoor_count=count)
            scored, loss_units = carry.units
            return ClientEval(carry.correct, carry.loss_sum, scored, loss_units, hits, count)

        def length(row):
            _, client = row
            return (client.test_count + batch - 1) // batch

        def probe(data, common, row):
            return step((data, common), init((data, common), row), jnp.zeros((), jnp.int32))

        return ClientLoop(init, step, finish, length, large_carry=personal,
                          host_length=lambda train, test: (test + batch - 1) // batch), probe


class EvalCarry(NamedTuple):
    """One client's evaluation loop carry between test batches."""

    params: Params          # the client's model (None when one shared model is evaluated)
    client: Any             # its ClientSplits row
    correct: jax.Array      # correct predictions so far; shape=()
    loss_sum: jax.Array     # Σ of the per-example losses so far; shape=()
    units: Any = None       # (scored units, loss units) so far, for a model with metric/weight
    backdoor: Any = None    # (triggered hits, non-target samples) so far (`Backdoor`)


def _rows(tree: Params, ids: jax.Array) -> Params:
    return jax.tree.map(lambda x: x[ids], tree)


def _as_float32(params: Params) -> Params:
    """Client state stored in bfloat16 (--state-dtype) is evaluated in float32."""
    return jax.tree.map(lambda x: x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x, params)


def default_eval_group(algo, data) -> int:
    """Clients evaluated together by one compiled program: the power of two at or above the M
    clients a round samples (of one client block: `Algorithm.client_blocks`, whose last block's
    padding clients are the dataset's)."""
    blocks = getattr(algo, "client_blocks", 1)
    real = data.num_real_clients - (blocks - 1) * (data.num_clients // blocks)
    m = num_sampled_clients(real, algo.hparams.get("participation", 1.0))
    return 1 << (m - 1).bit_length()
