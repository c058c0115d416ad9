"""`Model`: the init/apply/loss triple every algorithm is written against.

Algorithms never see flax. Any flax module (via `from_flax`) or any hand-written pair of pure
functions works, so a notebook user can bring their own model:

    model = Model(init=lambda key: {"w": jnp.zeros((64, 10))},
                  apply=lambda p, x: x.reshape(len(x), -1) @ p["w"],
                  loss=softmax_cross_entropy)
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pfl.models import split as split_lib
from fedjax_pfl.models.frozen import Frozen

Params = Any


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-example cross-entropy −log softmax(logits)[label]; [B, C], [B] -> [B]."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


class Model(NamedTuple):
    """A model as pure functions.

    init:   key -> params (a pytree of float arrays).
    apply:  (params, x [B, ...]) -> outputs [B, ...] (logits for classifiers). x is float32, or
            int32 token ids for models that embed their inputs.
    loss:   (outputs [B, ...], labels [B, ...]) -> [B]: each example's loss, summed over the units
            it counts (its tokens, for a sequence model). The engine masks padded examples.
    name:   for logs.
    weight: labels [B, ...] -> [B], the units each example counts (its real tokens); None: one
            each. A batch's mean loss is Σ_b m_b ℓ_b / max(Σ_b m_b w_b, 1) for the mask m.
    metric: (outputs, labels) -> (hits [B], count [B]): each example's correct units and the units
            scored (accuracy = Σ hits / Σ count: token accuracy, recall@k); None: argmax == label,
            one each.
    features: (params, x [B, ...]) -> z: the representation, the input of the head (the last
            Dense layer, `models.split.head_pattern`), e.g. [B, 100] for the MLP, [B, T, H] for a
            per-token model; `from_flax` and the sequence models fill it (`head_input`); None: a
            hand-written model without one (MOON needs it).
    frozen: parameters `apply` reads that are no part of `params` and are never trained (a
            pretrained base under adapters, `models.lora`): a `models.frozen.Frozen`, a shared
            input of every compiled program (`core.Program`), never a client row; None: none.
    train_key: True where `apply` draws randomness in training (LoRA's dropout): local
            training binds a key for each minibatch step (`training_key`), which apply reads
            with `current_training_key()`; evaluation binds none (deterministic).
    """

    init: Callable[[jax.Array], Params]
    apply: Callable[[Params, jax.Array], jax.Array]
    loss: Callable[[jax.Array, jax.Array], jax.Array] = softmax_cross_entropy
    name: str = "model"
    weight: Callable[[jax.Array], jax.Array] | None = None
    metric: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]] | None = None
    features: Callable[[Params, jax.Array], jax.Array] | None = None
    frozen: Frozen | None = None
    train_key: bool = False


# The key of the minibatch step being traced (`training_key`), or None outside local training.
_TRAINING_KEY: contextvars.ContextVar = contextvars.ContextVar("fedjax_pfl_training_key",
                                                               default=None)


@contextlib.contextmanager
def training_key(key: jax.Array) -> Iterator[None]:
    """Within: `current_training_key()` is `key` (local training's step, for a model with
    `train_key`)."""
    token = _TRAINING_KEY.set(key)
    try:
        yield
    finally:
        _TRAINING_KEY.reset(token)


def current_training_key() -> jax.Array | None:
    """The training step's key (`training_key`), or None (evaluation, or outside training)."""
    return _TRAINING_KEY.get()


def head_input(module: nn.Module, params_template: Params
               ) -> Callable[[Params, jax.Array], jax.Array]:
    """features(params, x) = z, the input of `module`'s head: the first positional argument of the
    first call of the submodule that `models.split.head_pattern(params_template)` selects (the last
    Dense layer), recorded with `flax.linen.intercept_methods` while the module runs on x. Generic:
    no per-model code. The head's own computation is dead code that XLA removes under jit;
    `features.with_outputs(params, x)` gives (apply(params, x), z) from one forward pass.

    A model whose head is the whole module (logistic regression; head_pattern's `^[^/]*$` for
    top-level parameters) gets its input x. Raises ValueError at trace time if the head is never
    called (e.g. its parameters are used through another method than `__call__`).
    """
    pattern = re.compile(split_lib.head_pattern(params_template))

    def is_head(module_path: tuple[str, ...]) -> bool:
        # "Dense_1/" for the submodule Dense_1 (the pattern is "^Dense_1/"); "" for the root.
        return pattern.search("/".join(module_path) + "/" if module_path else "") is not None

    def outputs_and_features(params: Params, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        captured: list = []

        def record(next_fun, args, kwargs, context):
            if (not captured and context.method_name == "__call__" and args
                    and is_head(tuple(context.module.path))):
                captured.append(args[0])
            return next_fun(*args, **kwargs)

        with nn.intercept_methods(record):
            outputs = module.apply({"params": params}, x)
        if not captured:
            raise ValueError(f"{type(module).__name__}: its head (parameters matching "
                             f"{pattern.pattern!r}) was never called, so it has no representation")
        return outputs, captured[0]

    def features(params: Params, x: jax.Array) -> jax.Array:
        return outputs_and_features(params, x)[1]

    # (apply(params, x), features(params, x)) from ONE forward pass, for a loss on both (MOON):
    # XLA does not merge two traced copies of the body, so calling both costs the body twice.
    features.with_outputs = outputs_and_features
    return features


def from_flax(
    module: nn.Module,
    input_shape: Sequence[int],
    *,
    loss: Callable[[jax.Array, jax.Array], jax.Array] = softmax_cross_entropy,
    name: str | None = None,
) -> Model:
    """Wraps a stateless flax.linen module (only a 'params' collection) as a `Model`.

    Raises ValueError for modules with mutable collections such as BatchNorm's 'batch_stats':
    the engine's client state holds trainable parameters only (use GroupNorm, see models/nets.py).
    """
    input_shape = tuple(int(s) for s in input_shape)
    variables = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, *input_shape)))
    extra = sorted(set(variables) - {"params"})
    if extra:
        raise ValueError(
            f"{type(module).__name__} has non-parameter collections {extra}; the engine supports "
            "stateless modules only (replace BatchNorm by GroupNorm or LayerNorm)"
        )

    def init(key: jax.Array) -> Params:
        return module.init(key, jnp.zeros((1, *input_shape), jnp.float32))["params"]

    def apply(params: Params, x: jax.Array) -> jax.Array:
        return module.apply({"params": params}, x)

    return Model(init=init, apply=apply, loss=loss, name=name or type(module).__name__,
                 features=head_input(module, variables["params"]))
