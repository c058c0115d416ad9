"""The shared engine an algorithm is assembled from: its configuration (`EngineConfig`, the
common hyperparameters), sampling, local training, evaluation and the server's aggregation
(`Engine`), and the round's common metrics (`train_metrics`, `communication`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import optax

from fedjax_pfl import core
from fedjax_pfl.algorithms.interface import _PROBING, _Participants, evaluated_ids
from fedjax_pfl.core.evaluate import Evaluator
from fedjax_pfl.core.local import LocalResult, LocalTrainer
from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.models.model import Model
from fedjax_pfl.ops import dp

# The stream of a round's key that DP noise draws from (jax.random.fold_in): a private round's
# other keys (sampling, training) stay those of the plain round.
DP_NOISE = 0x0D9

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

    @classmethod
    def split(cls, hparams: Mapping[str, Any]) -> tuple[EngineConfig, dict[str, Any]]:
        """(the configuration from the common names in `hparams`, absent ones at their
        defaults; the remaining names, an algorithm's own hyperparameters)."""
        names = {f.name for f in dataclasses.fields(cls)}
        config = cls(**{k: v for k, v in hparams.items() if k in names})
        return config, {k: v for k, v in hparams.items() if k not in names}


def expected_clients(config: EngineConfig, num_real: int) -> float:
    """The clients expected per round among `num_real`: M = ⌊N·rate⌋, or q·N under Poisson
    sampling (the private mean's fixed denominator D, the share M/N of SCAFFOLD's and FedDyn's
    server steps, the adaptive clip's D)."""
    if config.sampling == "poisson":
        return config.participation * num_real
    return core.num_sampled_clients(num_real, config.participation)



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
