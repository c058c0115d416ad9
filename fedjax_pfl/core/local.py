"""Local training: one client's minibatch loop, written once and shared by every algorithm.

`LocalTrainer` runs E epochs of minibatch optimisation for each sampled client, all clients at
once through a `ClientMapper` (vmap, lanes or loop), inside whatever jit encloses it.

Exact epoch semantics per client (docs/algorithms/README.md#epochs;
pfedsop.md#a6, pgfed.md#a9 there): in every epoch client i
visits each of its own n_i training samples once, in a fresh random order, in
S_i = ⌈n_i/B⌉ steps (or ⌊n_i/B⌋ with drop_last, and one step of all n_i samples when n_i < B, as
PGFed's `batch = min(B, n_i)`). The last partial batch is averaged over its real samples only.
A client's local training is a `ClientLoop` of E·S_i steps: the mapper runs clients in lanes
that take the next client as soon as theirs is done (so no lane runs past its own client), and a
finished client's parameters, optimizer state and hook state do not change.

The epoch order is a keyed pseudo-random permutation of 0 … n_i − 1 (`epoch_permutation`, the
swap-or-not shuffle): step k of epoch e reads positions π_e(kB), …, π_e(kB+B−1) in O(B) work,
so nothing per client is ever as wide as the largest client.

Instead of E epochs, `steps=K` gives every client exactly K minibatch steps (TDPFed's τ local
rounds, FedPC's single stochastic gradient), walking through successive reshuffled epochs of its
own data.

Algorithms change local training by composition, not by writing loops:
  * `optimizer` is any optax transformation; extra per-client inputs (`extra`) are passed to its
    `update` as keyword arguments, so `optax.chain(add_aux_gradient(), optax.sgd(lr))` adds a
    per-client vector to every minibatch gradient (PGFed) and a prox transform can read an anchor;
  * `on_step(hook_state, params, extra) -> hook_state` runs at every active step with the
    parameters BEFORE that step's update and carries its own state (PGFed's α row);
  * `step_fn(params, opt_state, x, y, mask, extra) -> (params, opt_state, loss)` replaces the
    default "one gradient, one optimizer update" for algorithms whose minibatch step is itself
    an inner loop (TDPFed: s prox steps on θ, then s' data-free steps on the CP factors);
  * `FullPass` gives the mean loss and gradient over all of a client's training samples.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_pfl.core.evaluate import auto_eval_batch, input_dtype, trigger_of
from fedjax_pfl.core.execution import ClientLoop, ClientMapper, jit_unless_loop
from fedjax_pfl.data.federated import ClientSplits, FederatedData
from fedjax_pfl.models.model import Model, training_key
from fedjax_pfl.ops import poison as poison_ops

Params = Any
OnStep = Callable[[Any, Params, dict], Any]
StepFn = Callable[..., tuple[Params, Any, jax.Array]]


class TrainRow(NamedTuple):
    """One client's inputs to local training (a row of the mapped arguments)."""

    params: Params        # the client's starting model; None when all start from one model
    opt_state: Any        # its optimizer state
    hook_state: Any       # the `on_step` hook's state
    client: ClientSplits  # where its samples are
    key: jax.Array        # its PRNG key (batch order)
    extra: dict           # per-client inputs of the optimizer and the hook
    malicious: Any = None  # () bool: the client poisons its training data (`DataPoison`)


class TrainCarry(NamedTuple):
    """One client's local-training loop carry between minibatch steps."""

    params: Params
    opt_state: Any
    hook_state: Any
    loss_sum: jax.Array   # Σ of the minibatch losses so far; shape=()
    client: ClientSplits
    key: jax.Array
    extra: dict
    draws: Any = None     # with E epochs: each epoch's `ShuffleDraws`, [E, SHUFFLE_ROUNDS] each
    malicious: Any = None  # () bool, the row's (`TrainRow.malicious`)


class PassCarry(NamedTuple):
    """One client's carry in `FullPass` between batches."""

    params: Params        # the fixed model the pass differentiates
    client: ClientSplits
    loss_sum: jax.Array   # Σ of the per-example losses so far; shape=()
    grad_sum: Params      # Σ of the per-example gradients so far
    units: Any = None     # Σ of the examples' weights (tokens) so far; None: a model without one


class LocalResult(NamedTuple):
    """What local training returns for each client (leading axis M when mapped)."""

    params: Params
    opt_state: Any
    hook_state: Any
    loss: jax.Array       # mean minibatch loss over the client's steps; [M] float32
    num_steps: jax.Array  # steps actually taken, E·S_i (or K); [M] int32


