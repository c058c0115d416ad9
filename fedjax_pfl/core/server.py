"""The server side of a round: one chain of small transformations over the stacked client uploads.

Every algorithm with a server aggregate sends its clients' uploads through one `ServerChain`,
composed like optax's `chain` (`optax/_src/combine.py`): each link is a pure transformation
with its own state, and the engine assembles the chain from the configuration. Today's links:

    model_attack(kind, ...)       the malicious clients' uploads replaced (`ops.attacks`)
    clip(C) / adaptive_clip(...)  clip each client's update θ_i − start to C        (privacy)
    noised_mean(z, D)             (Σ clipped updates + N(0, z²C²)) / D               (privacy)
    weighted_mean()               Σ_i (w_i / Σ w) θ_i, the plain mean of the uploads
    robust_mean(kind, ...)        a robust rule over the updates θ_i − start in its place
                                  (median, trimmed mean, Krum, Bulyan, RFA, ...; `ops.robust`)
    apply_update()                the server's new value: start + the mean update, or the mean
    server_optimizer(tx)          the server's new value: start + tx(−Δ), Δ the mean update
                                  (FedAvgM, FedAdam, FedYogi, FedAdagrad; `ops.server_opt`)

so a round is, with privacy, clip → noise → reduce → update (DP-FedAvg, McMahan et al. 2018,
Algorithm 1 with the fixed denominator), and without it, reduce → update (FedAvg's weighted
mean), and with a server optimiser (--server-opt) reduce → optimiser, or clip → noise →
optimiser (Reddi et al. 2021, Algorithm 2, on the noised mean update). New capabilities are
new links (a robust reduction in place of the mean, compression before it); no algorithm
module changes.

What travels down the chain is an `Uploads` value, built and consumed inside one trace (it is
not a pytree and never crosses a jit boundary): the server's `start`, the clients' values
[M, ...] (models, or updates of `start` where an algorithm uploads updates and passes a zero
start), their weights, and what the links have done so far. A reduction leaves either the mean
model (`model`) or the mean update of `start` (`update`); `apply_update` turns either into the
server's new value. Keeping the plain mean in model space keeps FedAvg's bits: Σ w_i θ_i / Σ w
is not start + Σ w_i (θ_i − start) / Σ w in floating point.

The chain's state (an adaptive clip's C_t; a server optimiser's moments) is a dict by link name
that the algorithm keeps in its own state (its `server` field), so checkpoints, resume and
sweeps carry it like every other leaf; stateless links keep nothing there.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_pfl.core.clients import mean_over_clients
from fedjax_pfl.ops import attacks, dp, robust

Params = Any

# The streams of a round's key that the links draw from (jax.random.fold_in): a private round's
# other keys (sampling, training) stay those of the plain round.
DP_NOISE = 0x0D9          # the Gaussian mechanism's noise on the sum of clipped updates
DP_COUNT_NOISE = 0x0DA    # the adaptive clip's noise on its count of unclipped updates
ATTACK_NOISE = 0x0DB      # the Gaussian attack's noise (`model_attack`)


@dataclasses.dataclass(frozen=True)
class Context:
    """What a link may read about the round besides the uploads."""

    key: jax.Array                  # the round's key; a link draws from its own fold_in stream
    slots: int                      # M, the round's slots
    mask: jax.Array | None          # [M] bool: the slots that hold a participant (Poisson), or None
    expected: Any                   # D: the clients a round is expected to hold (M, or q·N)
    malicious: jax.Array | None = None  # [M] bool: the slots of malicious clients, or None


@dataclasses.dataclass(frozen=True)
class Uploads:
    """The clients' uploads as they travel down the chain (see the module docstring)."""

    start: Params                   # the server value the clients started from
    clients: Params                 # [M, ...] their uploads: models (or updates of a zero start)
    weights: Any                    # [M] the plain mean's weights (None: uniform), or a tree of
    # them that is a prefix of the uploads' tree, one per part
    clip: Any = None                # the clip norm C a clip link set (None: no clipping)
    model: Params | None = None     # after a reduction: the mean model
    update: Params | None = None    # after a reduction: the mean update of `start`

    def replace(self, **changes) -> "Uploads":
        return dataclasses.replace(self, **changes)

    @property
    def reduced(self) -> bool:
        return self.model is not None or self.update is not None


Update = Callable[[Uploads, Any, Context], tuple[Uploads, Any, dict]]


class ServerLink(NamedTuple):
    """One transformation of the uploads: `init(start) -> state`, `update(uploads, state,
    context) -> (uploads, state, metrics)` (optax's `GradientTransformation`, for a round's
    stacked uploads). `name` keys its state in the chain's (a link without state has none)."""

    init: Callable[[Params], Any] | None
    update: Update
    name: str


