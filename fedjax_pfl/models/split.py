"""Shared/personal splits of a parameter pytree by leaf path (FedPC, FedPer, FedRep, LG-FedAvg, …).

A model's parameters x^(n) = M x + N z^(n) (docs/algorithms/fedpc.md#model) split into a shared part
x and a personal part z. Neither selection matrix is materialised: the split is a boolean per leaf,
chosen by the leaf's path, a '/'-joined string such as "Dense_1/kernel":

    mask = personal_mask(params, "head")       # the last dense layer (the classifier head)
    mask = personal_mask(params, "all")        # everything personal (d1 = 0)
    mask = personal_mask(params, "none")       # everything shared (d2 = 0)
    mask = personal_mask(params, r"^Dense_1/") # any regex, matched with re.search on each path
    shared, personal = split(params, mask)     # two pytrees with None where the other part lives
    params = merge(shared, personal, mask)

`split` keeps the tree structure and puts None (an empty subtree to JAX) in the holes, so both
parts go through `jax.tree.map`, `core.gather`/`scatter`/`broadcast` and jit as ordinary pytrees;
stacked trees (leading client axis) split and merge the same way. `flatten_rows` turns a stacked
part into an [N, d] matrix (FedPC's Z) and `unflatten_rows` turns it back. `complement` swaps
the two parts (LG-FedAvg shares the head and keeps the body); `train_only` wraps a client
optimizer so that it updates one part and leaves the other bit for bit unchanged (FedRep's
alternating phases, FedBABU's frozen head).
"""

from __future__ import annotations

import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import optax

Params = Any
SPECIAL_PATTERNS = ("head", "all", "none")


def leaf_paths(params: Params) -> list[str]:
    """The '/'-joined path of every leaf, in `jax.tree.leaves` order ("Dense_1/kernel")."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    return [jax.tree_util.keystr(path, simple=True, separator="/") for path, _ in flat]


def _natural_key(path: str) -> list:
    """Sort key comparing digit runs as numbers: Dense_2 < Dense_10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]


def head_pattern(params: Params) -> str:
    """A regex selecting the last dense layer, the classifier head.

    The head is the module path (a path prefix) whose last component is named like `Dense_<k>`
    (flax's auto-naming; also `dense`, `Dense`) that sorts last with numbers compared as numbers;
    e.g. "Dense_1" in the MLP, "Dense_1" in the FedAvg CNN, "Dense_0" in the ResNets and in
    logistic regression (where the head is the whole model). A tree without such a module (a
    hand-written {'w', 'b'}) has the leaves next to its last leaf as its head, which for a flat
    dict is every leaf.

    LoRA adapters (`models.lora`: every leaf a `lora_A` or a `lora_B`) have their B matrices as
    their head, FedSA-LoRA's split (Guo et al., ICLR 2025: A learns what clients share and is
    averaged, B what is client-specific and stays personal): "(^|/)lora_B$".
    """
    paths = leaf_paths(params)
    if not paths:
        raise ValueError("head_pattern: the parameter tree has no leaves")
    if all(re.search(r"(^|/)lora_[AB]$", p) for p in paths):
        return r"(^|/)lora_B$"
    prefixes = set()
    for path in paths:
        parts = path.split("/")
        for i, part in enumerate(parts[:-1]):
            if re.fullmatch(r"(?i)dense(_\d+)?", part):
                prefixes.add("/".join(parts[: i + 1]))
    if prefixes:
        prefix = max(prefixes, key=_natural_key)
        return "^" + re.escape(prefix) + "/"
    last = max(paths, key=_natural_key)
    parent = last.rsplit("/", 1)[0] if "/" in last else ""
    return "^" + re.escape(parent) + "/" if parent else r"^[^/]*$"


def is_pattern(value: str) -> bool:
    """Whether `value` is "head", "all", "none" or a valid regex (a config check without a model)."""
    if value in SPECIAL_PATTERNS:
        return True
    try:
        re.compile(value)
    except re.error:
        return False
    return True


