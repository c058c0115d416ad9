"""Pure math on one client's pytrees (the engine adds the client axis)."""

from fedjax_pfl.ops.angle import cosine_angle, cosine_similarity
from fedjax_pfl.ops.cp import (
    cp_als,
    cp_fit_grad,
    cp_fit_loss,
    cp_num_params,
    cp_rank_for_compression,
    cp_reconstruct,
    cp_relative_error,
    hadamard_gram,
    khatri_rao,
    mttkrp,
    unfold,
)
from fedjax_pfl.ops.gompertz import gompertz_weight
from fedjax_pfl.ops.robust import (
    AGGREGATORS,
    bulyan,
    centered_clip,
    coordinate_median,
    geometric_median,
    krum,
    multi_krum,
    norm_bound,
    trimmed_mean,
)
from fedjax_pfl.ops.server_opt import FedOptState, scale_by_fedopt, server_transform
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
    "cp_als", "cp_fit_grad", "cp_fit_loss", "cp_num_params", "cp_rank_for_compression",
    "cp_reconstruct", "cp_relative_error", "hadamard_gram", "khatri_rao", "mttkrp", "unfold",
    "cosine_angle", "cosine_similarity", "gompertz_weight", "sherman_morrison_step",
    "FedOptState", "scale_by_fedopt", "server_transform",
    "AGGREGATORS", "bulyan", "centered_clip", "coordinate_median", "geometric_median", "krum",
    "multi_krum", "norm_bound", "trimmed_mean",
    "tree_add", "tree_axpy", "tree_lerp", "tree_norm", "tree_scale", "tree_size", "tree_sq_norm",
    "tree_sub", "tree_vdot", "tree_zeros_like",
]