def _stateless(name: str, update: Callable[[Uploads, Context], tuple[Uploads, dict]]
               ) -> ServerLink:
    def step(uploads, state, context):
        uploads, metrics = update(uploads, context)
        return uploads, state, metrics

    return ServerLink(None, step, name)


class ServerChain(NamedTuple):
    """Links applied in order (`chain`); its state is a dict of the stateful links' states by
    name ({} for a chain of stateless links, whichever they are: a plain and a private FedAvg
    hold the same state)."""

    links: tuple[ServerLink, ...]

    def init(self, start: Params) -> dict:
        """The chain's initial state for a server value shaped like `start`."""
        return {link.name: link.init(start) for link in self.links if link.init is not None}

    def __call__(self, start: Params, clients: Params, weights: Any, state: dict,
                 context: Context) -> tuple[Params, dict, dict]:
        """(the server's new value, the chain's new state, the links' metrics)."""
        uploads = Uploads(start, clients, weights)
        metrics: dict = {}
        new_state = {}
        for link in self.links:
            uploads, link_state, more = link.update(uploads, state.get(link.name), context)
            if link.init is not None:
                new_state[link.name] = link_state
            metrics.update(more)
        if uploads.model is None:
            raise ValueError("the server chain ended without the server's new value (it needs "
                             "a reduction and apply_update)")
        return uploads.model, new_state, metrics


def chain(*links: ServerLink) -> ServerChain:
    names = [link.name for link in links]
    if len(set(names)) != len(names):
        raise ValueError(f"server chain links need distinct names, got {names}")
    return ServerChain(tuple(links))


# -- links -------------------------------------------------------------------------------------


def _clip_metrics(norms: jax.Array, clip, mask: jax.Array | None) -> dict[str, jax.Array]:
    """The fraction of participants whose update was clipped and their mean update norm."""
    if mask is None:
        return {"dp_clipped_fraction": jnp.mean(norms > clip), "dp_update_norm": jnp.mean(norms)}
    count = jnp.maximum(jnp.sum(mask), 1)
    return {"dp_clipped_fraction": jnp.sum(mask & (norms > clip)) / count,
            "dp_update_norm": jnp.sum(jnp.where(mask, norms, 0.0)) / count}


def model_attack(kind: str, *, scale=None, std: float = 1.0, z=None, eps: float = 0.1
                 ) -> ServerLink:
    """Model poisoning, the first link: the uploads of the round's malicious participants
    (`Context.malicious`, less a Poisson round's empty slots) replaced by `kind`'s (one of
    `ops.attacks.MODEL_ATTACKS`) update Δ'_i of `start`, θ'_i = start + Δ'_i; the other rows
    are kept as they are, bit for bit. The omniscient attacks (alie, ipm) read the benign
    participants' updates Δ_i = θ_i − start of this round. `scale` None: 1 for sign_flip and
    the round's slots M for scale (Bagdasaryan et al.'s n/η at the plain server step η = 1).
    The Gaussian attack draws from the ATTACK_NOISE stream of the round's key. A round
    without malicious slots (Context.malicious None) passes the uploads on untouched.
    Metric: "attack_malicious", the round's malicious participants."""
    if kind not in attacks.MODEL_ATTACKS:
        raise ValueError(f"kind must be one of {list(attacks.MODEL_ATTACKS)}, got {kind!r}")

    def update(uploads: Uploads, context: Context):
        if context.malicious is None:
            return uploads, {}
        present = (jnp.ones(context.slots, bool) if context.mask is None else context.mask)
        malicious = context.malicious & present
        benign = present & ~malicious
        factor = scale if scale is not None else (context.slots if kind == "scale" else 1.0)
        wide = lambda a: a.astype(jnp.promote_types(a.dtype, jnp.float32))
        deltas = jax.tree.map(lambda x, s: wide(x) - wide(s)[None], uploads.clients,
                              uploads.start)
        sent = attacks.poison_updates(kind, deltas, malicious, benign,
                                      key=jax.random.fold_in(context.key, ATTACK_NOISE),
                                      scale=factor, std=std, z=z, eps=eps)
        rows = lambda leaf: malicious.reshape(malicious.shape + (1,) * (leaf.ndim - 1))
        clients = jax.tree.map(
            lambda x, d, s: jnp.where(rows(x), (wide(s)[None] + d).astype(x.dtype), x),
            uploads.clients, sent, uploads.start)
        return (uploads.replace(clients=clients),
                {"attack_malicious": jnp.sum(malicious, dtype=jnp.int32)})

    return _stateless("model_attack", update)


