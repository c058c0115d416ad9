"""Per-client evaluation on each client's own test split, vectorised over clients.

`Evaluator.personal` evaluates a stack of N per-client models (personalised models);
`Evaluator.shared` evaluates one model (a global model) on every client without copying it N
times. Both return per-client sums (`ClientEval`), from which `core.metrics` derives the
statistics reported per round.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_pfl.core.clients import ClientMapper, jit_unless_loop
from fedjax_pfl.core.local import _padded_row
from fedjax_pfl.data.federated import ClientSplits, FederatedData
from fedjax_pfl.models.model import Model

Params = Any


class ClientEval(NamedTuple):
    """Per-client test results; every field has leading axis N."""

    correct: jax.Array   # number of correctly classified test samples (float32)
    loss_sum: jax.Array  # Σ of per-example test losses (float32)
    count: jax.Array     # number of test samples (int32)

    @property
    def accuracy(self) -> jax.Array:
        """correct / count; NaN for a client without test data."""
        return self.correct / jnp.where(self.count > 0, self.count, jnp.nan)

    @property
    def loss(self) -> jax.Array:
        """Mean test loss per client; NaN for a client without test data."""
        return self.loss_sum / jnp.where(self.count > 0, self.count, jnp.nan)


class Evaluator:
    """Evaluates models on clients' test splits in batches of `batch_size` test samples."""

    def __init__(self, model: Model, *, batch_size: int, mapper: ClientMapper):
        if batch_size < 1:
            raise ValueError(f"--eval-batch-size must be >= 1, got {batch_size}")
        self.model = model
        self.batch_size = int(batch_size)
        # Evaluation touches all N clients: never vmap them all at once (memory), chunk instead.
        if mapper.backend == "vmap":
            mapper = ClientMapper("chunked", mapper.chunk_size)
        self.mapper = mapper
        self._personal_one, self._probe = self._make_one()
        self._shared_one = lambda data, params, client: self._personal_one(data, params, client)
        self._shared_probe = lambda data, params, client: self._probe(data, params, client)
        self._personal = jit_unless_loop(mapper, self._map_personal)
        self._shared = jit_unless_loop(mapper, self._map_shared)

    def _map_personal(self, data, params):
        fn = self._personal_one
        mapper = self.mapper.resolved(self._probe, (data,), (params, data.clients))
        return mapper(fn, params, data.clients, shared=(data,), cost=data.clients.test_count)

    def _map_shared(self, data, params):
        fn = self._shared_one
        probe = self._shared_probe
        mapper = self.mapper.resolved(probe, (data, params), (data.clients,))
        return mapper(fn, data.clients, shared=(data, params), cost=data.clients.test_count)

    def personal(self, data: FederatedData, params: Params) -> ClientEval:
        """Client i's model params[i] on client i's test split; params leaves are [N, ...]."""
        return self._personal(data, params)

    def shared(self, data: FederatedData, params: Params) -> ClientEval:
        """One model (e.g. the global model) on every client's test split."""
        return self._shared(data, params)

    def _make_one(self):
        model, batch = self.model, self.batch_size

        def one(data: FederatedData, params: Params, client: ClientSplits) -> ClientEval:
            count = client.test_count
            rows_of_client = _padded_row(client.test_idx, batch)
            num_batches = (count + batch - 1) // batch

            def body(carry):
                b, correct, loss_sum = carry
                rows = jax.lax.dynamic_slice(rows_of_client, (b * batch,), (batch,))
                mask = b * batch + jnp.arange(batch) < count
                outputs = model.apply(params, data.inputs(rows))
                labels = data.labels(rows)
                hits = jnp.argmax(outputs, axis=-1) == labels
                losses = model.loss(outputs, labels)
                correct = correct + jnp.sum(jnp.where(mask, hits, False)).astype(correct.dtype)
                loss_sum = loss_sum + jnp.sum(jnp.where(mask, losses, 0.0))
                return b + 1, correct, loss_sum

            zero = jnp.zeros(())  # float64 under x64, float32 otherwise
            _, correct, loss_sum = jax.lax.while_loop(
                lambda c: c[0] < num_batches, body, (jnp.zeros((), jnp.int32), zero, zero)
            )
            return ClientEval(correct, loss_sum, count.astype(jnp.int32))

        def probe(data, params, client):  # one batch, for the memory analysis of auto chunking
            outputs = model.apply(params, data.inputs(jnp.zeros(batch, jnp.int32)))
            return model.loss(outputs, data.labels(jnp.zeros(batch, jnp.int32)))

        return one, probe
