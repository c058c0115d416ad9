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

A factory is `factory(model, config: EngineConfig, *, <its own hyperparameters by name>)`;
`get` validates the hyperparameters (`AlgorithmSpec.resolve`) and splits them between the two
(`AlgorithmSpec.build`). Each module registers its algorithms with an `AlgorithmSpec`, including
the small configuration the cross-cutting tests run it with (`test_hparams`).
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from fedjax_pfl import core
from fedjax_pfl.core import split as split_lib
from fedjax_pfl.core.evaluate import ClientEval, Evaluator
from fedjax_pfl.core.local import LocalResult, LocalTrainer
from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.models.model import Model
from fedjax_pfl.ops import dp

# The stream of a round's key that DP noise draws from (jax.random.fold_in): a private round's
# other keys (sampling, training) stay those of the plain round.
DP_NOISE = 0x0D9

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
    only through `core.gather` / `core.scatter` at the clients of the round's first
    `Engine.sample` (or at the evaluated ids), and that every client starts from the same rows:
    then `--state-placement host` can keep the rows off the devices (`core.hoststate`). Each
    algorithm that declares it is checked bit for bit against device placement
    (tests/core/test_hoststate.py).

    `data_blocks` False declares that the round reads client samples in mapper calls dealt
    otherwise than its training (FedFomo evaluates client-model pairs): host data placement then
    stages each round's samples whole on every device instead of in per-device blocks
    (`core.blocks`). True (the default) is checked at run time: a row dealt to a device without
    its client's samples stops the run with an error."""

    name: str
    init: Callable[[jax.Array, FederatedData], Any]
    round_fn: Callable[[Any, FederatedData, jax.Array], tuple[Any, dict]]
    evaluate: Callable[[Any, FederatedData], dict[str, ClientEval]]
    hparams: Mapping[str, Any]
    evaluate_parts: EvaluateParts | None = None
    host_state: bool = False
    data_blocks: bool = True

    def participants(self, state: Any, data: FederatedData, key: jax.Array) -> jax.Array:
        """The ids of the clients whose samples `round_fn(state, data, key)` reads (jit-able):
        the clients of the round's first `Engine.sample` or `Engine.train`, whichever comes first
        (the sampled clients; every client for pFedMe and TDPFed, which train all of them before
        sampling the uploads). Computed by running `round_fn` only up to that call, so it is the
        round's own sampling code, not a copy of it. Host data placement (`core.Program`) moves
        these clients' samples to the devices before the round."""
        return round_participants(self.round_fn, state, data, key)


class _Participants(Exception):
    """Raised by `Engine.sample` / `Engine.train` while `round_participants` probes a round."""

    def __init__(self, idx: jax.Array):
        super().__init__("round participants")
        self.idx = idx


_PROBING = contextvars.ContextVar("fedjax_pfl_probing_participants", default=False)


