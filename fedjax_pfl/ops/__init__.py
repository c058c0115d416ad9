"""Pure math on one client's pytrees (the engine adds the client axis)."""

from fedjax_pfl.ops.angle import cosine_angle, cosine_similarity
from fedjax_pfl.ops.gompertz import gompertz_weight
from fedjax_pfl.ops.sherman_morrison import sherman_morrison_step
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
    "cosine_angle", "cosine_similarity", "gompertz_weight", "sherman_morrison_step",
    "tree_add", "tree_axpy", "tree_lerp", "tree_norm", "tree_scale", "tree_size", "tree_sq_norm",
    "tree_sub", "tree_vdot", "tree_zeros_like",
]
