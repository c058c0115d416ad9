"""The algorithm interface, hyperparameter specs and the registry behind `algorithms.get`.

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

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from fedjax_pfl import core
from fedjax_pfl.core.evaluate import ClientEval, Evaluator
from fedjax_pfl.core.local import LocalResult, LocalTrainer
from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.models.model import Model

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

    `evaluate_parts`, where set, splits `evaluate` by what a round can change (`EvaluateParts`)."""

    name: str
    init: Callable[[jax.Array, FederatedData], Any]
    round_fn: Callable[[Any, FederatedData, jax.Array], tuple[Any, dict]]
    evaluate: Callable[[Any, FederatedData], dict[str, ClientEval]]
    hparams: Mapping[str, Any]
    evaluate_parts: EvaluateParts | None = None


def split_evaluate(rows: Callable[..., dict[str, ClientEval]],
                   rest: Callable[..., dict[str, ClientEval]] | None = None
                   ) -> tuple[Callable[..., dict[str, ClientEval]], EvaluateParts]:
    """`evaluate` from its two parts (`EvaluateParts`; `rest` None: no other entry), and the
    parts."""
    rest = rest or (lambda state, data, ids=None: {})

    def evaluate(state, data, ids=None) -> dict[str, ClientEval]:
        return {**rows(state, data, ids), **rest(state, data, ids)}

    return evaluate, EvaluateParts(rows, rest)


# ----------------------------------------------------------------------------------------------
# Hyperparameters


@dataclasses.dataclass(frozen=True)
class Check:
    """A validity condition with the words used in the error message."""

    test: Callable[[Any], bool]
    words: str


POSITIVE = Check(lambda v: v > 0, "> 0")
NON_NEGATIVE = Check(lambda v: v >= 0, ">= 0")
AT_LEAST_ONE = Check(lambda v: v >= 1, ">= 1")
UNIT_OPEN_CLOSED = Check(lambda v: 0 < v <= 1, "in (0, 1]")
UNIT_CLOSED = Check(lambda v: 0 <= v <= 1, "in [0, 1]")
UNIT_CLOSED_OPEN = Check(lambda v: 0 <= v < 1, "in [0, 1)")


@dataclasses.dataclass(frozen=True)
class HParam:
    """One hyperparameter: keyword name, type, default, help text and constraints.

    `flag` is its command-line spelling; `aliases` are extra spellings of the same flag.
    A default of None means "derived" (the help text says from what).
    """

    name: str
    type: type
    default: Any
    help: str
    choices: tuple | None = None
    check: Check | None = None
    flag: str | None = None
    aliases: tuple[str, ...] = ()

    def cli_flag(self, prefix: str | None) -> str:
        if self.flag:
            return self.flag
        stem = self.name.replace("_", "-")
        return f"--{prefix}-{stem}" if prefix else f"--{stem}"

    def validate(self, value: Any, flag: str) -> Any:
        if value is None:
            if self.default is None:
                return None
            value = self.default
        if self.type is bool:
            if not isinstance(value, (bool, int)):
                raise ValueError(f"{flag} must be true or false, got {value!r}")
            value = bool(value)
        else:
            try:
                value = self.type(value)
            except (TypeError, ValueError):
                raise ValueError(f"{flag} must be {self.type.__name__}, got {value!r}") from None
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{flag} must be one of {list(self.choices)}, got {value!r}")
        if self.check is not None and not self.check.test(value):
            raise ValueError(f"{flag} must be {self.check.words}, got {value!r}")
        return value


COMMON_HPARAMS: tuple[HParam, ...] = (
    HParam("participation", float, 0.25,
           "fraction of clients sampled per round; M = ⌊N·rate⌋, the exact floor (one more than "
           "the reference codes' int(N·rate) in cases such as N = 100, rate 0.29: 29 vs 28)",
           check=UNIT_OPEN_CLOSED),
    HParam("local_epochs", int, 1, "local epochs E: every client visits each of its samples E times",
           check=AT_LEAST_ONE),
    HParam("local_steps", int, None,
           "if set: exactly K local minibatch steps per client and round instead of "
           "--local-epochs (batches walk through reshuffled epochs of the client's data)",
           check=AT_LEAST_ONE),
    HParam("batch_size", int, 10, "local minibatch size B", check=AT_LEAST_ONE),
    HParam("lr", float, 0.05, "client learning rate of local SGD", check=POSITIVE),
    HParam("momentum", float, 0.0, "SGD momentum of the client optimizer (0: plain SGD)",
           check=UNIT_CLOSED_OPEN),
    HParam("momentum_buffer", str, "reset",
           "per-client momentum buffer across participations: 'persist' keeps each client's "
           "buffer from its last round (the PGFed reference code), 'reset' starts at zero",
           choices=("persist", "reset"), aliases=("--pgfed-momentum-buffer",)),
    HParam("drop_last", bool, False,
           "drop each epoch's last partial batch: ⌊n/B⌋ steps instead of ⌈n/B⌉"),
    HParam("backend", str, "chunked",
           "how sampled clients run: 'chunked' (vmap over chunks of --chunk-size clients, "
           "sequential over chunks), 'vmap' (all clients in one vectorised step), 'loop' (one "
           "client at a time, the reference) or 'debug' (no jit at all; an error names the "
           "client, round and stage); with several devices clients are split across them",
           choices=core.BACKENDS),
    HParam("chunk_size", int, 0,
           "clients per chunk for --backend chunked and for evaluation; 0 picks it from XLA's "
           "memory analysis of one client's step: temporaries within 16 MB and temporaries plus "
           "parameters within 1 GiB per CPU device (whole vmap on accelerators)",
           check=NON_NEGATIVE),
    HParam("eval_batch_size", int, 0,
           "test samples per evaluation batch; 0 picks the largest multiple of 8 up to 256 whose "
           "forward pass keeps its temporaries within 2 MiB on a CPU device (XLA's memory "
           "analysis: 256 for the MLP, 8 for the CNN, whose im2col patches then stay in cache). "
           "PGFed's full-data gradient pass uses the same batch",
           check=NON_NEGATIVE),
)


