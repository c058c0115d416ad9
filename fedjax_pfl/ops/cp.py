"""CP (CANDECOMP/PARAFAC) tensors: reconstruction, rank rule, fit loss and gradient, ALS.

A rank-R CP tensor of order N is given by its factor matrices A^(n) ∈ R^{I_n×R} (TDPFed
Section III-A; docs/algorithms/tdpfed.md#cp):

    ⟦A^(1), …, A^(N)⟧[i_1, …, i_N] = Σ_r Π_n A^(n)[i_n, r].

Factors are passed as a sequence in the tensor's axis order. Unfolding convention
(docs/algorithms/tdpfed.md#cp): `unfold(X, n)` is numpy's C-order
`moveaxis(X, n, 0).reshape(I_n, -1)`, which pairs with the Khatri–Rao product of the other factors
in INCREASING mode order (the first one varies slowest):

    unfold(⟦A⟧, n) = A^(n) · khatri_rao([A^(m) for m ≠ n, increasing])ᵀ.

The paper's reverse order belongs to Kolda–Bader's Fortran-order unfolding; mixing the two is
wrong (tests/ops/test_cp.py checks both). The code below never forms a Khatri–Rao product:
reconstruction and MTTKRP (X_(n)·H_n) are single einsums. Every function works on one tensor
and is vmappable.
"""

from __future__ import annotations

import math
import string
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp

Factors = Sequence[jax.Array]

_LETTERS = string.ascii_lowercase.replace("r", "")  # "r" is the rank index


def _check(factors: Factors) -> int:
    if len(factors) < 1:
        raise ValueError("a CP tensor needs at least one factor matrix")
    if len(factors) > len(_LETTERS):
        raise ValueError(f"CP order {len(factors)} is above the supported {len(_LETTERS)}")
    ranks = {f.shape[-1] for f in factors}
    if len(ranks) != 1 or any(f.ndim != 2 for f in factors):
        raise ValueError(f"factors must be [I_n, R] matrices of one rank R, got shapes "
                         f"{[tuple(f.shape) for f in factors]}")
    return ranks.pop()


def cp_reconstruct(factors: Factors) -> jax.Array:
    """⟦A^(1), …, A^(N)⟧ = Σ_r a_r^(1) ∘ … ∘ a_r^(N) (TDPFed eq. 6), as ONE einsum.

    Args:
      factors: N matrices A^(n) of shape [I_n, R] (any N ≥ 1).
    Returns:
      The [I_1, …, I_N] tensor. For N = 2 this is A^(1) A^(2)ᵀ.
    """
    _check(factors)
    idx = _LETTERS[: len(factors)]
    spec = ",".join(f"{i}r" for i in idx) + "->" + idx
    return jnp.einsum(spec, *factors)


def mttkrp(tensor: jax.Array, factors: Factors, mode: int) -> jax.Array:
    """X_(n) H_n, H_n = khatri_rao(others, increasing): the [I_n, R] matricised-tensor times
    Khatri–Rao product, as one einsum: Σ_{i_m, m≠n} X[i_1…i_N] Π_{m≠n} A^(m)[i_m, r]."""
    _check(factors)
    idx = _LETTERS[: len(factors)]
    others = [f"{i}r" for m, i in enumerate(idx) if m != mode]
    spec = idx + "," + ",".join(others) + f"->{idx[mode]}r"
    return jnp.einsum(spec, tensor, *(f for m, f in enumerate(factors) if m != mode))


def hadamard_gram(factors: Factors, mode: int) -> jax.Array:
    """V_n = ⊛_{m≠n} A^(m)ᵀA^(m), the [R, R] Hadamard product of Gram matrices (eqs. 16, 24).

    Equals H_nᵀH_n for the Khatri–Rao product H_n of the other factors.
    """
    rank = _check(factors)
    v = jnp.ones((rank, rank), factors[0].dtype)
    for m, f in enumerate(factors):
        if m != mode:
            v = v * (f.T @ f)
    return v


def cp_fit_loss(factors: Factors, target: jax.Array) -> jax.Array:
    """½‖target − ⟦A⟧‖²_F: TDPFed's data-free factor objective without λ (F_k(A)|θ̃, §2.4)."""
    diff = target - cp_reconstruct(factors)
    return 0.5 * jnp.vdot(diff, diff).real


def cp_fit_grad(factors: Factors, target: jax.Array,
                modes: Sequence[int] | None = None) -> tuple[jax.Array, ...]:
    """∂/∂A^(n) of ½‖θ − ⟦A⟧‖² = A^(n)V_n − θ_(n)H_n for every n (TDPFed Appendix eqs. 23/29).

    The paper's main-text eq. (15) prints +θ_(n)H_n and drops λ on the second term; that form
    does not match finite differences (docs/algorithms/tdpfed.md#a1). Multiply by λ for TDPFed's
    regulariser λ/2‖θ − ⟦A⟧‖². No reconstruction and no Khatri–Rao product are formed: N MTTKRPs
    of θ plus R×R Gram products. With `modes`, only those factors' gradients are computed and
    the others are returned as zeros (one block of a block-coordinate sweep).
    """
    return tuple(f @ hadamard_gram(factors, n) - mttkrp(target, factors, n)
                 if modes is None or n in modes else jnp.zeros_like(f)
                 for n, f in enumerate(factors))