def steps_per_epoch(count: jax.Array, batch_size: int, drop_last: bool = False) -> jax.Array:
    """S_i = ⌈n_i/B⌉, or max(1, ⌊n_i/B⌋) with drop_last; 0 for a client without data."""
    # (NumPy counts give NumPy steps: the host's view of a loop's lengths, `ClientLoop.host_length`)
    xp = np if isinstance(count, np.ndarray) else jnp
    count = xp.asarray(count, xp.int32)
    if drop_last:
        steps = xp.maximum(count // batch_size, 1)
    else:
        steps = (count + batch_size - 1) // batch_size
    return xp.where(count > 0, steps, 0)


SHUFFLE_ROUNDS = 64


def _hash32(x: jax.Array, round_key: jax.Array) -> jax.Array:
    """A 32-bit integer hash of (x, round key) (murmur3's finaliser)."""
    x = (x * jnp.uint32(0x9E3779B1)) ^ round_key
    x = (x ^ (x >> 16)) * jnp.uint32(0x85EBCA6B)
    x = (x ^ (x >> 13)) * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


class ShuffleDraws(NamedTuple):
    """The random part of one epoch's `epoch_permutation`: its rounds' K_r and hash keys."""

    pair: jax.Array       # K_r ∈ [0, n), [SHUFFLE_ROUNDS] int32
    bits: jax.Array       # the rounds' hash keys, [SHUFFLE_ROUNDS] uint32


def shuffle_draws(key: jax.Array, n: jax.Array) -> ShuffleDraws:
    """The draws `epoch_permutation(key, n, ·)` makes from its key."""
    n = jnp.maximum(jnp.asarray(n, jnp.int32), 1)
    pair_key, bit_key = jax.random.split(key)
    return ShuffleDraws(jax.random.randint(pair_key, (SHUFFLE_ROUNDS,), 0, n, dtype=jnp.int32),
                        jax.random.bits(bit_key, (SHUFFLE_ROUNDS,), jnp.uint32))


def epoch_draws(client_key: jax.Array, n: jax.Array, epoch: jax.Array) -> ShuffleDraws:
    """The shuffle draws of a client's epoch: its key is fold_in(client key, epoch)."""
    return shuffle_draws(jax.random.fold_in(client_key, epoch), n)


def epoch_permutation(key: jax.Array, n: jax.Array, positions: jax.Array,
                      unroll: bool | None = None) -> jax.Array:
    """π(positions): a keyed pseudo-random permutation of 0 … n − 1, evaluated pointwise.

    The swap-or-not shuffle (Hoang, Morris & Rogaway, CRYPTO 2012): in round r, with a random
    K_r ∈ [0, n), x is paired with x' = (K_r − x) mod n and the pair is swapped iff a keyed hash
    of max(x, x') is odd. Each round is an involution of 0 … n − 1, so the composition of
    SHUFFLE_ROUNDS rounds is a bijection for any n, and it is close to a uniformly random
    permutation (tests/core/test_local.py checks all 5,040 orders of 7 by chi-square).
    O(rounds) work per position and no memory per client, so a step of B samples costs O(B)
    whatever the client's size. Positions ≥ n return 0 (callers mask them).

    `unroll` (default: on accelerators) unrolls the rounds, which then fuse into one elementwise
    kernel. As a loop, each round costs a GPU two kernel launches, 128 per local step: on an H100
    that made a step of the protocol's CNN 3.5× slower at 6 clients (docs/decisions/shuffle-unroll.md). On
    XLA:CPU the loop runs as fast and compiles about 4 s sooner per program. Same values either way.
    """
    return shuffled(shuffle_draws(key, n), n, positions, unroll)


def shuffled(draws: ShuffleDraws, n: jax.Array, positions: jax.Array,
             unroll: bool | None = None) -> jax.Array:
    """`epoch_permutation` from its draws (`shuffle_draws` of the same n)."""
    n = jnp.maximum(jnp.asarray(n, jnp.int32), 1)
    x = jnp.asarray(positions, jnp.int32)
    inside = (x >= 0) & (x < n)
    x = jnp.where(inside, x, 0)

    def one_round(r, x):
        partner = jnp.mod(draws.pair[r] - x, n)
        swap = (_hash32(jnp.maximum(x, partner).astype(jnp.uint32), draws.bits[r]) & 1) == 1
        return jnp.where(swap, partner, x)

    if unroll is None:
        unroll = jax.default_backend() != "cpu"
    x = jax.lax.fori_loop(0, SHUFFLE_ROUNDS, one_round, x, unroll=bool(unroll))
    return jnp.where(inside, x, 0)


# The stream of the attack seed that picks a backdoor client's poisoned examples.
POISON_STREAM = 0x0B4


class DataPoison(NamedTuple):
    """Data poisoning of a malicious client's training batches (--attack label_flip /
    backdoor; `ops.poison`): hashable, a static part of the trainer.

    label_flip poisons every training example of the client; backdoor the same fixed share
    `fraction` of them in every epoch and round: example j of a client with n examples (its
    position in the client's train split) is poisoned iff π(j) < ⌈fraction·n⌉, π the
    swap-or-not permutation of 0 … n−1 (`shuffled`) keyed by fold_in(key(seed), the client's
    first row), so exactly ⌈fraction·n⌉ of its examples carry the trigger. The trigger's value
    is 1.0 (the top of the normalised input range of every image dataset here) or, for token
    inputs, the vocabulary's last id. Classification tasks only (one label per example)."""

    kind: str                  # "label_flip" | "backdoor"
    target: int | None         # label_flip: None (y → C−1−y) or the label; backdoor: the label
    fraction: float = 1.0      # backdoor: the share of a client's examples poisoned
    size: int = 2              # backdoor: the trigger's k
    seed: int = 0              # backdoor: the seed of the poisoned examples

    def chosen(self, client: ClientSplits, order: jax.Array) -> jax.Array:
        """[B] bool: which of the examples at positions `order` of the client's train split
        are poisoned (all for label_flip)."""
        if self.kind == "label_flip":
            return jnp.ones(order.shape, bool)
        n = client.train_count
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), POISON_STREAM),
                                 client.train_start)
        rank = shuffled(shuffle_draws(key, n), n, order)
        take = jnp.ceil(jnp.float32(self.fraction) * n.astype(jnp.float32) - 1e-6)
        return rank < take.astype(jnp.int32)

    def apply(self, data: FederatedData, x: jax.Array, y: jax.Array, client: ClientSplits,
              order: jax.Array, malicious: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The batch (x, y) of examples `order` as the client trains on it: poisoned where
        `malicious`, as it is otherwise."""
        kind = "classify" if data.task is None else data.task.kind
        if kind != "classify":
            raise ValueError(f"--attack {self.kind} poisons classification labels; this "
                             f"dataset's task is {kind!r} (labels {tuple(y.shape[1:])} per "
                             "example)")
        chosen = malicious & self.chosen(client, order)
        if self.kind == "label_flip":
            return poison_ops.label_flip(x, y, chosen, num_classes=data.num_classes,
                                         target=self.target)
        inputs, value = trigger_of(data)
        return poison_ops.backdoor(x, y, chosen, target=self.target or 0, size=self.size,
                                   value=value, inputs=inputs)


def masked_mean_loss(model: Model, params: Params, x: jax.Array, y: jax.Array, mask: jax.Array) -> jax.Array:
    """Σ_j mask_j ℓ(params; x_j, y_j) / Σ_j mask_j w_j: the mean over the real samples (and, for
    a model with `weight`, their real tokens) of a padded batch."""
    return masked_mean(model, model.loss(model.apply(params, x), y), y, mask)


def masked_mean(model: Model, per_example: jax.Array, y: jax.Array, mask: jax.Array) -> jax.Array:
    """Σ_j mask_j ℓ_j / max(Σ_j mask_j w_j, 1), with w_j = `model.weight(y)_j` (1 without one)."""
    total = jnp.sum(jnp.where(mask, per_example, 0.0))
    if model.weight is None:
        return total / jnp.maximum(jnp.sum(mask), 1)
    units = jnp.sum(jnp.where(mask, model.weight(y), 0.0))
    return total / jnp.maximum(units, 1).astype(total.dtype)


class LocalTrainer:
    """E epochs of minibatch training for a batch of clients (see the module docstring).

    Build it once in an algorithm factory (its per-client function is the jit cache key of the
    loop backend), then call it inside `round_fn`.
    """

    def __init__(
        self,
        model: Model,
        optimizer: optax.GradientTransformation,
        *,
        batch_size: int,
        mapper: ClientMapper,
        epochs: int | None = None,
        steps: int | None = None,
        drop_last: bool = False,
        on_step: OnStep | None = None,
        step_fn: StepFn | None = None,
        poison: DataPoison | None = None,
    ):
        if (epochs is None) == (steps is None):
            raise ValueError("give exactly one of epochs (E passes over each client's data) or "
                             "steps (K minibatch steps per client)")
        if epochs is not None and epochs < 1:
            raise ValueError(f"--local-epochs must be >= 1, got {epochs}")
        if steps is not None and steps < 1:
            raise ValueError(f"--local-steps must be >= 1, got {steps}")
        if batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
        self.model = model
        self.optimizer = optax.with_extra_args_support(optimizer)
        self.epochs = None if epochs is None else int(epochs)
        self.steps = None if steps is None else int(steps)
        self.step_fn = step_fn
        self.batch_size = int(batch_size)
        self.drop_last = bool(drop_last)
        self.mapper = mapper
        self.on_step = on_step
        self.poison = poison
        self._poisoned: dict[DataPoison, LocalTrainer] = {}
        self._build()

    def _build(self) -> None:
        self._loop, self._probe = self._make_loop()
        self._train_many = jit_unless_loop(self.mapper, self._map_clients)
        self._train_many_shared_start = jit_unless_loop(self.mapper,
                                                        self._map_clients_shared_start)

    def poisoned(self, poison: DataPoison) -> "LocalTrainer":
        """This trainer with its malicious clients' batches poisoned by `poison` (built once
        per poison: the same trainer, a loop that reads `TrainRow.malicious`)."""
        if poison not in self._poisoned:
            other = copy.copy(self)
            other.poison, other._poisoned = poison, {}
            other._build()
            self._poisoned[poison] = other
        return self._poisoned[poison]

    def num_steps(self, count: jax.Array) -> jax.Array:
        """Steps each client takes: E·S_i, or K (0 for a client without data)."""
        xp = np if isinstance(count, np.ndarray) else jnp
        if self.steps is not None:
            return xp.where(xp.asarray(count) > 0, self.steps, 0).astype(xp.int32)
        return self.epochs * steps_per_epoch(count, self.batch_size, self.drop_last)

    def init_opt_state(self, params: Params) -> Any:
        """The optimizer state of one client (use `core.broadcast` for a stack)."""
        return self.optimizer.init(params)

    def __call__(
        self,
        data: FederatedData,
        params: Params,
        opt_state: Any,
        clients: ClientSplits,
        keys: jax.Array,
        extra: dict | None = None,
        hook_state: Any = None,
        shared_start: bool = False,
        ids: jax.Array | None = None,
        malicious: jax.Array | None = None,
    ) -> LocalResult:
        """Trains M clients. Every argument but `data` has leading axis M.

        Args:
          data: the federated dataset (shared, not mapped).
          params, opt_state: each client's starting point. With `shared_start`, `params` is ONE
            model that every client starts from (FedAvg's global model): it is not broadcast to
            M copies up front.
          clients: the M clients' splits (`core.gather(data.clients, idx)`).
          keys: [M] PRNG keys (one per client; fold the client id in for order independence).
          extra: per-client inputs for the optimizer and the `on_step` hook.
          hook_state: per-client state carried by `on_step`.
          ids: the M clients' ids (optional): the debug backend names a failing client by it.
          malicious: [M] bool, the clients whose batches the trainer's `poison` poisons (None:
            none; a trainer without `poison` ignores it).
        """
        extra = {} if extra is None else extra
        if self.poison is None:
            malicious = None
        train = self._train_many_shared_start if shared_start else self._train_many
        return train(data, params, opt_state, hook_state, clients, keys, extra, ids, malicious)

    def _map_clients(self, data, params, opt_state, hook_state, clients, keys, extra, ids=None,
                     malicious=None):
        rows = TrainRow(params, opt_state, hook_state, clients, keys, extra, malicious)
        return self.mapper.run(self._loop, rows, shared=(data, None), probe=self._probe, ids=ids,
                               stage="local training")

    def _map_clients_shared_start(self, data, params, opt_state, hook_state, clients, keys, extra,
                                  ids=None, malicious=None):
        rows = TrainRow(None, opt_state, hook_state, clients, keys, extra, malicious)
        return self.mapper.run(self._loop, rows, shared=(data, params), probe=self._probe, ids=ids,
                               stage="local training")

    def _make_loop(self):
        """(loop, probe): one client's local training as a ClientLoop, and one step of it."""
        model, optimizer, on_step, step_fn = self.model, self.optimizer, self.on_step, self.step_fn
        poison = self.poison
        batch, drop_last, epochs = self.batch_size, self.drop_last, self.epochs
        loss_and_grad = jax.value_and_grad(lambda p, x, y, m: masked_mean_loss(model, p, x, y, m))

        def gradient_step(params, opt_state, x, y, mask, extra):
            loss, grads = loss_and_grad(params, x, y, mask)
            updates, opt_state = optimizer.update(grads, opt_state, params, **extra)
            return optax.apply_updates(params, updates), opt_state, loss

        update = step_fn or gradient_step

        def init(shared, row: TrainRow) -> TrainCarry:
            _, start = shared
            params = start if row.params is None else row.params
            draws = None
            if epochs is not None:
                # Every epoch's shuffle drawn here, once, rather than in `step`: the staged
                # execution compiles `step` once per stage (`_run_capped`), and a draw is six
                # threefry calls (the epoch's fold_in, two splits, three bit draws), about a
                # quarter of a small model's round program at the suite's -O0. The same values:
                # vmap over the epochs changes no key. (With K steps there is one stage, and
                # the epoch count is not static: drawn in `step`.)
                draws = jax.vmap(lambda e: epoch_draws(row.key, row.client.train_count, e))(
                    jnp.arange(epochs, dtype=jnp.int32))
            return TrainCarry(params, row.opt_state, row.hook_state, jnp.zeros(()), row.client,
                              row.key, row.extra, draws, row.malicious)

        def step(shared, carry: TrainCarry, t) -> TrainCarry:
            """Minibatch t: the hook (pre-step params), then the update (default: gradient +
            optimizer)."""
            data = shared[0]
            params, opt_state, hook_state, loss_sum, client, key, extra, draws, bad = carry
            count = client.train_count
            per_epoch = jnp.maximum(steps_per_epoch(count, batch, drop_last), 1)
            epoch, k = t // per_epoch, t % per_epoch
            positions = k * batch + jnp.arange(batch)
            # With drop_last only the first S_i·B positions of an epoch are used (all n_i if n_i < B).
            used = jnp.where(count >= batch, per_epoch * batch, count) if drop_last else count
            mask = positions < used
            if draws is None:
                drawn = epoch_draws(key, count, epoch)
            else:
                # (a finished lane of a vmapped loop still computes a step past its last epoch)
                e = jnp.minimum(epoch, epochs - 1)
                drawn = jax.tree.map(lambda d: d[e], draws)
            order = shuffled(drawn, count, positions)
            rows = client.train_start + order
            if on_step is not None:
                hook_state = on_step(hook_state, params, extra)
            x, y = data.inputs(rows), data.labels(rows)
            if poison is not None and bad is not None:
                x, y = poison.apply(data, x, y, client, order, bad)
            with _step_key(model, key, t):
                params, opt_state, loss = update(params, opt_state, x, y, mask, extra)
            return TrainCarry(params, opt_state, hook_state, loss_sum + loss, client, key, extra,
                              draws, bad)

        def finish(shared, carry: TrainCarry) -> LocalResult:
            total = self.num_steps(carry.client.train_count)
            mean_loss = carry.loss_sum / jnp.maximum(total, 1)
            return LocalResult(carry.params, carry.opt_state, carry.hook_state, mean_loss,
                               total.astype(jnp.int32))

        def length(row: TrainRow):
            return self.num_steps(row.client.train_count)

        def probe(data, start, row):
            return step((data, start), init((data, start), row), jnp.zeros((), jnp.int32))

        return ClientLoop(init, step, finish, length, uniform=self.steps is not None,
                          host_length=lambda train, test: self.num_steps(train)), probe