def personal_mask(params: Params, pattern: str) -> Params:
    """A pytree of bools shaped like `params`: True on the personal leaves.

    pattern: "head" (`head_pattern`), "all", "none", or a regex matched by `re.search` against
    each leaf path. A regex that matches no leaf is an error (it is almost surely a typo); the
    message lists the paths.
    """
    paths = leaf_paths(params)
    treedef = jax.tree.structure(params)
    if pattern == "all":
        flags = [True] * len(paths)
    elif pattern == "none":
        flags = [False] * len(paths)
    else:
        regex = head_pattern(params) if pattern == "head" else pattern
        try:
            compiled = re.compile(regex)
        except re.error as e:
            raise ValueError(f"personal-parameter pattern {pattern!r} is not a valid regex: {e}") from None
        flags = [compiled.search(p) is not None for p in paths]
        if not any(flags):
            raise ValueError(f"personal-parameter pattern {pattern!r} matches no parameter; "
                             f"the paths are {paths}")
    return jax.tree.unflatten(treedef, flags)


def complement(mask: Params) -> Params:
    """The mask of the other part: True where `mask` is False (personal <-> shared)."""
    return jax.tree.map(lambda m: not m, mask)


def train_only(tx: optax.GradientTransformation, trainable: Params) -> optax.GradientTransformation:
    """`tx` on the leaves where `trainable` is True; a zero update on the others.

    A frozen leaf w gets w + 0 = w at every step, so it stays bit for bit what it was, and `tx`
    keeps state (momentum) for the trainable leaves only, so a frozen part's buffer neither
    grows nor decays while it is frozen (as with a separate torch optimizer per part).
    """
    labels = jax.tree.map(lambda t: "train" if t else "frozen", trainable)
    return optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, labels)


def split(tree: Params, mask: Params) -> tuple[Params, Params]:
    """(shared, personal): `tree` with None on the personal leaves, and with None on the shared."""
    shared = jax.tree.map(lambda m, x: None if m else x, mask, tree)
    personal = jax.tree.map(lambda m, x: x if m else None, mask, tree)
    return shared, personal


def merge(shared: Params, personal: Params, mask: Params) -> Params:
    """The inverse of `split`: the personal leaf where mask is True, else the shared leaf."""
    return jax.tree.map(lambda m, s, p: p if m else s, mask, shared, personal)


def count(tree: Params, *, stacked: bool = False) -> int:
    """Number of scalars in a (part of a) tree; per row with `stacked` (leading axis dropped)."""
    leaves = jax.tree.leaves(tree)
    if stacked:
        return sum(int(x.size // x.shape[0]) if x.shape[0] else 0 for x in leaves)
    return sum(int(x.size) for x in leaves)


def flatten_rows(tree: Params) -> jax.Array:
    """[N, d]: row n concatenates client n's leaves (each flattened row-major) in leaf order.

    `tree`'s leaves are [N, ...]; None holes are skipped. A tree without leaves gives [N, 0]
    only through `unflatten_rows`' inverse use, so pass at least one leaf here.
    """
    leaves = jax.tree.leaves(tree)
    if not leaves:
        raise ValueError("flatten_rows: the tree has no leaves")
    n = leaves[0].shape[0]
    return jnp.concatenate([x.reshape(n, -1) for x in leaves], axis=1)


def unflatten_rows(matrix: jax.Array, like: Params) -> Params:
    """The inverse of `flatten_rows`: split the columns of matrix [N, d] into leaves shaped like
    `like`'s per-row shapes (like's leaves are [N, ...] arrays or shape structs)."""
    leaves, treedef = jax.tree.flatten(like)
    n = matrix.shape[0]
    sizes = [math.prod(leaf.shape[1:]) for leaf in leaves]
    if sum(sizes) != matrix.shape[1]:
        raise ValueError(f"unflatten_rows: matrix has {matrix.shape[1]} columns, the tree {sum(sizes)}")
    out, start = [], 0
    for leaf, size in zip(leaves, sizes):
        out.append(matrix[:, start:start + size].reshape((n, *leaf.shape[1:])).astype(leaf.dtype))
        start += size
    return jax.tree.unflatten(treedef, out)
