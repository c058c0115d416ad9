"""Pure math on one client's pytrees (the engine adds the client axis)."""

from fedjax_pfl.ops.tree import (
    tree_add,
    tree_axpy,
    tree_lerp,
    tree_norm,
    tree_scale,
    tree_size,
    tree_sq_norm,
    tree_sub,
    tree_vdot,
    tree_zeros_like,
)

__all__ = [
    "tree_add", "tree_axpy", "tree_lerp", "tree_norm", "tree_scale", "tree_size", "tree_sq_norm",
    "tree_sub", "tree_vdot", "tree_zeros_like",
]