# Folded into a client's key before the step number for its training-mode randomness (a model's
# dropout), apart from the epoch shuffles' fold_in(key, epoch).
_STEP_KEY_SALT = 0x6C6F7261


def _step_key(model: Model, key: jax.Array, t: jax.Array):
    """Step t's key bound for a model that draws randomness in training (`Model.train_key`:
    fold_in(fold_in(key, salt), t)); nothing for the others (their program is unchanged)."""
    if not getattr(model, "train_key", False):
        return contextlib.nullcontext()
    return training_key(jax.random.fold_in(jax.random.fold_in(key, _STEP_KEY_SALT), t))


def add_aux_gradient(name: str = "aux_grad") -> optax.GradientTransformationExtraArgs:
    """g ← g + v, with the per-client vector v passed to `update` as keyword `name`.

    The gradient of f(θ) + ⟨v, θ⟩: PGFed adds its auxiliary gradient g̃_i this way (eq. 10),
    before the momentum buffer (docs/algorithms/pgfed.md#a8).
    """

    def update_fn(updates, state, params=None, **extra_args):
        del params
        vector = extra_args[name]
        return jax.tree.map(lambda g, v: g + v.astype(g.dtype), updates, vector), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


class FullPass:
    """Mean loss and mean gradient over ALL of a client's training samples, at fixed params.

    f_i(θ) = (1/n_i) Σ_j ℓ(θ; x_j, y_j) and ∇f_i(θ) (n_i: the client's samples, or its real
    tokens Σ_j w_j for a model with `weight`), accumulated over batches of `batch_size`
    (memory bound) with a masked last batch, so the result does not depend on the batch size
    (up to float rounding of the sums). batch_size 0: the evaluation's automatic batch
    (`evaluate.auto_eval_batch`, from XLA's memory analysis of the forward pass), 256 for the
    MLPs and 8 for the CNN, whose im2col patches make large batches slower per sample on CPU.
    PGFed uploads these at the end of local training (Algorithm 1 line C10;
    docs/algorithms/pgfed.md#a10).
    """

    def __init__(self, model: Model, *, batch_size: int, mapper: ClientMapper):
        if batch_size < 0:
            raise ValueError(f"full-pass batch must be >= 0 (0: automatic), got {batch_size}")
        self.model = model
        self.batch_size = int(batch_size)
        self.mapper = mapper
        self._per_batch: dict[int, Callable] = {}

    def batch_for(self, data: FederatedData) -> int:
        return self.batch_size or auto_eval_batch(self.model, data.input_shape,
                                                  input_dtype=input_dtype(data))

    def __call__(self, data: FederatedData, params: Params, clients: ClientSplits,
                 ids: jax.Array | None = None) -> tuple[jax.Array, Params]:
        """[M] mean losses and [M, ...] mean gradients for M clients (leading axis M on inputs);
        `ids`, the clients' ids, name a failing client (debug backend) and check data dealt in
        per-device blocks (`core.rows.DeviceBlocks`)."""
        batch = self.batch_for(data)
        if batch not in self._per_batch:
            loop, probe = self._make_loop(batch)
            run = lambda d, p, c, i: self.mapper.run(loop, (p, c), shared=(d,), probe=probe,
                                                     ids=i, stage="full-data pass")
            self._per_batch[batch] = jit_unless_loop(self.mapper, run)
        return self._per_batch[batch](data, params, clients, ids)

    def _make_loop(self, batch: int):
        model = self.model

        def summed_loss(params, x, y, mask):
            per_example = model.loss(model.apply(params, x), y)
            return jnp.sum(jnp.where(mask, per_example, 0.0))

        grad_fn = jax.value_and_grad(summed_loss)

        def init(shared, row) -> PassCarry:
            params, client = row
            units = None if model.weight is None else jnp.zeros(())
            return PassCarry(params, client, jnp.zeros(()), jax.tree.map(jnp.zeros_like, params),
                             units)

        def step(shared, carry: PassCarry, b) -> PassCarry:
            data = shared[0]
            params, client = carry.params, carry.client
            positions = b * batch + jnp.arange(batch)
            mask = positions < client.train_count
            rows = client.train_start + jnp.where(mask, positions, 0)
            labels = data.labels(rows)
            loss, grads = grad_fn(params, data.inputs(rows), labels, mask)
            units = carry.units
            if units is not None:
                units = units + jnp.sum(jnp.where(mask, model.weight(labels), 0.0)).astype(units.dtype)
            return carry._replace(loss_sum=carry.loss_sum + loss,
                                  grad_sum=jax.tree.map(jnp.add, carry.grad_sum, grads), units=units)

        def finish(shared, carry: PassCarry):
            # f_i is the mean over the client's samples, or over its real tokens (model.weight).
            n = carry.client.train_count if carry.units is None else carry.units
            n = jnp.maximum(n, 1).astype(carry.loss_sum.dtype)
            return carry.loss_sum / n, jax.tree.map(lambda g: g / n.astype(g.dtype), carry.grad_sum)

        def length(row):
            _, client = row
            return (client.train_count + batch - 1) // batch

        def probe(data, row):  # one batch, for the memory analysis of auto chunking
            return step((data,), init((data,), row), jnp.zeros((), jnp.int32))

        return ClientLoop(init, step, finish, length,
                          host_length=lambda train, test: (train + batch - 1) // batch), probe
