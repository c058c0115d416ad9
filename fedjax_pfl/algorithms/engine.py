"""The shared engine an algorithm is assembled from: its configuration (`EngineConfig`, the
common hyperparameters) and `Engine`, which owns each round's common steps.

A round reads like its paper because everything around the paper's lines is the engine's:

    rnd = engine.begin(data, key)                        # keys and S_t (`Round`)
    trained = engine.train(rnd, state.params, opt_rows=state.opt_state, shared_start=True)
    params, server, agg = engine.aggregate(rnd, state.params, trained.params,
                                           rnd.train_counts, state.server)
    metrics = engine.metrics(rnd, trained, up=d, down=d, server=agg)

  * keys and sampling: `begin` splits the round's key into the sampling key and the
    algorithm's named streams (`streams`, default ("train",)) and samples S_t; `participants`
    gives the same ids without running the round (host and sharded data placement stage them);
  * client optimizer states: `train(..., opt_rows=...)` gathers the sampled clients' stored
    rows (or starts fresh ones) and scatters the trained ones back (`Trained.opt_rows`);
  * the server side: `aggregate` sends the stacked uploads through the one server chain
    (`core.server`): clip → noise (privacy, only there) → reduce → update, assembled from the
    configuration; its state lives in the algorithm's state (`server` field, `init_server`);
  * the metrics every round reports (`metrics`: sampled, train_loss, client_steps, the
    communication counts, the chain's);
  * evaluation of personal and shared models (`evaluation`) and the `Algorithm` itself with its
    declared participants (`algorithm`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_pfl import core
from fedjax_pfl.algorithms.interface import Algorithm, EvaluateParts, evaluated_ids, split_evaluate
from fedjax_pfl.core import server as server_lib
from fedjax_pfl.core.evaluate import Backdoor, ClientEval, Evaluator
from fedjax_pfl.core.local import DataPoison, LocalResult, LocalTrainer
from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.errors import OptionError, arg
from fedjax_pfl.models.model import Model
from fedjax_pfl.ops import attacks, dp, robust, server_opt

Params = Any


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
    # The server optimiser on the mean update (ops/server_opt.py, docs/server-optimisers.md):
    server_opt: str = "sgd"       # sgd | momentum | nesterov | adam | yogi | adagrad
    server_opt_lr: float = 1.0    # η, the server learning rate (sgd at 1: FedAvg's mean itself)
    server_opt_momentum: float = 0.9  # the momentum of 'momentum' / 'nesterov' (FedAvgM)
    server_opt_b1: float = 0.9    # β1: the adaptive optimisers' first-moment decay
    server_opt_b2: float = 0.99   # β2: FedAdam's and FedYogi's second-moment decay
    server_opt_eps: float = 1e-3  # τ: the adaptivity (v_{−1} = τ², the denominator's √v + τ)
    server_opt_bias_correction: bool = False  # 'adam' only: optax.adam's bias-corrected reading
    # The reduction (ops/robust.py, docs/robust-aggregation.md): 'mean' is the weighted mean.
    aggregator: str = "mean"      # mean | median | trimmed_mean | krum | multi_krum | bulyan | ...
    aggregator_beta: float = 0.1  # β: trimmed_mean's fraction trimmed from each end
    aggregator_f: int | None = None  # f: Krum's / Bulyan's Byzantine clients (None: the most)
    aggregator_m: int | None = None  # m: the updates Multi-Krum averages (None: n − f)
    aggregator_iters: int | None = None  # geomed's / centered_clip's steps (None: 5 / 1)
    aggregator_nu: float = 1e-6   # ν: geomed's smoothing
    aggregator_tau: float | None = None  # τ: centered_clip's radius (None: the median distance)
    aggregator_radius: float | None = None  # ρ: norm_bound's radius (None: the median norm)
    # The adversaries (ops/attacks.py, ops/poison.py, docs/attacks.md): ⌈F·N⌉ malicious clients.
    attack: str = "none"          # none | label_flip | backdoor | sign_flip | scale | gaussian | ...
    attack_fraction: float = 0.0  # F: the malicious fraction of the N clients
    attack_redraw: bool = False   # re-draw the malicious set every round (default: one for the run)
    attack_scale: float | None = None  # S of sign_flip / scale (None: 1 / the round's slots M)
    attack_std: float = 1.0       # σ of gaussian's N(0, σ²I) uploads
    attack_z: float | None = None  # z of alie's μ − zσ (None: Baruch et al.'s z_max of n and f)
    attack_eps: float = 0.1       # ε of ipm's −ε·μ
    attack_target: int | None = None  # label_flip's fixed label (None: y → C−1−y); backdoor's (0)
    attack_poison_fraction: float = 0.5  # backdoor: the share of a malicious client's examples
    attack_trigger_size: int = 2  # backdoor: the k of the bottom-right k×k patch (k tokens)
    # Clients that never train (--unseen-clients; no hyperparameter: the run sets them, and
    # `algorithms.get(..., unseen_clients=, unseen_seed=)`): the fraction held out of every
    # round's sampling, and the seed that draws the held-out set (`unseen_ids`).
    unseen_clients: float = 0.0
    unseen_seed: int = 0
    # The seed of the malicious set (--attack-seed; the run's --seed where not given).
    attack_seed: int = 0

    @classmethod
    def split(cls, hparams: Mapping[str, Any]) -> tuple[EngineConfig, dict[str, Any]]:
        """(the configuration from the common names in `hparams`, absent ones at their
        defaults; the remaining names, an algorithm's own hyperparameters)."""
        names = {f.name for f in dataclasses.fields(cls)}
        config = cls(**{k: v for k, v in hparams.items() if k in names})
        return config, {k: v for k, v in hparams.items() if k not in names}


# EngineConfig's fields that are no hyperparameter (not in COMMON_HPARAMS): settings of the
# run (`algorithms.get(..., unseen_clients=, unseen_seed=)`, the run's --unseen-clients, --seed).
RUN_SETTINGS = ("unseen_clients", "unseen_seed", "attack_seed")


def expected_clients(config: EngineConfig, num_real: int) -> float:
    """The clients expected per round among `num_real`: M = ⌊N·rate⌋, or q·N' under Poisson
    sampling, N' the clients that may train (N less the held-out `unseen_ids`; the private
    mean's fixed denominator D, the share M/N of SCAFFOLD's and FedDyn's server steps, the
    adaptive clip's D)."""
    if config.sampling == "poisson":
        return config.participation * (num_real - num_unseen(config.unseen_clients, num_real))
    return core.num_sampled_clients(num_real, config.participation)


# -- clients that never train (--unseen-clients) --------------------------------------------------

# The stream of the run's seed that draws the held-out clients (a numpy Generator seeded with
# [seed, UNSEEN_STREAM]: no other draw of the run uses it).
UNSEEN_STREAM = 57


def num_unseen(fraction: float, num_real: int) -> int:
    """U = ⌈FRAC·N⌉ of the N real clients (pFL-Bench's `unseen_clients_rate`; 1e-9 absorbs a
    decimal fraction's float error: 0.3·10 is 3, not 4)."""
    if not fraction:
        return 0
    return int(math.ceil(float(fraction) * num_real - 1e-9))


def unseen_ids(fraction: float, seed: int, num_real: int) -> np.ndarray:
    """The clients held out of training, ascending int32 [U] (`num_unseen`): a fixed set drawn
    once from the run's seed, the first U of a permutation of 0 … N−1 (every U-subset equally
    likely; the same for the same seed and N, whatever the algorithm or the round). Computed on
    the host: the set is static in every traced round."""
    u = num_unseen(fraction, num_real)
    if u == 0:
        return np.zeros(0, np.int32)
    rng = np.random.default_rng([int(seed), UNSEEN_STREAM])
    return np.sort(rng.permutation(num_real)[:u]).astype(np.int32)


def unseen_mask(fraction: float, seed: int, num_real: int) -> np.ndarray:
    """[N] bool: True for the held-out clients (`unseen_ids`); client_metrics.npz's `unseen`."""
    mask = np.zeros(num_real, bool)
    mask[unseen_ids(fraction, seed, num_real)] = True
    return mask


def check_unseen(config: EngineConfig, num_real: int, trains: str = "sampled") -> None:
    """OptionError (a ValueError) in one line, naming the options (`errors.arg`), where
    --unseen-clients cannot hold clients out: a fraction outside
    [0, 1), fewer clients left than a round samples (M = ⌊N·rate⌋ of all N, or under Poisson
    sampling none at all), or an algorithm that trains every client each round."""
    fraction = config.unseen_clients
    if not 0.0 <= fraction < 1.0:
        raise OptionError(f"{arg('unseen_clients')} must be in [0, 1), got {fraction!r}")
    u = num_unseen(fraction, num_real)
    if u == 0:
        return
    if trains == "all":
        raise OptionError(f"{arg('unseen_clients')}: this algorithm trains every client each round "
                          "(its uploads alone are sampled), so no client can be held out of "
                          "training")
    left = num_real - u
    m = (1 if config.sampling == "poisson"
         else core.num_sampled_clients(num_real, config.participation))
    if left < m:
        raise OptionError(f"{arg('unseen_clients')} {fraction:g} holds out {u} of {num_real} "
                          f"clients, leaving {left}: fewer than the {m} a round samples (lower "
                          f"{arg('unseen_clients')} or {arg('participation', 'hparams')})")


# -- the malicious clients (--attack-fraction) -------------------------------------------------

# The stream of the attack seed that draws the fixed malicious set (a numpy Generator seeded
# with [seed, ATTACK_STREAM]), and the stream of a round's key that re-draws it (--attack-redraw).
ATTACK_STREAM = 58
ATTACK_REDRAW = 0x0A7


def num_malicious(fraction: float, num_real: int) -> int:
    """K = ⌈F·N⌉ of the N real clients (as `num_unseen`: 1e-9 absorbs a decimal fraction's
    float error, 0.3·10 is 3)."""
    if not fraction:
        return 0
    return int(math.ceil(float(fraction) * num_real - 1e-9))


def malicious_mask(fraction: float, seed: int, num_real: int) -> np.ndarray:
    """[N] bool, the fixed malicious set of a run: the first K = ⌈F·N⌉ (`num_malicious`) of a
    permutation of 0 … N−1 drawn from `seed` (every K-subset equally likely; the same for the
    same seed and N, whatever the algorithm). client_metrics.npz's `malicious`."""
    mask = np.zeros(num_real, bool)
    k = num_malicious(fraction, num_real)
    if k:
        mask[np.random.default_rng([int(seed), ATTACK_STREAM]).permutation(num_real)[:k]] = True
    return mask


def redrawn_mask(key: jax.Array, seed: int, fraction: float, num_real: int,
                 num_clients: int | None = None) -> jax.Array:
    """[num_clients] bool, a round's malicious set under --attack-redraw: the first K of a
    permutation of 0 … N−1 drawn from fold_in(fold_in(round key, ATTACK_REDRAW), seed), so it
    changes every round and with the seed; padding clients (ids ≥ N) are never malicious.
    Traceable (the round's key); the host computes the same from the round keys."""
    num_clients = num_real if num_clients is None else num_clients
    k = num_malicious(fraction, num_real)
    draw = jax.random.fold_in(jax.random.fold_in(key, ATTACK_REDRAW), seed)
    chosen = jax.random.permutation(draw, num_real)[:k]
    return jnp.zeros(num_clients, bool).at[chosen].set(True)


class Round(NamedTuple):
    """One round's common inputs, drawn by `Engine.begin` from the round's key."""

    data: FederatedData
    key: jax.Array                 # the round's key (the server chain folds its noise from it)
    idx: jax.Array                 # S_t: the round's client slots, [M] int32
    keys: Mapping[str, jax.Array]  # the algorithm's named key streams ("train", …)
    attackers: jax.Array | None = None  # [N] bool: the round's malicious clients (None: none)

    def malicious(self, idx: jax.Array | None = None) -> jax.Array | None:
        """[M] bool: which of the slots `idx` (default S_t) hold a malicious client."""
        if self.attackers is None:
            return None
        return self.attackers[self.idx if idx is None else idx]

    @property
    def m(self) -> int:
        """M, the round's slots (static)."""
        return self.idx.shape[0]

    @property
    def train_counts(self) -> jax.Array:
        """[M] the sampled clients' training sample counts n_i (FedAvg's weights)."""
        return core.gather(self.data.clients.train_count, self.idx)


class Trained(NamedTuple):
    """`Engine.train`'s result: `LocalResult`'s fields (leading axis M) and the stored optimizer
    rows with the trained clients' written back (`opt_rows`, when the call was given them)."""

    params: Params
    opt_state: Any
    hook_state: Any
    loss: jax.Array
    num_steps: jax.Array
    opt_rows: Any = None


class Engine:
    """Sampling, local training, the server chain, evaluation and the round's common metrics,
    configured from the common hyperparameters (module docstring)."""

    def __init__(
        self,
        model: Model,
        config: EngineConfig,
        *,
        client_transform: optax.GradientTransformation | None = None,
        on_step=None,
        optimizer: optax.GradientTransformation | None = None,
        step_fn=None,
        streams: Sequence[str] = ("train",),
        trains: str = "sampled",
    ):
        """`client_transform` is chained before the default client optimizer sgd(lr, momentum);
        `optimizer` replaces both; `step_fn` replaces the default minibatch step and `on_step`
        adds a per-step hook (see LocalTrainer). `streams` names the keys `begin` splits from a
        round's key after the sampling key (jax.random.split(key, 1 + len(streams))). `trains`
        is "sampled" (a round trains S_t) or "all" (pFedMe and TDPFed train every client, then
        sample the uploads): the clients whose samples a round reads (`participants`)."""
        if trains not in ("sampled", "all"):
            raise ValueError(f"trains must be 'sampled' or 'all', got {trains!r}")
        self.model = model
        self.config = config
        self.participation = config.participation
        self.streams = tuple(streams)
        self.trains = trains
        self.persist_opt_state = config.momentum_buffer == "persist" and config.momentum > 0
        if not 0.0 <= config.unseen_clients < 1.0:
            raise ValueError(f"--unseen-clients must be in [0, 1), got {config.unseen_clients!r}")
        if config.unseen_clients and trains == "all":
            check_unseen(config, 1, trains)      # (any client count: the refusal is the rule's)
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
        self.poison = data_poison(config)
        backdoor = (None if self.poison is None or self.poison.kind != "backdoor"
                    else Backdoor(self.poison.target or 0, self.poison.size))
        self.evaluator = Evaluator(model, batch_size=config.eval_batch_size, mapper=self.mapper,
                                   backdoor=backdoor)
        self.server = server_chain(config)

    # -- sampling ---------------------------------------------------------------------------------

    @property
    def poisson(self) -> bool:
        """Whether clients are Poisson-sampled (--sampling poisson)."""
        return self.config.sampling == "poisson"

    def num_sampled(self, data: FederatedData) -> int:
        """The round's slots: M = floor(N·rate) of the N real clients (held-out clients or not:
        a round's size does not depend on --unseen-clients); under Poisson sampling its
        capacity K (`core.poisson_capacity`) for the N' clients that may train, of which the
        unused hold a padding client."""
        if self.poisson:
            return core.poisson_capacity(len(self.seen_ids(data)), self.participation)
        return core.num_sampled_clients(data.num_real_clients, self.participation)

    def unseen_ids(self, data: FederatedData) -> np.ndarray:
        """The clients held out of every round (`unseen_ids`, [U] ascending; none by default),
        checked against the round's size (`check_unseen`)."""
        check_unseen(self.config, data.num_real_clients, self.trains)
        return unseen_ids(self.config.unseen_clients, self.config.unseen_seed,
                          data.num_real_clients)

    def seen_ids(self, data: FederatedData) -> np.ndarray:
        """[N − U] ascending: the real clients a round may sample (all N without a holdout)."""
        return np.setdiff1d(np.arange(data.num_real_clients, dtype=np.int32),
                            self.unseen_ids(data)).astype(np.int32)

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

    def sample(self, key: jax.Array, data: FederatedData) -> jax.Array:
        """This round's client ids, deterministic in `key`: M of them, sorted ascending, or, when
        clients are split over several devices, in the order that gives every device an equal
        share of the local steps (`core.balanced_order`); rows of the round keep that order
        throughout. Under Poisson sampling: K slots, the participants ascending and the unused
        slots holding the first padding client (`core.sample_poisson`).

        Held-out clients (--unseen-clients, `unseen_ids`) are never drawn: the round samples
        among the N' = N − U others (M of them; under Poisson each with probability rate) and
        maps the draw through their ascending ids, so the ids stay ascending. Without a
        holdout the draw is the one it always was, bit for bit."""
        seen = self.seen_ids(data)
        held_out = len(seen) < data.num_real_clients
        if self.poisson:
            if data.num_clients <= data.num_real_clients:
                raise ValueError("Poisson sampling fills a round's unused slots with an empty "
                                 "padding client, and this data has none: pass "
                                 "data.pad_clients(multiple, minimum=1) (core.Program does)")
            pad = data.num_real_clients
            idx = core.sample_poisson(key, len(seen), self.participation,
                                      self.num_sampled(data), len(seen) if held_out else pad)
            if held_out:                           # slot k < N' -> seen[k]; empty -> the pad id
                idx = jnp.where(idx < len(seen), jnp.asarray(seen)[jnp.minimum(idx, len(seen) - 1)],
                                pad).astype(jnp.int32)
        elif held_out:
            idx = jnp.asarray(seen)[core.sample_clients(key, len(seen), self.num_sampled(data))]
        else:
            idx = core.sample_clients(key, data.num_real_clients, self.num_sampled(data))
        devices = 1 if self.mapper.mesh is None else self.mapper.mesh.size
        if devices > 1:
            steps = self.trainer.num_steps(core.gather(data.clients.train_count, idx))
            idx = idx[core.balanced_order(steps, devices)]
        return idx

    def begin(self, data: FederatedData, key: jax.Array) -> Round:
        """The round's keys and clients: the key split into the sampling key and the named
        `streams`, and S_t sampled from the first (`sample`)."""
        keys = jax.random.split(key, 1 + len(self.streams))
        return Round(data, key, self.sample(keys[0], data), dict(zip(self.streams, keys[1:])),
                     self.attackers(data, key))

    def attackers(self, data: FederatedData, key: jax.Array) -> jax.Array | None:
        """[N] bool: the malicious clients of the round of `key` (--attack-fraction F > 0;
        None without): the run's fixed set (`malicious_mask`, a constant of the program) or,
        with --attack-redraw, the round's own (`redrawn_mask`). Padding clients are never
        malicious."""
        config = self.config
        if not config.attack_fraction:
            return None
        n, n_all = data.num_real_clients, data.num_clients
        if config.attack_redraw:
            return redrawn_mask(key, config.attack_seed, config.attack_fraction, n, n_all)
        mask = np.zeros(n_all, bool)
        mask[:n] = malicious_mask(config.attack_fraction, config.attack_seed, n)
        return jnp.asarray(mask)

    def everyone(self, data: FederatedData) -> jax.Array:
        """[N] every client's id (an algorithm that trains all of them: `trains="all"`)."""
        return jnp.arange(data.num_clients, dtype=jnp.int32)

    def participants(self, data: FederatedData, key: jax.Array) -> jax.Array:
        """The ids of the clients whose samples the round of `key` reads: its S_t (`begin`), or
        every client where the algorithm trains all. Host and sharded data placement move these
        clients' samples to the devices before the round; nothing of the round is traced."""
        if self.trains == "all":
            return self.everyone(data)
        return self.begin(data, key).idx

    # -- local training ---------------------------------------------------------------------------

    def init_opt_rows(self, params: Params, num_clients: int) -> Any:
        """[N] per-client optimizer states when they persist across rounds, else None."""
        if not self.persist_opt_state:
            return None
        return core.broadcast(self.trainer.init_opt_state(params), num_clients)

    def train(
        self,
        rnd: Round,
        start: Params,
        *,
        opt_rows: Any = None,
        opt_state: Any = None,
        key: jax.Array | None = None,
        idx: jax.Array | None = None,
        data: FederatedData | None = None,
        extra: dict | None = None,
        hook_state: Any = None,
        shared_start: bool = False,
        trainer: LocalTrainer | None = None,
        opt_like: Params | None = None,
    ) -> Trained:
        """Local training of the round's clients (`idx`, default S_t), starting from `start`
        ([M, ...]; or one model for all of them with `shared_start`), with the round's "train"
        key (or `key`) on the round's data (or `data`), by the engine's trainer (or `trainer`:
        another phase of local training, FedRep's head and body).

        Optimizer states: `opt_rows` the stored per-client rows ([N, ...]; None when they do not
        persist): the clients' rows are gathered and the trained ones scattered back into
        `Trained.opt_rows`; or `opt_state` the clients' states ([M, ...]); neither: fresh states
        for a model shaped like `start` (or `opt_like`, where the trained carry holds more than
        the optimised model: MOON's).

        Under data poisoning (--attack label_flip / backdoor) the trainer is its poisoned copy
        (`LocalTrainer.poisoned`), the round's malicious slots among `idx` poisoning their
        batches; every other client's training is the plain one."""
        idx = rnd.idx if idx is None else idx
        data = rnd.data if data is None else data
        key = rnd.keys["train"] if key is None else key
        trainer = self.trainer if trainer is None else trainer
        one = opt_like if opt_like is not None else start if shared_start else first_row(start)
        if opt_state is None:
            if opt_rows is not None and self.persist_opt_state:
                opt_state = core.gather(opt_rows, idx)
            else:
                opt_state = core.broadcast(trainer.init_opt_state(one), idx.shape[0])
        keys = client_keys(key, idx)
        malicious = None
        if self.poison is not None and rnd.attackers is not None:   # (--attack label_flip, …)
            trainer, malicious = trainer.poisoned(self.poison), rnd.malicious(idx)
        result = trainer(data, start, opt_state, core.gather(data.clients, idx), keys,
                         extra=extra, hook_state=hook_state, shared_start=shared_start, ids=idx,
                         malicious=malicious)
        rows = opt_rows
        if opt_rows is not None and self.persist_opt_state:
            rows = core.scatter(opt_rows, idx, result.opt_state)
        return Trained(*result, opt_rows=rows)

    def run_loop(self, loop: core.ClientLoop, *, probe: Callable | None = None,
                 stage: str = "client loop") -> Callable:
        """A jitted `run(shared, rows, ids)` of one client's computation written as a
        `core.ClientLoop` (steps over its own data, such as FedALA's weight learning), mapped
        over the clients' rows by this engine's mapper like local training (vmapped, chunked
        by length or looped; `probe(*shared, row)` is one step, for the automatic chunk size).
        Build it once, in the factory."""
        mapper = self.mapper

        def run(shared: tuple, rows: Any, ids: jax.Array | None = None):
            return mapper.run(loop, rows, shared=shared, probe=probe, ids=ids, stage=stage)

        return core.jit_unless_loop(mapper, run)

    # -- the server side --------------------------------------------------------------------------

    @property
    def private(self) -> bool:
        """Whether the uplink is privatised (--dp-clip set)."""
        return self.config.dp_clip is not None

    def init_server(self, start: Params, data: FederatedData) -> dict:
        """The server chain's initial state for a server value shaped like `start` (no leaves
        unless a link keeps state: the adaptive clip's C_t). Checks the chain's settings that
        need the data (the adaptive clip's noise split)."""
        if self.config.dp_clip_quantile is not None:
            check_adaptive_clip(self.config, data.num_real_clients)
        check_aggregator(self.config, self.num_sampled(data))
        return self.server.init(start)

    def aggregate(self, rnd: Round, start: Params, uploads: Params, weights: jax.Array | None,
                  server: dict) -> tuple[Params, dict, dict[str, jax.Array]]:
        """The server's new value from the round's uploads (models, or a model's shared part,
        that started from `start`; updates with a zero `start`) through the server chain:
        FedAvg's Σ_i (w_i / Σ w) θ_i, or under --dp-clip DP-FedAvg's start + (Σ clip_C(θ_i −
        start) + N(0, z²C²))/D over the participants (uniform weights, the fixed denominator D).
        Returns (the new value, the chain's new state, its metrics)."""
        context = server_lib.Context(
            key=rnd.key, slots=rnd.m,
            mask=self.participating(rnd.idx, rnd.data) if self.poisson else None,
            expected=self.expected_clients(rnd.data), malicious=rnd.malicious())
        return self.server(start, uploads, weights, server, context)

    # -- metrics ----------------------------------------------------------------------------------

    def metrics(self, rnd: Round, trained: Trained | LocalResult, *, up=None, down=None,
                down_clients=None, server: Mapping[str, jax.Array] | None = None,
                **more) -> dict[str, jax.Array]:
        """The metrics every round reports: "sampled" (S_t), "train_loss" and "client_steps" of
        `trained` (and "trained", every id, where the algorithm trains all), the communication
        counts (`communication`: `up` and `down` floats per participant; `down_clients` where
        the downlink reaches other clients; `more` adds comm_<name> totals; none for an
        algorithm that sends nothing, up and down None), and the server chain's metrics."""
        out = {"sampled": rnd.idx, "train_loss": trained.loss,
               "client_steps": jnp.sum(trained.num_steps)}
        if self.trains == "all":
            out["trained"] = self.everyone(rnd.data)
        if up is not None or down is not None:
            sent = self.num_participants(rnd.idx, rnd.data)
            out.update(communication(up_clients=sent, up_floats_per_client=up,
                                     down_clients=sent if down_clients is None else down_clients,
                                     down_floats_per_client=down, **more))
        out.update(server or {})
        return out

    # -- evaluation and the algorithm ------------------------------------------------------------

    def evaluate_after_training(self, trainer: LocalTrainer, data: FederatedData, params: Params,
                                key: jax.Array, ids: jax.Array | None) -> ClientEval:
        """Each evaluated client (`ids`, or all) trains its own copy of the shared model `params`
        with `trainer` (FT's fine-tuning, Per-FedAvg's adaptation step), from a fresh optimizer
        state, and is evaluated with the model it ends with."""
        ids = evaluated_ids(data, ids)
        opt = core.broadcast(trainer.init_opt_state(params), ids.shape[0])
        trained = trainer(data, params, opt, core.gather(data.clients, ids), client_keys(key, ids),
                          shared_start=True, ids=ids)
        return self.evaluator.rows(data, trained.params, ids)

    def evaluation(self, *, personal: Callable[[Any], Params] | None = None,
                   shared: Callable[[Any], Params] | None = None,
                   fine_tuner: LocalTrainer | None = None
                   ) -> tuple[Callable, EvaluateParts | None]:
        """(evaluate, evaluate_parts) of an algorithm whose clients use a personal model kept
        per client (`personal(state)`: leaves [N, ...], "client") and/or a shared one
        (`shared(state)`: "global", or "client" when there is no personal model). Personal
        models change only where a round samples them: they are the cached part.

        `fine_tuner`: each client's model is the shared one trained on its own data first
        (`evaluate_after_training`: FedAvg-FT's fine-tuning, FedBABU's, Per-FedAvg's
        adaptation), "client", beside the shared one, "global"; the batch order's key is
        fold_in(state.rng, state.round), so every evaluation of a state gives the same numbers."""
        if fine_tuner is not None:
            def tuned(state, data, ids=None) -> dict[str, ClientEval]:
                global_eval = self.evaluator.shared(data, shared(state), ids)
                key = jax.random.fold_in(state.rng, state.round)
                client = self.evaluate_after_training(fine_tuner, data, shared(state), key, ids)
                return {"client": client, "global": global_eval}

            return tuned, None

        def rows(state, data, ids=None) -> dict[str, ClientEval]:
            return {"client": self.evaluator.personal(data, personal(state), ids)}

        def rest(state, data, ids=None) -> dict[str, ClientEval]:
            return {"global": self.evaluator.shared(data, shared(state), ids)}

        if personal is None:
            def evaluate(state, data, ids=None) -> dict[str, ClientEval]:
                return {"client": self.evaluator.shared(data, shared(state), ids)}

            return evaluate, None
        return split_evaluate(rows, rest if shared is not None else None)

    def algorithm(self, name: str, init: Callable, round_fn: Callable, evaluate: Callable,
                  evaluate_parts: EvaluateParts | None = None, *, host_state: bool = False,
                  data_blocks: bool = True) -> Algorithm:
        """The `Algorithm`, its participants declared by this engine (`participants`) and its
        model's frozen parameters (`Model.frozen`)."""
        return Algorithm(name, init, round_fn, evaluate, {}, evaluate_parts,
                         host_state=host_state, data_blocks=data_blocks,
                         participants=self.participants, frozen=self.model.frozen)


# -- the server chain from the configuration ------------------------------------------------------


def server_chain(config: EngineConfig) -> server_lib.ServerChain:
    """The server side of `config`'s rounds (`core.server`): without --dp-clip FedAvg's weighted
    mean, or the robust rule of --aggregator in its place (`reduction`); with it DP-FedAvg's
    clip → noised mean → update, the clip fixed or adapted (--dp-clip-quantile, Andrew et al.
    2021); the update a server optimiser's step where --server-opt / --server-lr set one
    (`server_update`: it steps along the robust mean update too)."""
    if config.dp_clip_quantile is not None:
        check_adaptive_clip(config)
    require_choices(attack=(config.attack, attacks.ATTACKS))
    if config.attack in attacks.MODEL_ATTACKS and config.attack_fraction:
        # The malicious uploads are replaced before anything else: what a client sends.
        first = model_attack(config)
        return server_lib.ServerChain((first,) + server_chain(
            dataclasses.replace(config, attack="none")).links)
    update = server_update(config)
    if config.dp_clip is None:
        return server_lib.chain(reduction(config), update)
    if config.aggregator != "mean":
        raise ValueError(f"--aggregator {config.aggregator} is not defined with --dp-clip: the "
                         "server's estimate is one noised sum of clipped updates, not a rule "
                         "over the clients' updates")
    if config.dp_clip_quantile is None:
        return server_lib.chain(server_lib.clip(config.dp_clip),
                                server_lib.noised_mean(config.dp_noise_multiplier), update)
    sigma = lambda context: count_noise(config, context.expected)
    return server_lib.chain(
        server_lib.adaptive_clip(config.dp_clip, quantile=config.dp_clip_quantile,
                                 lr=config.dp_clip_lr, count_noise=sigma),
        server_lib.noised_mean(lambda context: dp.update_noise_multiplier(
            config.dp_noise_multiplier, sigma(context))),
        update)


def data_poison(config: EngineConfig) -> DataPoison | None:
    """The data poisoning of the malicious clients' training (--attack label_flip / backdoor
    with --attack-fraction > 0; `core.local.DataPoison`), or None."""
    if config.attack not in attacks.DATA_ATTACKS or not config.attack_fraction:
        return None
    target = config.attack_target
    if config.attack == "backdoor" and target is None:
        target = 0
    return DataPoison(config.attack, target, float(config.attack_poison_fraction),
                      int(config.attack_trigger_size), int(config.attack_seed))


def model_attack(config: EngineConfig) -> server_lib.ServerLink:
    """The chain's first link under a model-poisoning --attack (`core.server.model_attack`)."""
    return server_lib.model_attack(config.attack, scale=config.attack_scale,
                                   std=config.attack_std, z=config.attack_z,
                                   eps=config.attack_eps)


def reduction(config: EngineConfig) -> server_lib.ServerLink:
    """The chain's reduction: the weighted mean (--aggregator mean, today's link, bit for bit)
    or `core.server.robust_mean` with the rule's settings (docs/robust-aggregation.md)."""
    require_choices(aggregator=(config.aggregator, robust.AGGREGATORS))
    if config.aggregator == "mean":
        return server_lib.weighted_mean()
    return server_lib.robust_mean(
        config.aggregator, beta=config.aggregator_beta, f=config.aggregator_f,
        m=config.aggregator_m, iters=config.aggregator_iters, nu=config.aggregator_nu,
        tau=config.aggregator_tau, radius=config.aggregator_radius)


def check_aggregator(config: EngineConfig, slots: int) -> None:
    """ValueError naming the flag where a round's `slots` M are too few for --aggregator's
    settings (Krum's and Multi-Krum's 2f + 2 < M, Bulyan's M ≥ 4f + 3, Multi-Krum's m ≤ M;
    the trimmed mean's β < 1/2 always leaves something)."""
    kind = config.aggregator
    if kind in ("krum", "multi_krum", "bulyan"):
        f = robust.default_f(kind, slots) if config.aggregator_f is None else config.aggregator_f
        try:
            robust.check_f(kind, f, slots)
        except ValueError as e:
            raise ValueError(f"--aggregator {kind} --aggregator-f {f}: {e} (lower "
                             "--aggregator-f or sample more clients a round)") from None
        m = config.aggregator_m
        if kind == "multi_krum" and m is not None and not m <= slots:
            raise ValueError(f"--aggregator-m {m} exceeds the {slots} clients a round")


def plain_server_step(config: EngineConfig) -> bool:
    """Whether the server's step is FedAvg's own (--server-opt sgd at --server-lr 1, concrete):
    then the chain has no optimiser link at all, so the mean stays the mean bit for bit
    (start + 1·(mean − start) is not the mean in floating point)."""
    lr = config.server_opt_lr
    return (config.server_opt == "sgd" and not isinstance(lr, jax.core.Tracer)
            and float(lr) == 1.0)


def server_update(config: EngineConfig) -> server_lib.ServerLink:
    """The chain's last link: `apply_update` for the plain step (`plain_server_step`), else
    the server optimiser of --server-opt (`ops.server_opt.server_transform`, Reddi et al. 2021
    Algorithm 2) on the mean update."""
    if plain_server_step(config):
        return server_lib.apply_update()
    require_choices(server_opt=(config.server_opt, server_opt.SERVER_OPTIMISERS))
    return server_lib.server_optimizer(server_opt.server_transform(
        config.server_opt, lr=config.server_opt_lr, momentum=config.server_opt_momentum,
        b1=config.server_opt_b1, b2=config.server_opt_b2, eps=config.server_opt_eps,
        bias_correction=bool(config.server_opt_bias_correction)))


def count_noise(config: EngineConfig, expected):
    """σ_b of the adaptive clip's count: --dp-count-noise, or D/20 (Andrew et al., Section
    3.1); 0 without noise (z = 0)."""
    sigma = config.dp_count_noise if config.dp_count_noise is not None else expected / 20.0
    z = config.dp_noise_multiplier
    if isinstance(z, jax.core.Tracer):                  # (swept)
        return jnp.where(z > 0, sigma, 0.0)
    return float(sigma) if z > 0 else 0.0


def check_adaptive_clip(config: EngineConfig, num_real: int | None = None) -> None:
    """ValueError naming the flag, for adaptive-clip settings that can be checked before
    tracing (the noise split needs the clients: `num_real`)."""
    if config.dp_clip is None:
        raise ValueError("--dp-clip-quantile needs --dp-clip (the initial clip norm C_0)")
    if not 0.0 < config.dp_clip_quantile < 1.0:
        raise ValueError(f"--dp-clip-quantile must be in (0, 1), got {config.dp_clip_quantile!r}")
    concrete = not isinstance(config.dp_clip, jax.core.Tracer)
    if concrete and not math.isfinite(config.dp_clip):
        raise ValueError("--dp-clip-quantile adapts a finite --dp-clip (C_0), got inf")
    z = config.dp_noise_multiplier
    if num_real is None or isinstance(z, jax.core.Tracer) or not z > 0:
        return
    sigma = float(count_noise(config, expected_clients(config, num_real)))
    if not 2 * sigma > z:
        raise ValueError(
            f"--dp-clip-quantile: the count's noise σ_b = {sigma:.3g} must exceed z/2 = {z / 2:.3g} "
            "(the update noise z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) keeps the accounted z): raise "
            "--dp-count-noise, or sample more clients a round")


def client_keys(key: jax.Array, idx: jax.Array) -> jax.Array:
    """One key per client, folded from the client id: a client's batch order in a round does not
    depend on which other clients were sampled or on their order (vmap == loop)."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, idx)


def communication(*, up_clients, up_floats_per_client, down_clients,
                  down_floats_per_client, **more) -> dict[str, jax.Array]:
    """Floats sent in one round, each direction summed over clients, as round metrics.

    `comm_up_floats` (clients → server) and `comm_down_floats` (server → clients); `more` adds
    variants under `comm_<name>` (e.g. the downlink with a dense tensor). The runner sums every
    `comm_*` metric over rounds into summary.json's "communication" totals. A round counts its
    participants with `Engine.metrics` (under Poisson sampling not the empty slots).
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
