"""Brute-force float64 solvers for the FedPC op tests (independent of the code under test).

`norm_epigraph_minimize` solves  min_x ½xᵀHx + cᵀx + τ Σ_m ‖B_m x − b_m‖_p  (p ∈ {1, 2, ∞}) with
scipy's generic SLSQP on the epigraph form: variables (x, t), objective ½xᵀHx + cᵀx + τ Σ t, and
  p = 1: t_{m,i} ≥ ±(B_m x − b_m)_i (one t per coordinate, summed),
  p = ∞: t_m ≥ ±(B_m x − b_m)_i,
  p = 2: t_m ≥ ‖B_m x − b_m‖₂ (smoothed by 1e-30 under the root only, so the gradient exists at 0).
`blocks` holds matrices B_m, or pairs (B_m, b_m).
No prox, no ℓ1-ball projection and no ADMM is involved.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import minimize


def norm_epigraph_minimize(hess, lin, blocks, tau, p, x0=None):
    hess, lin = np.asarray(hess, float), np.asarray(lin, float)
    pairs = [(np.asarray(b[0], float), np.asarray(b[1], float)) if isinstance(b, tuple)
             else (np.asarray(b, float), np.zeros(np.shape(b)[0])) for b in blocks]
    blocks = [B for B, _ in pairs]
    n = hess.shape[0]
    dims = [b.shape[0] for b in blocks]
    nt = sum(dims) if p == "1" else len(blocks)

    def objective(v):
        x, t = v[:n], v[n:]
        return 0.5 * x @ hess @ x + lin @ x + tau * t.sum()

    def gradient(v):
        return np.concatenate([hess @ v[:n] + lin, tau * np.ones(nt)])

    def linear(row, const=0.0):
        return {"type": "ineq", "fun": lambda v: row @ v + const, "jac": lambda v: row}

    cons, offset = [], 0
    for k, (B, b) in enumerate(pairs):
        if p in ("1", "inf"):
            for i in range(B.shape[0]):
                for sign in (1.0, -1.0):
                    row = np.zeros(n + nt)
                    row[:n] = -sign * B[i]
                    row[n + (offset + i if p == "1" else k)] = 1.0
                    cons.append(linear(row, sign * b[i]))
            offset += B.shape[0]
        else:
            def fun(v, B=B, b=b, k=k):
                u = B @ v[:n] - b
                return v[n + k] - np.sqrt(u @ u + 1e-30)

            def jac(v, B=B, b=b, k=k):
                u = B @ v[:n] - b
                out = np.zeros(n + nt)
                out[:n] = -B.T @ u / np.sqrt(u @ u + 1e-30)
                out[n + k] = 1.0
                return out

            cons.append({"type": "ineq", "fun": fun, "jac": jac})
    x0 = np.zeros(n) if x0 is None else np.asarray(x0, float)
    if p == "1":
        t0 = np.concatenate([np.abs(B @ x0 - b) for B, b in pairs]) + 1.0
    else:
        t0 = np.array([np.abs(B @ x0 - b).sum() + 1.0 for B, b in pairs])
    res = minimize(objective, np.concatenate([x0, t0]), jac=gradient, constraints=cons,
                   method="SLSQP", options={"ftol": 1e-15, "maxiter": 3000})
    return res.x[:n]


def norm_np(v, p):
    return {"1": np.abs(v).sum(), "2": np.linalg.norm(v), "inf": np.abs(v).max()}[p]