def cp_als(tensor: jax.Array, rank: int, init: Factors, iters: int,
           ridge: float = 1e-7) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """Alternating least squares for a rank-R CP fit of `tensor`, warm-started at `init`.

    One sweep updates n = 1, …, N in turn (Gauss–Seidel), each the exact least-squares solution with
    the others fixed:  A^(n) ← X_(n) H_n (V_n + δI)⁻¹,  δ = ridge · max(diag V_n). The tiny ridge
    keeps V_n invertible when R exceeds a mode size (TDPFed's ranks can: conv5 at ×1.5 has R = 759 >
    256) and changes an exact fit by O(ridge). Used by TDPFed's ACT aggregation (eq. 20: the server
    re-decomposes the averaged tensor; the method is unspecified, docs/algorithms/tdpfed.md#a13).

    Args:
      tensor: the [I_1, …, I_N] tensor to fit.
      rank: R; must equal the rank of `init`.
      init: the starting factors (e.g. the previous round's global factors).
      iters: number of full sweeps (static).
      ridge: relative Tikhonov term δ.
    Returns:
      (factors, relative error ‖X − ⟦A⟧‖ / ‖X‖ after the last sweep).
    """
    if _check(init) != rank or len(init) != tensor.ndim:
        raise ValueError(f"init must be {tensor.ndim} factors of rank {rank}, got "
                         f"{[tuple(f.shape) for f in init]}")
    eye = jnp.eye(rank, dtype=tensor.dtype)

    def sweep(_, factors):
        factors = list(factors)
        for n in range(len(factors)):
            v = hadamard_gram(factors, n)
            v = v + ridge * jnp.max(jnp.diag(v)) * eye
            rhs = mttkrp(tensor, factors, n)
            factors[n] = jax.scipy.linalg.solve(v, rhs.T, assume_a="pos").T
        return tuple(factors)

    factors = jax.lax.fori_loop(0, iters, sweep, tuple(jnp.asarray(f, tensor.dtype) for f in init))
    return factors, cp_relative_error(factors, tensor)


def cp_relative_error(factors: Factors, tensor: jax.Array) -> jax.Array:
    """‖X − ⟦A⟧‖_F / ‖X‖_F (0 for X = 0 fitted exactly)."""
    err = jnp.linalg.norm(tensor - cp_reconstruct(factors))
    return err / jnp.maximum(jnp.linalg.norm(tensor), jnp.finfo(tensor.dtype).tiny)


def cp_rank_for_compression(shape: Sequence[int], cr: float) -> int:
    """R = round(Π_n I_n / (CR · Σ_n I_n)), at least 1: TDPFed's rank rule
    (docs/algorithms/tdpfed.md#ranks).

    The CP layer then holds R·Σ I_n parameters against Π I_n dense, a compression rate of about
    CR (eqs. 21–22). Round-to-nearest (halves up) reproduces all 20 ranks of the paper's Table I;
    floor and ceil do not.
    """
    if not cr > 0:
        raise ValueError(f"compression rate must be > 0, got {cr}")
    shape = tuple(int(s) for s in shape)
    return max(1, int(math.floor(math.prod(shape) / (cr * sum(shape)) + 0.5)))


def compression(shapes: Mapping[str, Sequence[int]], cr: float) -> dict:
    """What TDPFed's rank rule makes of compression rate `cr` for the tensors `shapes` (name →
    shape): {"given": cr, "used": Σ_t Π I / Σ_t R_t·Σ I (the dense floats of all the tensors
    over their CP floats: the rate the model has), "ranks": name → R_t, "clamped": the names
    whose rule gave rank 0 (Π I / (CR·Σ I) < 1/2) and that keep rank 1, the floor
    `cp_rank_for_compression` clamps to: their rate is Π I / Σ I, below `cr`}. "used" is below
    "given" where any tensor is clamped (and differs from it by the rule's rounding otherwise)."""
    ranks, clamped, dense, factored = {}, [], 0, 0
    for name, shape in shapes.items():
        shape = tuple(int(n) for n in shape)
        rank = cp_rank_for_compression(shape, cr)
        if math.floor(math.prod(shape) / (cr * sum(shape)) + 0.5) < 1:
            clamped.append(name)
        ranks[name] = rank
        dense += math.prod(shape)
        factored += cp_num_params(shape, rank)
    return {"given": float(cr), "used": dense / factored if factored else float(cr),
            "ranks": ranks, "clamped": clamped}


def cp_num_params(shape: Sequence[int], rank: int) -> int:
    """R · Σ_n I_n: the floats of a rank-R CP tensor of this shape (dense: Π_n I_n)."""
    return int(rank) * sum(int(s) for s in shape)


def unfold(tensor: jax.Array, mode: int) -> jax.Array:
    """C-order mode-n unfolding [I_n, Π_{m≠n} I_m] (numpy's moveaxis + reshape,
    docs/algorithms/tdpfed.md#cp)."""
    return jnp.moveaxis(tensor, mode, 0).reshape(tensor.shape[mode], -1)


def khatri_rao(matrices: Factors) -> jax.Array:
    """Column-wise Kronecker product, the first matrix's row index varying slowest.

    For documentation and tests only (the ops above never form it): with C-order unfolding,
    unfold(⟦A⟧, n) = A^(n) · khatri_rao(others in increasing order)ᵀ.
    """
    rank = _check(matrices)
    out = matrices[0]
    for m in matrices[1:]:
        out = (out[:, None, :] * m[None, :, :]).reshape(-1, rank)
    return out