def clip(norm) -> ServerLink:
    """Each client's update θ_i − start clipped to L2 norm C = `norm` (`ops.dp.clip_update`; C =
    inf: no clipping). The clipping itself is fused into `noised_mean`'s sum (no clipped copy of
    the M updates is stored); this link sets C and reports the fraction clipped and the mean
    update norm over the participants."""
    def update(uploads: Uploads, context: Context):
        norms = dp.update_norms(uploads.clients, uploads.start, context.mask, context.slots)
        return uploads.replace(clip=norm), _clip_metrics(norms, norm, context.mask)

    return _stateless("clip", update)


class AdaptiveClipState(NamedTuple):
    clip: jax.Array          # C_t, the clip norm of the next round; () float32


def _at(value, context: Context):
    """A link's parameter: a value, or a function of the round's context (a noise level that
    depends on the clients a round is expected to hold)."""
    return value(context) if callable(value) else value


def adaptive_clip(initial, *, quantile, lr, count_noise) -> ServerLink:
    """Clipping to a norm C_t that follows the `quantile` γ of the clients' update norms
    (Andrew, Thakkar, McMahan & Ramaswamy, "Differentially Private Learning with Adaptive
    Clipping", NeurIPS 2021, Algorithm 1, the geometric update), C_0 = `initial`:

        b̃_t = ( Σ_{k∈S_t} 1[‖Δ_k‖ ≤ C_t] + N(0, σ_b²) ) / D
        C_{t+1} = C_t · exp(−η (b̃_t − γ))                 η = `lr`, σ_b = `count_noise`

    The round clips at C_t (as `clip`); the count's noise draws from its own stream of the
    round's key (DP_COUNT_NOISE); `count_noise` may be a function of the round's `Context`.
    Metrics: `clip`'s, "dp_clip" (C_t) and "dp_unclipped_noisy"
    (b̃_t). docs/privacy.md has the accounting (the update noise z_Δ that keeps the accounted z)."""
    def init(start):
        return AdaptiveClipState(jnp.asarray(initial, jnp.float32))

    def update(uploads: Uploads, state: AdaptiveClipState, context: Context):
        c = state.clip
        norms = dp.update_norms(uploads.clients, uploads.start, context.mask, context.slots)
        metrics = _clip_metrics(norms, c, context.mask)
        took_part = context.slots if context.mask is None else jnp.sum(context.mask)
        # Σ 1[‖Δ‖ ≤ C] over the participants (read from the clipped fraction, as counted).
        within = jnp.round((1.0 - metrics["dp_clipped_fraction"]) * took_part)
        noise = _at(count_noise, context) * jax.random.normal(
            jax.random.fold_in(context.key, DP_COUNT_NOISE), ())
        fraction = (within + noise) / context.expected                                 # b̃_t
        new = c * jnp.exp(-lr * (fraction - quantile))
        metrics.update(dp_clip=c, dp_unclipped_noisy=fraction)
        return uploads.replace(clip=c), AdaptiveClipState(new.astype(jnp.float32)), metrics

    return ServerLink(init, update, "adaptive_clip")


def noised_mean(noise_multiplier) -> ServerLink:
    """DP-FedAvg's estimate of the mean update: (Σ_k clip_C(θ_k − start) + N(0, z²C² I)) / D
    over the participants (`ops.dp.clipped_update_sum`, `ops.dp.noisy_mean`), C the clip a
    previous link set, z = `noise_multiplier`, D = the context's expected clients (a fixed
    denominator: the sum's sensitivity does not depend on who was sampled). Uniform weights:
    the uploads' own weights are not used. The noise draws from the DP_NOISE stream; z may be a
    function of the round's `Context` (the adaptive clip's update noise z_Δ)."""
    def update(uploads: Uploads, context: Context):
        if uploads.clip is None:
            raise ValueError("noised_mean needs a clip link before it (the noise is calibrated "
                             "to the clip norm)")
        total, _ = dp.clipped_update_sum(uploads.clients, uploads.start, uploads.clip,
                                         mask=context.mask)
        mean = dp.noisy_mean(total, jax.random.fold_in(context.key, DP_NOISE), clip=uploads.clip,
                             noise_multiplier=_at(noise_multiplier, context),
                             denominator=context.expected)
        return uploads.replace(update=mean), {}

    return _stateless("noised_mean", update)


