"""The Sherman–Morrison Newton step of pFedSOP."""

from __future__ import annotations

import jax

from fedjax_pfl.ops.tree import Params, tree_scale, tree_sq_norm


def sherman_morrison_step(delta_p: Params, rho: jax.typing.ArrayLike) -> Params:
    """Newton step F⁻¹Δᵖ with F = ΔᵖΔᵖᵀ + ρI (pFedSOP eqs. 17–18).

    Sherman–Morrison gives F⁻¹Δᵖ = Δᵖ/ρ − Δᵖ(ΔᵖᵀΔᵖ)/(ρ² + ρ‖Δᵖ‖²), which simplifies exactly to
    Δᵖ / (ρ + ‖Δᵖ‖²). We use the last form: the two-term one cancels catastrophically in float32
    when ‖Δᵖ‖² ≫ ρ (16 % error at ρ = 1e-3, docs/algorithms/pfedsop.md#sherman-morrison). The step
    keeps Δᵖ's direction and its norm is at most 1/(2√ρ) (reached at ‖Δᵖ‖ = √ρ).

    Args:
      delta_p: one client's blended pseudo-gradient; all leaves together are a vector in R^d.
      rho: FIM regulariser ρ > 0.
    Returns:
      A pytree shaped like `delta_p`. O(d); no d×d array is formed. Δᵖ = 0 gives 0.
    """
    return tree_scale(1.0 / (rho + tree_sq_norm(delta_p)), delta_p)
