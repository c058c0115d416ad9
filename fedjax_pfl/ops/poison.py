"""Data poisoning: the inputs and labels a malicious client trains on, as pure functions over one
minibatch (x [B, ...], y [B]) and a [B] bool mask of the rows poisoned (`chosen`). Rows outside
the mask are returned as they are.

    attack       poisoned row (x_j, y_j) →                         source
    label_flip   (x_j, C − 1 − y_j), or (x_j, t) with a target t    Fang et al., USENIX Security
                                                                    2020; Tolpegin et al., ESORICS
                                                                    2020 (label flipping)
    backdoor     (x_j ⊕ trigger, t)                                 Gu et al., "BadNets", 2017;
                                                                    Bagdasaryan et al., AISTATS 2020

The trigger (`stamp_trigger`) is BadNets' pixel pattern: the bottom-right k×k patch of an image
set to `value` (the engine passes 1.0, the top of every image dataset's normalised input range
here: [0, 1] or [−1, 1]), in every channel; for a feature vector its last k features, for token
inputs its last k tokens set to one token id (the engine passes the vocabulary's last id).
Which rows are poisoned is the caller's (the engine: every training row of a malicious client
for label_flip, a seeded fixed share of them for backdoor; `core.local.DataPoison`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# How a trigger is stamped on a dataset's inputs.
INPUT_KINDS = ("image", "features", "tokens")


def flip_labels(y: jax.Array, num_classes: int, target: int | None = None) -> jax.Array:
    """y → C − 1 − y (a permutation of the C classes, its own inverse), or every label set to
    `target`."""
    if target is None:
        return (num_classes - 1 - y).astype(y.dtype)
    return jnp.full_like(y, target)


def stamp_trigger(x: jax.Array, size: int, value, inputs: str = "image") -> jax.Array:
    """x with the trigger on every row: images [B, H, W] or [B, H, W, C] get the bottom-right
    `size`×`size` pixels (every channel) set to `value`; features [B, D] and tokens [B, T] their
    last `size` entries."""
    if inputs not in INPUT_KINDS:
        raise ValueError(f"inputs must be one of {list(INPUT_KINDS)}, got {inputs!r}")
    value = jnp.asarray(value, x.dtype)
    if inputs == "image":
        if x.ndim == 3:
            return x.at[:, -size:, -size:].set(value)
        return x.at[:, -size:, -size:, ...].set(value)
    return x.at[:, -size:].set(value)


def _rows(mask: jax.Array, a: jax.Array) -> jax.Array:
    return mask.reshape(mask.shape + (1,) * (a.ndim - 1))


def label_flip(x: jax.Array, y: jax.Array, chosen: jax.Array, *, num_classes: int,
               target: int | None = None) -> tuple[jax.Array, jax.Array]:
    """(x, y with the chosen rows' labels flipped, `flip_labels`)."""
    return x, jnp.where(chosen, flip_labels(y, num_classes, target), y)


def backdoor(x: jax.Array, y: jax.Array, chosen: jax.Array, *, target: int, size: int, value,
             inputs: str = "image") -> tuple[jax.Array, jax.Array]:
    """(x with the trigger on the chosen rows, y with their labels set to `target`)."""
    stamped = stamp_trigger(x, size, value, inputs)
    return (jnp.where(_rows(chosen, x), stamped, x),
            jnp.where(chosen, jnp.asarray(target, y.dtype), y))