def round_participants(round_fn: Callable, state: Any, data: FederatedData,
                       key: jax.Array) -> jax.Array:
    """`Algorithm.participants`: runs `round_fn` until its first `Engine.sample` or
    `Engine.train` and returns that call's client ids (the rest of the round is never traced)."""
    token = _PROBING.set(True)
    try:
        round_fn(state, data, key)
    except _Participants as found:
        return found.idx
    finally:
        _PROBING.reset(token)
    raise ValueError("this algorithm's round_fn neither samples (Engine.sample) nor trains "
                     "(Engine.train) clients: the clients whose data it reads are unknown, so its "
                     "data cannot be streamed from the host (use --data-placement device)")


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
    HParam("dp_clip", float, None,
           "client-level differential privacy of the uplink (DP-FedAvg): each client's update "
           "clipped to this L2 norm C ('inf': no clipping) and the server's sum noised with "
           "--dp-noise-multiplier; unset: no privacy. Only algorithms that declare what they "
           "privatise accept it (docs/privacy.md)",
           check=POSITIVE),
    HParam("dp_noise_multiplier", float, 0.0,
           "z: Gaussian noise of standard deviation z·C on the sum of the clipped updates "
           "(with --dp-clip; --target-epsilon computes it)",
           check=NON_NEGATIVE),
    HParam("dp_clip_quantile", float, None,
           "adaptive clipping (Andrew et al., NeurIPS 2021): the clip norm, starting at "
           "--dp-clip, follows this quantile γ of the clients' update norms, learnt from a noised "
           "count each round (C ← C·exp(−η(b̃ − γ))); unset: a fixed clip",
           check=Check(lambda v: 0 < v < 1, "in (0, 1)")),
    HParam("dp_clip_lr", float, 0.2,
           "η: the step of the adaptive clip's geometric update (with --dp-clip-quantile)",
           check=POSITIVE),
    HParam("dp_count_noise", float, None,
           "σ_b: the noise standard deviation on the adaptive clip's count of unclipped updates "
           "(with --dp-clip-quantile); default: the expected clients per round / 20",
           check=POSITIVE),
    HParam("sampling", str, "fixed",
           "how a round's clients are drawn: 'fixed' (M = ⌊N·rate⌋ distinct clients, uniformly) "
           "or 'poisson' (each client independently with probability rate; the round holds "
           "K slots, K exceeded with probability ≤ 1e-12, unused slots empty). 'poisson' needs "
           "--dp-clip ('inf' for no clipping): only the private server step masks the empty slots",
           choices=("fixed", "poisson")),
)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The common hyperparameters (`COMMON_HPARAMS`, same names, same defaults) that configure the
    shared `Engine`: sampling, the client optimizer, the local-training schedule, the backend and
    evaluation batching. Every factory takes one as its second argument, and its own
    hyperparameters by name, so its signature shows which settings are its own; where a factory
    uses a common setting itself (a fine-tuner's batch size, pFedSOP's η), it reads it from here.

    No field is checked or converted here (`AlgorithmSpec.resolve` validates the flags): a sweep
    passes the traceable ones, e.g. `lr`, as traced arrays (fedjax_pfl.sweep).
    """

    participation: float = 0.25   # fraction of the N real clients sampled per round: M = ⌊N·rate⌋
    local_epochs: int = 1         # E: local epochs per round (unless local_steps is set)
    local_steps: int | None = None  # K: exactly K local minibatch steps per round instead of epochs
    batch_size: int = 10          # B: local minibatch size
    lr: float = 0.05              # client learning rate η of sgd(η, momentum)
    momentum: float = 0.0         # SGD momentum of the client optimizer (0: plain SGD)
    momentum_buffer: str = "reset"  # 'persist': each client's buffer kept across rounds; 'reset'
    drop_last: bool = False       # drop each epoch's last partial batch (⌊n/B⌋ steps, not ⌈n/B⌉)
    backend: str = "chunked"      # how sampled clients run: core.BACKENDS
    chunk_size: int = 0           # clients per chunk (chunked backend, evaluation); 0: automatic
    eval_batch_size: int = 0      # test samples per evaluation batch; 0: automatic
    dp_clip: float | None = None  # C: clip each client's uplink update (None: no privacy)
    dp_noise_multiplier: float = 0.0  # z: noise of std z·C on the sum of clipped updates
    dp_clip_quantile: float | None = None  # γ: adapt the clip to this quantile (None: fixed C)
    dp_clip_lr: float = 0.2       # η: the adaptive clip's geometric step
    dp_count_noise: float | None = None  # σ_b: noise on the count of unclipped updates (None: D/20)
    sampling: str = "fixed"       # 'fixed': M of N without replacement; 'poisson': each w.p. rate

    @classmethod
    def split(cls, hparams: Mapping[str, Any]) -> tuple[EngineConfig, dict[str, Any]]:
        """(the configuration from the common names in `hparams`, absent ones at their
        defaults; the remaining names, an algorithm's own hyperparameters)."""
        names = {f.name for f in dataclasses.fields(cls)}
        config = cls(**{k: v for k, v in hparams.items() if k in names})
        return config, {k: v for k, v in hparams.items() if k not in names}


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
    # The algorithm's test configuration: hyperparameters (common or own) on top of its
    # defaults that keep a test run small and training on the tests' linear model {w, b}
    # (tests/helpers.py): a few local steps where the defaults would run many, both parts
    # non-empty in a split model, persistent momentum rows where the algorithm keeps them. The
    # cross-cutting tests (tests/core/test_sharding.py, tests/core/test_cached_evaluation.py) run
    # every registered algorithm with it on top of their own small common settings. None: not
    # declared (tests/algorithms/test_base.py requires every algorithm to declare one).
    test_hparams: Mapping[str, Any] | None = None
    # What the algorithm privatises under --dp-clip (its uplink: e.g. "the global model's
    # update"); None: it does not support client-level DP, and --dp-clip is refused.
    private_uplink: str | None = None
    # Why it does not (said when --dp-clip is refused), where the reason is known.
    not_private: str | None = None

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

    def build(self, model: Model, hparams: Mapping[str, Any]) -> Algorithm:
        """`factory(model, EngineConfig(common), **own)` from a full set of hyperparameters (e.g.
        `resolve`'s): the common ones (`COMMON_HPARAMS`) go into the engine configuration, this
        algorithm's own ones to the factory by name. Nothing is validated or converted here, so
        a sweep may pass traced arrays (fedjax_pfl.sweep)."""
        config, own = EngineConfig.split(hparams)
        if config.dp_clip is not None and self.private_uplink is None:
            supported = sorted(n for n, sp in _REGISTRY.items() if sp.private_uplink)
            why = f" ({self.not_private})" if self.not_private else ""
            raise ValueError(f"{self.name} does not privatise its uplink (--dp-clip){why}; "
                             f"client-level DP is built for: {', '.join(supported)}")
        if config.sampling == "poisson" and config.dp_clip is None:
            raise ValueError("--sampling poisson needs --dp-clip (use --dp-clip inf for no "
                             "clipping): a round's empty slots are masked out by the private "
                             "server step only")
        if config.dp_clip_quantile is not None:
            from fedjax_pfl.algorithms import _adaptive_clip

            return _adaptive_clip.adaptive_clipping(
                lambda c: self.factory(model, c, **own), config)
        return self.factory(model, config, **own)


_REGISTRY: dict[str, AlgorithmSpec] = {}


# The privacy parameters reach a private algorithm's program only as arithmetic on the uploads
# (`Engine.private_update`, ops/dp.py): every algorithm that privatises its uplink can sweep them.
DP_TRACEABLE = ("dp_clip", "dp_noise_multiplier")


def register(spec: AlgorithmSpec) -> AlgorithmSpec:
    if spec.name in _REGISTRY:
        raise ValueError(f"algorithm {spec.name!r} is registered twice")
    if spec.private_uplink is not None:
        spec = dataclasses.replace(spec, traceable=tuple(dict.fromkeys(spec.traceable + DP_TRACEABLE)))
    _REGISTRY[spec.name] = spec
    return spec


def names() -> list[str]:
    return sorted(_REGISTRY)


def spec(name: str) -> AlgorithmSpec:
    if name not in _REGISTRY:
        raise ValueError(f"unknown algorithm {name!r}; expected one of {names()}")
    return _REGISTRY[name]


def get(name: str, *, model: Model, **hparams: Any) -> Algorithm:
    """Builds algorithm `name` for `model` with validated hyperparameters (others at defaults).
    Its `init(key, data)` first checks that the model fits the data (`check_model_fits`)."""
    s = spec(name)
    resolved = s.resolve(hparams)
    algo = s.build(model, resolved)
    inner_init = algo.init

    def init(key: jax.Array, data: FederatedData):
        check_model_fits(model, data)
        return inner_init(key, data)

    return algo._replace(name=name, hparams=resolved, init=init)


def check_model_fits(model: Model, data: Any) -> None:
    """TypeError / ValueError naming the mismatch unless `data` is a `FederatedData` whose
    samples `model` takes and whose classes its outputs score: a classifier (the default loss,
    softmax cross-entropy, and metric, argmax = label) must give `num_classes` outputs, else
    its loss and accuracy compare output positions with labels of another range. From shapes only (`jax.eval_shape`), so it
    costs one trace of the model and works inside a trace."""
    if not isinstance(data, FederatedData):
        raise TypeError(f"init(key, data): data must be a fedjax_pfl.data.FederatedData, got "
                        f"{type(data).__name__}")
    from fedjax_pfl.models.model import softmax_cross_entropy

    if model.metric is not None or model.loss is not softmax_cross_entropy:
        return          # (a model with its own loss or metric reads its outputs its own way)
    params = jax.eval_shape(model.init, jax.random.key(0))
    x = jax.ShapeDtypeStruct((1,) + tuple(data.input_shape),
                             jnp.int32 if data.token_inputs else jnp.float32)
    try:
        out = jax.eval_shape(model.apply, params, x)
    except Exception as e:                    # (any error of the user's model on this input)
        raise ValueError(f"model {model.name!r} does not take this data's inputs of shape "
                         f"{tuple(data.input_shape)}: {type(e).__name__}: "
                         f"{' '.join(str(e).split())[:300]}") from None
    width = out.shape[-1] if out.shape else None
    if width != data.num_classes:
        raise ValueError(f"model {model.name!r} gives {width} outputs per example but the data "
                         f"{data.name or ''} has {data.num_classes} classes: build the model for "
                         f"num_classes={data.num_classes}")


def expected_clients(config: EngineConfig, num_real: int) -> float:
    """The clients expected per round among `num_real`: M = ⌊N·rate⌋, or q·N under Poisson
    sampling (the private mean's fixed denominator D, the share M/N of SCAFFOLD's and FedDyn's
    server steps, the adaptive clip's D)."""
    if config.sampling == "poisson":
        return config.participation * num_real
    return core.num_sampled_clients(num_real, config.participation)


# ----------------------------------------------------------------------------------------------
# The shared engine pieces an algorithm is assembled from


class Engine:
    """Sampling, local training, evaluation and aggregation configured from the common hparams."""

    def __init__(
        self,
        model: Model,
        config: EngineConfig,
        *,
        client_transform: optax.GradientTransformation | None = None,
        on_step=None,
        optimizer: optax.GradientTransformation | None = None,
        step_fn=None,
    ):
        """`client_transform` is chained before the default client optimizer sgd(lr, momentum);
        `optimizer` replaces both; `step_fn` replaces the default minibatch step and `on_step`
        adds a per-step hook (see LocalTrainer)."""
        self.model = model
        self.config = config
        self.participation = config.participation
        self.persist_opt_state = config.momentum_buffer == "persist" and config.momentum > 0
        self.mapper = core.client_mapper(config.backend, config.chunk_size)
        if optimizer is None:
            optimizer = optax.sgd(config.lr, momentum=config.momentum or None)
            if client_transform is not None:
                optimizer = optax.chain(client_transform, optimizer)
        schedule = ({"steps": config.local_steps} if config.local_steps
                    else {"epochs": config.local_epochs})
        self.trainer = LocalTrainer(
            model, optimizer, batch_size=config.batch_size, mapper=self.mapper,
            drop_last=config.drop_last, on_step=on_step, step_fn=step_fn, **schedule,
        )
        self.evaluator = Evaluator(model, batch_size=config.eval_batch_size, mapper=self.mapper)

    @property
    def poisson(self) -> bool:
        """Whether clients are Poisson-sampled (--sampling poisson)."""
        return self.config.sampling == "poisson"

    def num_sampled(self, data: FederatedData) -> int:
        """The round's slots: M = floor(N·rate) of the N real clients; under Poisson sampling
        its capacity K (`core.poisson_capacity`), of which the unused hold a padding client."""
        if self.poisson:
            return core.poisson_capacity(data.num_real_clients, self.participation)
        return core.num_sampled_clients(data.num_real_clients, self.participation)

    def expected_clients(self, data: FederatedData) -> float:
        """`expected_clients` of this engine's configuration."""
        return expected_clients(self.config, data.num_real_clients)

    def participating(self, idx: jax.Array, data: FederatedData) -> jax.Array:
        """[slots] bool: which of a round's slots hold a real client (all of them unless
        Poisson sampling left some empty)."""
        return idx < data.num_real_clients

    def num_participants(self, idx: jax.Array, data: FederatedData) -> jax.Array | int:
        """How many clients a round's slots hold: M, or under Poisson sampling the round's |S|
        (its empty slots send and receive nothing; the `comm_*` metrics count these)."""
        if not self.poisson:
            return idx.shape[0]               # (a constant: the fixed-size program is unchanged)
        return jnp.sum(self.participating(idx, data), dtype=jnp.int32)

    def communication(self, idx: jax.Array, data: FederatedData, *, up_floats_per_client,
                      down_floats_per_client, down_clients=None, **more) -> dict[str, jax.Array]:
        """`communication` of a round whose slots are `idx`: each direction counts the round's
        participants (`num_participants`: under Poisson sampling not its empty slots), or, for
        the downlink, `down_clients` where it reaches other clients (pFedMe and TDPFed: every
        client they train)."""
        sent = self.num_participants(idx, data)
        return communication(up_clients=sent, up_floats_per_client=up_floats_per_client,
                             down_clients=sent if down_clients is None else down_clients,
                             down_floats_per_client=down_floats_per_client, **more)

    def sample(self, key: jax.Array, data: FederatedData) -> jax.Array:
        """This round's client ids, deterministic in `key`: M of them, sorted ascending, or, when
        clients are split over several devices, in the order that gives every device an equal
        share of the local steps (`core.balanced_order`); rows of the round keep that order
        throughout. Under Poisson sampling: K slots, the participants ascending and the unused
        slots holding the first padding client (`core.sample_poisson`)."""
        if self.poisson:
            if data.num_clients <= data.num_real_clients:
                raise ValueError("Poisson sampling fills a round's unused slots with an empty "
                                 "padding client, and this data has none: pass "
                                 "data.pad_clients(multiple, minimum=1) (core.Program does)")
            idx = core.sample_poisson(key, data.num_real_clients, self.participation,
                                      self.num_sampled(data), data.num_real_clients)
        else:
            idx = core.sample_clients(key, data.num_real_clients, self.num_sampled(data))
        devices = 1 if self.mapper.mesh is None else self.mapper.mesh.size
        if devices > 1:
            steps = self.trainer.num_steps(core.gather(data.clients.train_count, idx))
            idx = idx[core.balanced_order(steps, devices)]
        if _PROBING.get():
            raise _Participants(idx)
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
        if _PROBING.get():
            raise _Participants(idx)
        keys = client_keys(key, idx)
        return self.trainer(data, params, opt_state, core.gather(data.clients, idx), keys,
                            extra=extra, hook_state=hook_state, shared_start=shared_start, ids=idx)

    @property
    def private(self) -> bool:
        """Whether the uplink is privatised (--dp-clip set)."""
        return self.config.dp_clip is not None

    def aggregate(self, start: Params, uploads: Params, weights: jax.Array, key: jax.Array,
                  data: FederatedData, *, idx: jax.Array) -> tuple[Params, dict[str, jax.Array]]:
        """The server's mean of the uploads of the clients `idx` (models, or a model's shared
        part, that started from `start`): Σ_i (w_i / Σ w) θ_i; under --dp-clip, DP-FedAvg's
        `private_update` instead (uniform weights, a fixed denominator). Returns (the mean, the
        privacy metrics: none without --dp-clip)."""
        if not self.private:
            return core.mean_over_clients(uploads, weights), {}
        return self.private_update(start, uploads, key, data, idx=idx)

    def private_update(self, start: Params, client_params: Params, key: jax.Array,
                       data: FederatedData, *, idx: jax.Array
                       ) -> tuple[Params, dict[str, jax.Array]]:
        """DP-FedAvg's server step (`ops.dp`): start + (Σ_k clip_C(θ_k − start) + N(0, z²C²))/D
        over the clients k of `idx` that take part, D = the clients expected per round (the
        fixed denominator: M, or q·N under Poisson sampling, whose empty slots add nothing).
        `key` is the round's key; the noise draws from its own stream (fold_in), so the rest of
        the round keeps its keys. Metrics: the fraction of participants clipped, their mean
        update norm."""
        clip = self.config.dp_clip
        if not jax.tree.leaves(client_params):           # nothing is sent (an empty shared part)
            return start, {"dp_clipped_fraction": jnp.zeros(()), "dp_update_norm": jnp.zeros(())}
        mask = self.participating(idx, data) if self.poisson else None
        total, norms = dp.clipped_update_sum(client_params, start, clip, mask=mask)
        mean = dp.noisy_mean(total, jax.random.fold_in(key, DP_NOISE),
                             clip=clip, noise_multiplier=self.config.dp_noise_multiplier,
                             denominator=self.expected_clients(data))
        params = jax.tree.map(jnp.add, start, mean)
        if mask is None:
            return params, {"dp_clipped_fraction": jnp.mean(norms > clip),
                            "dp_update_norm": jnp.mean(norms)}
        count = jnp.maximum(jnp.sum(mask), 1)
        return params, {"dp_clipped_fraction": jnp.sum(mask & (norms > clip)) / count,
                        "dp_update_norm": jnp.sum(jnp.where(mask, norms, 0.0)) / count}

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
    `comm_*` metric over rounds into summary.json's "communication" totals. A round counts its
    participants with `Engine.communication` (under Poisson sampling not the empty slots).
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


# ----------------------------------------------------------------------------------------------
# State types and assemblies shared by several algorithm modules (no algorithm imports a sibling)


class GlobalModelState(NamedTuple):
    """The state of an algorithm that keeps one global model and nothing else per client but
    optimizer states: FedAvg(-FT), FedProx(-FT), Per-FedAvg."""

    params: Any        # global model θ                                  leaves [...]
    opt_state: Any     # per-client optimizer states (momentum_buffer=persist) [N, ...], else None
    round: jax.Array   # rounds completed; shape=(), int32
    rng: jax.Array     # base key for evaluation-time randomness (fine-tuning batch order)
    CLIENT_FIELDS = ("opt_state",)  # per-client rows [N, ...]


class SplitModelState(NamedTuple):
    """The state of FedAvg on part of the model, each client keeping the rest (`split_fedavg`:
    FedPer's head, LG-FedAvg's body)."""

    body: Params       # the averaged leaves θ_B (None on the kept ones)              leaves [...]
    heads: Params      # each client's kept leaves h_i (None on the averaged ones)    leaves [N, ...]
    opt_state: Any     # per-client optimizer states [N, ...] (momentum_buffer=persist), else None
    round: jax.Array   # rounds completed; shape=(), int32
    CLIENT_FIELDS = ("heads", "opt_state")  # per-client rows [N, ...]


def split_fedavg(name: str, model: Model, config: EngineConfig, mask: Any) -> Algorithm:
    """FedAvg (McMahan et al. 2017, Algorithm 1) on the leaves where `mask` is False; each client
    keeps its own copy of the leaves where it is True (FedPer: the head; LG-FedAvg: the body).
    Per round, with θ_B the averaged leaves and h_i client i's kept ones:

        each sampled i ∈ S_t starts from (θ_B, h_i) and runs local SGD on all its parameters
        θ_B ← Σ_{i∈S_t} (n_i / Σ_{k∈S_t} n_k) θ_B,i        FedAvg's sample weights
        h_i ← what client i trained; unsampled clients keep theirs

    Communication: |θ_B| floats down to and up from each sampled client. Evaluated: each
    client's (θ_B, h_i). With nothing kept (mask all False) it is FedAvg bit for bit (one
    shared start); with everything kept, Local.
    """
    engine = Engine(model, config)
    template = jax.eval_shape(model.init, jax.random.key(0))
    has_head = any(jax.tree.leaves(mask))
    body_size = split_lib.count(split_lib.split(template, mask)[0])    # d1: what is communicated

    def init(key: jax.Array, data) -> SplitModelState:
        params = model.init(key)                   # the same initial model as every algorithm
        body, head0 = split_lib.split(params, mask)
        return SplitModelState(body, core.broadcast(head0, data.num_clients),
                               engine.init_client_opt_states(params, data.num_clients),
                               jnp.zeros((), jnp.int32))

    def round_fn(state: SplitModelState, data, key: jax.Array) -> tuple[SplitModelState, dict]:
        sample_key, train_key = jax.random.split(key)
        idx = engine.sample(sample_key, data)                                      # S_t
        m = idx.shape[0]
        if has_head:
            start = split_lib.merge(core.broadcast(state.body, m), core.gather(state.heads, idx), mask)
            opt = engine.opt_states_for(state.opt_state, idx, first_row(start))
            result = engine.train(data, idx, start, opt, train_key)                # (θ_B, h_i)
        else:                                      # no head: one shared start, exactly FedAvg
            opt = engine.opt_states_for(state.opt_state, idx, state.body)
            result = engine.train(data, idx, state.body, opt, train_key, shared_start=True)
        bodies, heads = split_lib.split(result.params, mask)
        weights = core.gather(data.clients.train_count, idx)
        body, private = engine.aggregate(state.body, bodies, weights, key, data, idx=idx)   # θ_B average
        new_state = SplitModelState(
            body, core.scatter(state.heads, idx, heads),                           # keep h_i
            engine.store_opt_states(state.opt_state, idx, result.opt_state), state.round + 1)
        metrics = {**train_metrics(result, idx), **private}
        metrics.update(engine.communication(idx, data, up_floats_per_client=body_size,
                                            down_floats_per_client=body_size))
        return new_state, metrics

    def evaluate(state: SplitModelState, data, ids=None) -> dict[str, core.ClientEval]:
        if not has_head:
            return {"client": engine.evaluator.shared(data, state.body, ids)}
        ids = evaluated_ids(data, ids)
        params = split_lib.merge(core.broadcast(state.body, ids.shape[0]),
                                 core.gather(state.heads, ids), mask)
        return {"client": engine.evaluator.rows(data, params, ids)}

    return Algorithm(name, init, round_fn, evaluate, {}, host_state=True)