def weighted_mean() -> ServerLink:
    """Σ_i (w_i / Σ_k w_k) θ_i over the uploads (`core.mean_over_clients`; uniform without
    weights): FedAvg's aggregate, in model space. The weights may be a prefix of the uploads'
    tree, each part with its own ([M], or None: uniform): SCAFFOLD's (Δy, Δc)."""
    def update(uploads: Uploads, context: Context):
        weights = uploads.weights
        if weights is None or isinstance(weights, (jax.Array, jax.core.Tracer)) or hasattr(
                weights, "shape"):
            mean = mean_over_clients(uploads.clients, weights)
        else:
            mean = jax.tree.map(lambda w, part: mean_over_clients(part, w), weights,
                                uploads.clients, is_leaf=lambda x: x is None)
        return uploads.replace(model=mean), {}

    return _stateless("weighted_mean", update)


def robust_mean(kind: str, **params) -> ServerLink:
    """A robust rule in place of `weighted_mean` (`ops.robust.aggregate`: kind one of
    `ops.robust.AGGREGATORS` but "mean", `params` its beta, f, m, iters, nu, tau, radius): the
    rule runs over the clients' updates Δ_i = θ_i − start (centered clipping and norm bounding
    are not translation-invariant, so the rules see updates, not models; an algorithm that
    uploads updates passes a zero start) and leaves the mean update of start. The round's
    participants mask (`Context.mask`) keeps empty slots out; the uploads' [M] weights reach the
    weighted rules only (RFA, centered clipping, norm bounding). One weight vector: a tree of
    them, one per part (SCAFFOLD's (Δy, Δc)), is refused.

    Centered clipping keeps the previous round's aggregate update as its state (the centre it
    iterates from; zeros before the first round), under this link's name "robust_mean"; the
    other rules keep none."""
    if kind not in robust.AGGREGATORS or kind == "mean":
        raise ValueError(f"kind must be one of {list(robust.AGGREGATORS[1:])}, got {kind!r}")
    stateful = kind == "centered_clip"

    def init(start):
        return jax.tree.map(jnp.zeros_like, start)

    def update(uploads: Uploads, state, context: Context):
        weights = uploads.weights
        if not (weights is None or hasattr(weights, "shape")):
            raise ValueError("robust_mean takes one [M] weight vector (or None), not one per "
                             "part of the upload")
        wide = lambda a: a.astype(jnp.promote_types(a.dtype, jnp.float32))   # bfloat16 rows
        deltas = jax.tree.map(lambda x, s: wide(x) - wide(s)[None], uploads.clients,
                              uploads.start)
        mean = robust.aggregate(kind, deltas, weights, context.mask, center=state, **params)
        mean = jax.tree.map(lambda u, s: u.astype(s.dtype), mean, uploads.start)
        return uploads.replace(update=mean), (mean if stateful else state), {}

    return ServerLink(init if stateful else None, update, "robust_mean")


def apply_update() -> ServerLink:
    """The server's new value from the reduction: the mean model as it is, or start + the mean
    update (FedAvg's server step, a step of size 1)."""
    def update(uploads: Uploads, context: Context):
        if uploads.model is not None:
            return uploads, {}
        if uploads.update is None:
            raise ValueError("apply_update needs a reduction before it")
        return uploads.replace(model=jax.tree.map(jnp.add, uploads.start, uploads.update)), {}

    return _stateless("apply_update", update)


def server_optimizer(tx: optax.GradientTransformation, name: str = "server_opt") -> ServerLink:
    """The server's new value as a step of the optax optimiser `tx` along the round's
    pseudo-gradient: x_{t+1} = x_t + tx(−Δ_t), Δ_t the reduction's mean update (or its mean
    model − start), so that optax.sgd(η) is Reddi et al.'s x_t + η Δ_t (Algorithm 2; optax
    minimises, the update direction is +Δ). In place of `apply_update`; under privacy it steps
    along the noised mean update (post-processing). Its state (`tx.init(start)`: momentum, the
    adaptive moments) is kept under `name` in the chain's state."""
    def init(start):
        return tx.init(start)

    def update(uploads: Uploads, state, context: Context):
        if uploads.update is not None:
            delta = uploads.update
        elif uploads.model is not None:
            delta = jax.tree.map(jnp.subtract, uploads.model, uploads.start)
        else:
            raise ValueError("server_optimizer needs a reduction before it")
        grads = jax.tree.map(jnp.negative, delta)
        step, state = tx.update(grads, state, uploads.start)
        model = jax.tree.map(lambda x, u: (x + u).astype(x.dtype), uploads.start, step)
        return uploads.replace(model=model), state, {}

    return ServerLink(init, update, name)
