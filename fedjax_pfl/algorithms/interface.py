"""The algorithm interface: what the runner, the program and the tests hold an algorithm to.

An algorithm is a factory of pure functions (FedJAX's `FederatedAlgorithm(init, apply)`):

    algo = fedjax_pfl.algorithms.get("fedavg", model=model, lr=0.05)
    state = algo.init(key, data)
    state, metrics = algo.round_fn(state, data, key)    # pure; jax.jit-able as is
    evals = algo.evaluate(state, data)                   # {"client": ClientEval, ...}
    evals = algo.evaluate(state, data, ids)              # only the clients `ids` ([K] int32)

`evaluate` returns per-client arrays (leading axis N, or K with `ids`): key "client" is the model
each client would use (its personalised model, or the global model for FedAvg) and is the
headline accuracy; "global" is the global model where an algorithm also has one. An algorithm
whose personalised models only its sampled rounds change says so with `evaluate_parts`
(`split_evaluate`), and the runner then evaluates those models again only where they changed.

`round_fn` returns at least: "sampled" [M] client ids, "train_loss" [M] mean local minibatch loss
per sampled client, "client_steps" () the number of local steps taken (for throughput).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_pfl.core.evaluate import ClientEval
from fedjax_pfl.data.federated import FederatedData

Params = Any


class EvaluateParts(NamedTuple):
    """An algorithm's `evaluate` in two parts, so that evaluation can skip the clients whose
    models did not change (`core.CachedEvaluation`):

    - rows(state, data, ids): the entries whose value for client i is a function of client i's
      own rows of the state alone, which only the rounds that sample i change (a personalised
      model kept per client, stale while the client is not sampled);
    - rest(state, data, ids): every other entry (the global model changes every round).

    evaluate(state, data, ids) == {**rows(state, data, ids), **rest(state, data, ids)}.
    """

    rows: Callable[..., dict[str, ClientEval]]
    rest: Callable[..., dict[str, ClientEval]]


class Algorithm(NamedTuple):
    """init(key, data) -> state; round_fn(state, data, key) -> (state, metrics); evaluate(state, data).

    `evaluate_parts`, where set, splits `evaluate` by what a round can change (`EvaluateParts`).

    `host_state` True declares that the round and the evaluation read and write per-client state
    only through `core.gather` / `core.scatter` at the round's participants (or at the
    evaluated ids), and that every client starts from the same rows:
    then `--state-placement host` can keep the rows off the devices (`core.state_placement`). Each
    algorithm that declares it is checked bit for bit against device placement
    (tests/core/test_state_placement.py).

    `participants(data, key)`, declared by the algorithm's engine (`Engine.participants`), gives
    the ids of the clients whose samples `round_fn(state, data, key)` reads, from the key and the
    clients' counts alone (its S_t; every client for pFedMe and TDPFed, which train all of them
    before sampling the uploads); jit-able, and no part of the round is traced. Host and sharded
    data placement (`core.Program`) move these clients' samples to the devices before the round.
    None: not declared (the data then stays on the devices).

    `data_blocks` False declares that the round reads client samples in mapper calls dealt
    otherwise than its training (FedFomo evaluates client-model pairs): host data placement then
    stages each round's samples whole on every device instead of in per-device blocks
    (`core.rows.DeviceBlocks`). True (the default) is checked at run time: a row dealt to a device without
    its client's samples stops the run with an error.

    `client_blocks` B > 1 declares that the clients are B equal blocks that share nothing: a
    sweep's runs stacked as one algorithm (`fedjax_pfl.sweep`), whose participants come block by
    block (M/B of each). Host state placement then gives each block its own initial rows and
    each block its own part of a call's world; evaluation groups lie within one block.

    `frozen` (a `models.frozen.Frozen`, the model's `Model.frozen`): parameters the model reads
    that are no part of the state (a pretrained base under adapters); `core.Program` passes them
    to every compiled program as one replicated argument. None: none."""

    name: str
    init: Callable[[jax.Array, FederatedData], Any]
    round_fn: Callable[[Any, FederatedData, jax.Array], tuple[Any, dict]]
    evaluate: Callable[[Any, FederatedData], dict[str, ClientEval]]
    hparams: Mapping[str, Any]
    evaluate_parts: EvaluateParts | None = None
    host_state: bool = False
    data_blocks: bool = True
    participants: Callable[[FederatedData, jax.Array], jax.Array] | None = None
    client_blocks: int = 1
    frozen: Any = None


def split_evaluate(rows: Callable[..., dict[str, ClientEval]],
                   rest: Callable[..., dict[str, ClientEval]] | None = None
                   ) -> tuple[Callable[..., dict[str, ClientEval]], EvaluateParts]:
    """`evaluate` from its two parts (`EvaluateParts`; `rest` None: no other entry), and the
    parts."""
    rest = rest or (lambda state, data, ids=None: {})

    def evaluate(state, data, ids=None) -> dict[str, ClientEval]:
        return {**rows(state, data, ids), **rest(state, data, ids)}

    return evaluate, EvaluateParts(rows, rest)


def evaluated_ids(data: FederatedData, ids: jax.Array | None) -> jax.Array:
    """The clients an `evaluate(state, data, ids)` call covers: `ids`, or every client."""
    return jnp.arange(data.num_clients, dtype=jnp.int32) if ids is None else jnp.asarray(ids)
