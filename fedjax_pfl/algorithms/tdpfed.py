"""TDPFed (Wang et al., "Tensor Decomposition based Personalized Federated Learning",
arXiv:2208.12959), Algorithm 1 read as docs/algorithms/tdpfed.md#round.

Every client k holds a dense personalised model θ_k and a "tensorized local model" A_k: the CP
factors of each weight tensor (biases dense), ⟦A_k⟧ being its reconstruction. Per round t:

  broadcast to ALL K clients:  A_k ← A_t,  θ_k ← W_t    (W_t = ⟦A_t⟧ for AFM, ω̃_t for ACT)
  each client, τ local rounds t' (one minibatch B each; Algorithm 1 lines 7–10):
     s times:   θ_k ← NAG step on f(θ_k; B) + λ/2‖θ_k − ⟦A_k⟧‖², lr η_p      (eq. 13; centre fixed)
     s' times:  A_k ← optimizer step on λ/2‖θ_k − ⟦A_k⟧‖², lr η               (eqs. 12, 17, 23)
                (data-free: ∂/∂A^(n) = λ(A^(n)V_n − θ_(n)H_n), ops.cp_fit_grad)
  S_t ← S clients sampled after training (line 4)
  AFM (eq. 18): A_{t+1} = (1−β) A_t + β Σ_{k∈S_t} p_k A_k                    (every factor, bias)
  ACT (eqs. 19–20): ω̃_{t+1} = (1−β) ⟦A_t⟧ + β Σ_{k∈S_t} p_k ⟦A_k⟧;  A_{t+1} = ALS fit of ω̃_{t+1}
                    warm-started at A_t; clients start the next round from θ_k = ω̃_{t+1}

p_k = |D_k| / Σ_{j∈S_t} |D_j| (`weights="data_size"`, the best reading of eq. 18's |𝓑_k|) or 1/S
(`"uniform"`, what the literal |𝓑_k| gives with equal batches). β > 1 extrapolates (Table IV).

Readings of the ambiguities (docs/algorithms/tdpfed.md, A1–A26):
  * one minibatch per local round, reused for the s inner steps (A7); NAG in PyTorch's form
    buf ← μ buf + g, step g + μ buf (optax nesterov) with μ = --momentum (0.9, unstated in paper);
  * factor steps are "simultaneous" (one optimizer over all factors, A9) by default;
    `factor_update="cyclic"` updates mode n = 1…N in turn (block-coordinate, ALS-like);
    `factor_opt="adam"` (PyTorch defaults; A10) or "gd" (eq. 17). Under Adam λ barely
    changes the factor step (Adam is scale invariant, #factor-gradient);
  * optimizer states (NAG buffer, Adam moments) restart every round unless
    --momentum-buffer persist (then each client keeps its own across rounds);
  * ACT's ω̃ mixes the reconstruction ⟦A_t⟧ (eq. 19, A13), not the previous ω̃_t;
  * the factor initialisation is unspecified: Gaussian factors whose reconstruction has the
    variance of the dense model's own initialisation (models.cp.cp_init_like); CR = 1 is the
    identity parameterisation (A = the dense model), under which factor_opt="gd" with s' = 1 is
    exactly pFedMe (#pfedme; tests/algorithms/test_tdpfed.py checks it against `pfedme`).

Evaluated: "client" = each θ_k after this round's training (the paper's headline personalised
accuracy); "global" = the CP network ⟦A_{t+1}⟧ on each client's test split. Communication per
round (floats, weights and biases): uplink S·|A|; downlink `comm_down_floats` = what the
configuration needs: K·|A| for AFM (clients rebuild ⟦A⟧ from the factors) and K·(|A| + |W|) for
ACT (its ω̃ is not ⟦A⟧, so the dense tensor is sent); also reported: `comm_down_floats_factors_only`
= K·|A| and `comm_down_floats_with_tensor` = K·(|A| + |W|), the paper's literal "full tensor and
factors" (A12).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_pfl import core, ops
from fedjax_pfl.algorithms.engine import Engine, EngineConfig
from fedjax_pfl.algorithms.interface import Algorithm
from fedjax_pfl.algorithms.registry import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, AlgorithmSpec, HParam, register
from fedjax_pfl.core.local import masked_mean_loss
from fedjax_pfl.models import cp
from fedjax_pfl.models.model import Model

Params = Any


class State(NamedTuple):
    theta: Params          # θ_k after this round's local training (personalised)  leaves [K, ...]
    factors: Params        # A_t, the global CP tree (CPFactors nodes, dense biases) leaves [...]
    omega: Params          # ACT: ω̃_t, the dense start of the next round; AFM: None
    opt_state: Any         # per-client (NAG, factor) optimizer states when persisted, else None
    server: Any            # the server chain's state (Engine.init_server)
    round: jax.Array       # rounds completed; shape=(), int32
    CLIENT_FIELDS = ("theta", "opt_state")  # per-client rows [N, ...]


def factor_gradient(factors: Params, theta: Params, lam: float, mode: int | None = None) -> Params:
    """∇_A λ/2‖θ − ⟦A⟧‖² over a CP tree: λ(A^(n)V_n − θ_(n)H_n) per factor (eq. 23;
    docs/algorithms/tdpfed.md#factor-gradient), λ(A − θ) for dense leaves. With `mode` = n only
    factor n (and dense leaves when n = 0) gets a gradient; the rest are zero (one block of a
    cyclic sweep)."""

    def one(a, t):
        if cp.is_cp(a):
            grads = ops.cp_fit_grad(a.factors, t, modes=None if mode is None else (mode,))
            return cp.CPFactors([lam * g for g in grads])
        if mode not in (None, 0):
            return jnp.zeros_like(a)
        return lam * (a - t)

    return jax.tree.map(one, factors, theta, is_leaf=cp.is_cp)


def _mode_masks(factors: Params, num_modes: int) -> list[Params]:
    """For a cyclic sweep: mask n marks factor n of every CP tensor (and dense leaves for n = 0)."""

    def mask(n):
        def one(a):
            if cp.is_cp(a):
                return cp.CPFactors([m == n for m in range(len(a.factors))])
            return n == 0
        return jax.tree.map(one, factors, is_leaf=cp.is_cp)

    return [mask(n) for n in range(num_modes)]


def tdpfed(
    model: Model,
    config: EngineConfig,
    *,
    cr: float,
    lam: float,
    personal_lr: float,
    personal_steps: int,
    factor_steps: int,
    factor_opt: str,
    factor_update: str,
    beta: float,
    aggregate: str,
    weights: str,
    als_iters: int,
) -> Algorithm:
    """TDPFed; see the module docstring. `config.lr` is η (the local model's learning rate)."""
    if config.local_steps is None:
        raise ValueError("tdpfed runs --local-steps τ local rounds of one minibatch each; set it")
    if cr < 1:
        raise ValueError(f"--tdpfed-cr must be >= 1 (1: no decomposition), got {cr}")
    eta, momentum = config.lr, config.momentum
    persist = config.momentum_buffer == "persist"
    nag = optax.sgd(personal_lr, momentum=momentum or None, nesterov=momentum > 0)
    make_factor_opt = (lambda: optax.adam(eta)) if factor_opt == "adam" else (lambda: optax.sgd(eta))
    # Only the state shapes are needed here; the factors' structure is known at init.
    dummy = model.init(jax.random.key(0))
    template = cp.cp_init_like(jax.random.key(0), dummy, cr)
    num_modes = max([len(a.factors) for a in jax.tree.leaves(template, is_leaf=cp.is_cp)
                     if cp.is_cp(a)] or [1])
    if factor_update == "joint":
        factor_opts = [make_factor_opt()]
    else:  # one optimizer per mode, each touching only its factors (its own Adam step count)
        factor_opts = [optax.masked(make_factor_opt(), m) for m in _mode_masks(template, num_modes)]

    def init_opt(params):
        theta, factors = params
        return nag.init(theta), tuple(o.init(factors) for o in factor_opts)

    def local_round(params, opt_state, x, y, mask, extra):
        """One local round t' on minibatch (x, y): s prox steps on θ, then s' factor steps."""
        del extra
        theta, factors = params
        nag_state, factor_state = opt_state
        centre = cp.reconstruct(factors)                                        # ⟦A_{k,t,t'}⟧
        data_grad = jax.value_and_grad(lambda p: masked_mean_loss(model, p, x, y, mask))

        def prox_step(i, carry):                                                # eq. 13
            theta, nag_state, first_loss = carry
            loss, g = data_grad(theta)
            g = jax.tree.map(lambda gi, ti, ci: gi + lam * (ti - ci), g, theta, centre)
            updates, nag_state = nag.update(g, nag_state, theta)
            return (optax.apply_updates(theta, updates), nag_state,
                    jnp.where(i == 0, loss, first_loss))

        theta, nag_state, loss = jax.lax.fori_loop(
            0, personal_steps, prox_step, (theta, nag_state, jnp.zeros(())))

        def factor_step(_, carry):                                               # eqs. 17, 23
            factors, states = carry
            states = list(states)
            for n, opt in enumerate(factor_opts):       # joint: one step; cyclic: mode by mode
                g = factor_gradient(factors, theta, lam, mode=None if factor_update == "joint" else n)
                updates, states[n] = opt.update(g, states[n], factors)
                factors = optax.apply_updates(factors, updates)
            return factors, tuple(states)

        factors, factor_state = jax.lax.fori_loop(0, factor_steps, factor_step,
                                                  (factors, factor_state))
        return (theta, factors), (nag_state, factor_state), loss

    engine = Engine(model, config, step_fn=local_round, trains="all",
                         optimizer=optax.GradientTransformation(init_opt, _no_update))
    factor_floats = cp.num_floats(template)
    dense_floats = cp.dense_num_floats(template)

    def init(key: jax.Array, data) -> State:
        dense = model.init(key)
        factors = cp.cp_init_like(jax.random.fold_in(key, 2), dense, cr)
        k = data.num_clients
        start = cp.reconstruct(factors)
        opt = core.broadcast(init_opt((start, factors)), k) if persist else None
        # ω̃ gets its own buffers: for CR = 1 or biases, ⟦A⟧ returns the very arrays of A.
        omega = jax.tree.map(jnp.copy, start) if aggregate == "act" else None
        server = engine.init_server(factors if aggregate == "afm" else start, data)
        return State(core.broadcast(start, k), factors, omega, opt, server,
                     jnp.zeros((), jnp.int32))

    def round_fn(state: State, data, key: jax.Array) -> tuple[State, dict]:
        rnd = engine.begin(data, key)                                   # line 4: S_t (uploads)
        k = data.num_clients
        start = state.omega if aggregate == "act" else cp.reconstruct(state.factors)   # W_t
        opt = state.opt_state if persist else core.broadcast(init_opt((start, state.factors)), k)
        trained = engine.train(rnd, (start, state.factors), idx=engine.everyone(data),  # line 2:
                               opt_state=opt, shared_start=True)        # ALL clients train;
        theta, local_factors = trained.params                           # θ_k ← W_t, A_k ← A_t
        uploaded = core.gather(local_factors, rnd.idx)
        p = rnd.train_counts if weights == "data_size" else None
        # Σ p_k A_k (or Σ p_k ⟦A_k⟧); under --dp-clip DP-FedAvg's noisy mean of the clipped
        # updates A_k − A_t (⟦A_k⟧ − ⟦A_t⟧) instead, uniform over the M uploads.
        if aggregate == "afm":                                           # eq. 18
            mean, server, agg = engine.aggregate(rnd, state.factors, uploaded, p, state.server)
            factors = ops.tree_lerp(state.factors, mean, beta)
            omega = None
        else:                                                            # eqs. 19–20
            composed, server, agg = engine.aggregate(rnd, cp.reconstruct(state.factors),
                                                     jax.vmap(cp.reconstruct)(uploaded), p,
                                                     state.server)
            omega = ops.tree_lerp(cp.reconstruct(state.factors), composed, beta)
            factors, errors = refit(state.factors, omega)
            agg = {**agg, "act_fit_error_max": errors}
        new_state = State(theta, factors, omega, trained.opt_state if persist else None, server,
                          state.round + 1)
        # Downlink: AFM clients rebuild ⟦A⟧ from the factors; ACT's ω̃ ≠ ⟦A⟧ must be sent dense.
        down = factor_floats + (dense_floats if aggregate == "act" else 0)
        metrics = engine.metrics(
            rnd, trained, up=factor_floats, down=down, down_clients=k, server=agg,
            down_floats_factors_only=k * factor_floats,
            down_floats_with_tensor=k * (factor_floats + dense_floats))
        return new_state, metrics

    def refit(previous: Params, omega: Params) -> tuple[Params, jax.Array]:
        """ACT eq. 20: each CP tensor re-fitted to ω̃ by ALS from A_t; dense leaves copied."""
        fitted, errors = [], []
        flat, treedef = jax.tree.flatten(previous, is_leaf=cp.is_cp)
        for a, target in zip(flat, treedef.flatten_up_to(omega)):
            if cp.is_cp(a):
                factors, err = ops.cp_als(target, a.rank, a.factors, als_iters)
                fitted.append(cp.CPFactors(factors))
                errors.append(err)
            else:
                fitted.append(target)
        worst = jnp.max(jnp.stack(errors)) if errors else jnp.zeros(())
        return jax.tree.unflatten(treedef, fitted), worst

    def evaluate(state: State, data, ids=None) -> dict[str, core.ClientEval]:
        return {"client": engine.evaluator.personal(data, state.theta, ids),
                "global": engine.evaluator.shared(data, cp.reconstruct(state.factors), ids)}

    return engine.algorithm("tdpfed", init, round_fn, evaluate)


def _no_update(updates, state, params=None):
    raise NotImplementedError("TDPFed's local step is its own step_fn")


# Spec "Recommended engine defaults" (MNIST, Section VII-A): K = S = 20, |B| = 20, τ = 23, s = 5,
# s' = 17, λ = 12, β = 1, η_p = 0.08 (NAG, momentum 0.9 assumed), η = 8e-4 (Adam), CR ×2, AFM.
_DEFAULTS = {"lr": 8e-4, "momentum": 0.9, "batch_size": 20, "local_steps": 23, "participation": 1.0}

register(AlgorithmSpec(
    name="tdpfed", factory=tdpfed,
    private_uplink="AFM: each sampled client's factor update A_k − A_t (every CP factor and dense "
                   "bias under one L2 norm); ACT: its reconstructed update ⟦A_k⟧ − ⟦A_t⟧, what the "
                   "server averages. β then scales the noisy mean update; the personalised θ_k "
                   "and the optimizer states stay on the client",
    summary="TDPFed: dense personalised models with a Moreau pull to CP-factorised local models; "
            "the factors are aggregated (AFM or ACT)",
    hparams=(
        HParam("cr", float, 2.0,
                    "compression rate: rank R = round(ΠI/(CR·ΣI)) per weight tensor (Table I); "
                    "1 = no decomposition (the dense model, as pFedMe)", check=AT_LEAST_ONE),
        HParam("lam", float, 12.0, "λ, strength of the pull λ/2‖θ − ⟦A⟧‖²",
                    check=NON_NEGATIVE),
        HParam("personal_lr", float, 0.08, "η_p, learning rate of the s NAG steps on θ",
                    check=POSITIVE),
        HParam("personal_steps", int, 5, "s, NAG steps on θ per local round (one minibatch)",
                    check=AT_LEAST_ONE),
        HParam("factor_steps", int, 17,
                    "s', data-free optimizer steps on the factors per local round",
                    check=AT_LEAST_ONE),
        HParam("factor_opt", str, "adam",
                    "optimizer of the factors, lr --lr (η): 'adam' (PyTorch defaults; the paper's "
                    "experiments) or 'gd' (eq. 17)", choices=("adam", "gd")),
        HParam("factor_update", str, "joint",
                    "'joint': every factor steps at once (one optimizer over all factors); "
                    "'cyclic': each factor in turn per step, the others fixed (ALS-like)",
                    choices=("joint", "cyclic")),
        HParam("beta", float, 1.0,
                    "β, server mixing A ← (1−β)A + β·mean (β > 1 extrapolates; Table IV)",
                    check=NON_NEGATIVE),
        HParam("aggregate", str, "afm",
                    "'afm': average the factor matrices (eq. 18); 'act': average the "
                    "reconstructed tensors and re-fit factors by ALS (eqs. 19–20)",
                    choices=("afm", "act")),
        HParam("weights", str, "data_size",
                    "client weights p_k: 'data_size' (|D_k|/Σ|D_j|) or 'uniform' (1/S)",
                    choices=("data_size", "uniform")),
        HParam("als_iters", int, 10, "ACT: ALS sweeps of the server's re-fit per round",
                    check=AT_LEAST_ONE),
    ),
    defaults=_DEFAULTS,
    traceable=('lr', 'lam', 'personal_lr', 'beta'),
    test_hparams={"cr": 1.2, "local_steps": 2},
))