@dataclasses.dataclass(frozen=True)
class AlgorithmSpec:
    """A registered algorithm: its factory, own hyperparameters and overrides of common defaults."""

    name: str
    factory: Callable[..., Algorithm]
    summary: str
    hparams: tuple[HParam, ...] = ()
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    flag_prefix: str | None = None
    # Hyperparameters the factory uses only in arithmetic: a sweep may pass them as traced
    # arrays and vmap one compiled program over their values (fedjax_pfl.sweep).
    traceable: tuple[str, ...] = ("lr",)

    def all_hparams(self) -> list[tuple[HParam, str]]:
        """(hparam with this algorithm's default, CLI flag) for common and own hyperparameters."""
        out = []
        for hp in COMMON_HPARAMS:
            if hp.name in self.defaults:
                hp = dataclasses.replace(hp, default=self.defaults[hp.name])
            out.append((hp, hp.cli_flag(None)))
        out += [(hp, hp.cli_flag(self.flag_prefix or self.name)) for hp in self.hparams]
        return out

    def resolve(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        """Validated hyperparameters: overrides on top of defaults; unknown names are errors."""
        table = {hp.name: (hp, flag) for hp, flag in self.all_hparams()}
        unknown = sorted(set(overrides) - set(table))
        if unknown:
            raise ValueError(
                f"{self.name} has no hyperparameter {', '.join(unknown)}; valid: {sorted(table)}"
            )
        return {name: hp.validate(overrides.get(name), flag) for name, (hp, flag) in table.items()}


_REGISTRY: dict[str, AlgorithmSpec] = {}


def register(spec: AlgorithmSpec) -> AlgorithmSpec:
    if spec.name in _REGISTRY:
        raise ValueError(f"algorithm {spec.name!r} is registered twice")
    _REGISTRY[spec.name] = spec
    return spec


def names() -> list[str]:
    return sorted(_REGISTRY)


def spec(name: str) -> AlgorithmSpec:
    if name not in _REGISTRY:
        raise ValueError(f"unknown algorithm {name!r}; expected one of {names()}")
    return _REGISTRY[name]


def get(name: str, *, model: Model, **hparams: Any) -> Algorithm:
    """Builds algorithm `name` for `model` with validated hyperparameters (others at defaults)."""
    s = spec(name)
    resolved = s.resolve(hparams)
    algo = s.factory(model=model, **resolved)
    return algo._replace(name=name, hparams=resolved)


# ----------------------------------------------------------------------------------------------
# The shared engine pieces an algorithm is assembled from


class Engine:
    """Sampling, local training, evaluation and aggregation configured from the common hparams."""

    def __init__(
        self,
        model: Model,
        *,
        participation: float,
        local_epochs: int,
        local_steps: int | None,
        batch_size: int,
        lr: float,
        momentum: float,
        momentum_buffer: str,
        drop_last: bool,
        backend: str,
        chunk_size: int,
        eval_batch_size: int,
        client_transform: optax.GradientTransformation | None = None,
        on_step=None,
        optimizer: optax.GradientTransformation | None = None,
        step_fn=None,
    ):
        """`optimizer` replaces the default client optimizer sgd(lr, momentum) (and
        `client_transform`); `step_fn` replaces the default minibatch step (see LocalTrainer)."""
        self.model = model
        self.participation = participation
        self.persist_opt_state = momentum_buffer == "persist" and momentum > 0
        self.mapper = core.client_mapper(backend, chunk_size)
        if optimizer is None:
            optimizer = optax.sgd(lr, momentum=momentum or None)
            if client_transform is not None:
                optimizer = optax.chain(client_transform, optimizer)
        self.trainer = LocalTrainer(
            model, optimizer, batch_size=batch_size, mapper=self.mapper, drop_last=drop_last,
            on_step=on_step, step_fn=step_fn,
            **({"steps": local_steps} if local_steps else {"epochs": local_epochs}),
        )
        self.evaluator = Evaluator(model, batch_size=eval_batch_size, mapper=self.mapper)

    def num_sampled(self, data: FederatedData) -> int:
        """M = floor(N·rate) of the N real clients (padding clients are never sampled)."""
        return core.num_sampled_clients(data.num_real_clients, self.participation)

    def sample(self, key: jax.Array, data: FederatedData) -> jax.Array:
        """This round's M client ids, deterministic in `key`: sorted ascending, or, when clients
        are split over several devices, in the order that gives every device an equal share of
        the local steps (`core.balanced_order`); rows of the round keep that order throughout."""
        idx = core.sample_clients(key, data.num_real_clients, self.num_sampled(data))
        devices = 1 if self.mapper.mesh is None else self.mapper.mesh.size
        if devices > 1:
            steps = self.trainer.num_steps(core.gather(data.clients.train_count, idx))
            idx = idx[core.balanced_order(steps, devices)]
        return idx

    def init_client_opt_states(self, params: Params, num_clients: int) -> Any:
        """[N] per-client optimizer states when they persist across rounds, else None."""
        if not self.persist_opt_state:
            return None
        return core.broadcast(self.trainer.init_opt_state(params), num_clients)

    def opt_states_for(self, stored: Any, idx: jax.Array, params: Params) -> Any:
        """The sampled clients' optimizer states: their stored rows, or fresh ones for a model
        shaped like `params` (one model, unstacked)."""
        if self.persist_opt_state:
            return core.gather(stored, idx)
        return core.broadcast(self.trainer.init_opt_state(params), idx.shape[0])

    def store_opt_states(self, stored: Any, idx: jax.Array, rows: Any) -> Any:
        return core.scatter(stored, idx, rows) if self.persist_opt_state else stored

    def train(
        self,
        data: FederatedData,
        idx: jax.Array,
        params: Params,
        opt_state: Any,
        key: jax.Array,
        extra: dict | None = None,
        hook_state: Any = None,
        shared_start: bool = False,
    ) -> LocalResult:
        """Local training of the clients `idx`, starting from `params` ([M, ...]; or one model
        for all of them with `shared_start`)."""
        keys = client_keys(key, idx)
        return self.trainer(data, params, opt_state, core.gather(data.clients, idx), keys,
                            extra=extra, hook_state=hook_state, shared_start=shared_start, ids=idx)

    def evaluate_after_training(self, trainer: LocalTrainer, data: FederatedData, params: Params,
                                key: jax.Array, ids: jax.Array | None) -> core.ClientEval:
        """Each evaluated client (`ids`, or all) trains its own copy of the shared model `params`
        with `trainer` (FT's fine-tuning, Per-FedAvg's adaptation step), from a fresh optimizer
        state, and is evaluated with the model it ends with."""
        ids = evaluated_ids(data, ids)
        opt = core.broadcast(trainer.init_opt_state(params), ids.shape[0])
        trained = trainer(data, params, opt, core.gather(data.clients, ids), client_keys(key, ids),
                          shared_start=True, ids=ids)
        return self.evaluator.rows(data, trained.params, ids)


def evaluated_ids(data: FederatedData, ids: jax.Array | None) -> jax.Array:
    """The clients an `evaluate(state, data, ids)` call covers: `ids`, or every client."""
    return jnp.arange(data.num_clients, dtype=jnp.int32) if ids is None else jnp.asarray(ids)


def client_keys(key: jax.Array, idx: jax.Array) -> jax.Array:
    """One key per client, folded from the client id: a client's batch order in a round does not
    depend on which other clients were sampled or on their order (vmap == loop)."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, idx)


def train_metrics(result: LocalResult, idx: jax.Array) -> dict[str, jax.Array]:
    """The metrics every round_fn reports."""
    return {
        "sampled": idx,
        "train_loss": result.loss,
        "client_steps": jnp.sum(result.num_steps),
    }


def communication(*, up_clients, up_floats_per_client, down_clients,
                  down_floats_per_client, **more) -> dict[str, jax.Array]:
    """Floats sent in one round, each direction summed over clients, as round metrics.

    `comm_up_floats` (clients → server) and `comm_down_floats` (server → clients); `more` adds
    variants under `comm_<name>` (e.g. the downlink with a dense tensor). The runner sums every
    `comm_*` metric over rounds into summary.json's "communication" totals.
    """
    as_float = lambda v: jnp.asarray(v, jnp.float32)
    out = {"comm_up_floats": as_float(up_clients) * as_float(up_floats_per_client),
           "comm_down_floats": as_float(down_clients) * as_float(down_floats_per_client)}
    out.update({f"comm_{k}": as_float(v) for k, v in more.items()})
    return out


def first_row(tree: Params) -> Params:
    return jax.tree.map(lambda x: x[0], tree)


def require_choices(**named: tuple[Any, Sequence[Any]]) -> None:
    for name, (value, allowed) in named.items():
        if value not in allowed:
            raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
