"""A run's privacy budget: the noise multiplier for --target-epsilon, and ε after every round.

With --dp-clip the algorithm privatises its uplink (`ops.dp`, the server chain of `core.server`): each
round is the Gaussian mechanism with noise multiplier z on M of the N real clients, sampled
without replacement (the engine's fixed-size sampling), or, with --sampling poisson, on the
clients that each took part with probability q (`core.sample_poisson`). The accountant
(`privacy.accounting`, Google's dp-accounting) composes the rounds for the sampling used; ε at δ
after round r goes into that round's metrics row (`dp_epsilon`) and the summary's privacy record.

Per-round ε is RDP's (one RDP vector, scaled per round). With --dp-accountant pld (Poisson
sampling only) the summary's ε after the last round is PLD's, usually tighter; the rows keep
RDP's, and the record names both (`accountant`, `rows_accountant`). Poisson sampling truncated to
the round's K slots adds `core.poisson.truncation_delta` to δ; the record reports it.

With --dp-clip-quantile (adaptive clipping, `core.server.adaptive_clip`) the accounted z covers
the noised updates and the noised count together; the record gives the update noise z_Δ and the
count noise σ_b that make it up, and `dp_clip` is then the initial clip norm C_0.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable

from fedjax_pfl import core
from fedjax_pfl.errors import OptionError, arg


@dataclasses.dataclass(frozen=True)
class PrivacyPlan:
    noise_multiplier: float
    clip: float
    delta: float
    accountant: str
    sampling: str
    clients: int
    clients_per_round: int
    epsilons: tuple[float | None, ...]   # ε at δ after rounds 1, 2, …; None: no bound (z = 0)
    target_epsilon: float | None = None
    rate: float | None = None            # Poisson sampling: each client's probability q
    slots: int | None = None             # Poisson sampling: the round's capacity K
    adaptive: dict[str, Any] | None = None  # --dp-clip-quantile: γ, η, σ_b and z_Δ

    def record(self, rounds_done: int) -> dict[str, Any]:
        """The summary's privacy record after `rounds_done` rounds."""
        eps = self.epsilons[rounds_done - 1] if rounds_done > 0 else 0.0   # None: unbounded
        rec = {"dp_epsilon": eps, "delta": self.delta, "noise_multiplier": self.noise_multiplier,
               "clip": self.clip if math.isfinite(self.clip) else None,
               "accountant": self.accountant, "sampling": self.sampling,
               "clients": self.clients, "clients_per_round": self.clients_per_round,
               "target_epsilon": self.target_epsilon}
        if self.adaptive is not None:
            rec["adaptive_clip"] = self.adaptive
        if self.sampling != "poisson":
            return rec
        if self.accountant == "pld" and rounds_done > 0 and eps is not None:
            from fedjax_pfl.privacy import accounting
            eps = accounting.epsilon(self.noise_multiplier, rounds=rounds_done,
                                     num_clients=self.clients, rate=self.rate,
                                     sampling="poisson", delta=self.delta, accountant="pld")
            rec["dp_epsilon"] = eps
        return {**rec, "rows_accountant": "rdp", "rate": self.rate, "slots": self.slots,
                "overflow_probability": core.OVERFLOW_PROBABILITY,
                "truncation_delta": core.truncation_delta(rounds_done, eps)}


def default_delta(num_clients: int) -> float:
    """δ = N^-1.1: below 1/N, so that no mechanism may simply publish one client's data."""
    return float(num_clients) ** -1.1


def warn_unhelpful_target(target: float, z: float, clients_per_round: float,
                          epsilon: Callable[[float], float], tolerance: float = 1e-3) -> None:
    """An OptionWarning (one line) when the noise multiplier z that `target` ε calls for (the
    least that meets it, `accounting.noise_multiplier_for` to relative `tolerance`) cannot serve
    a useful run:

    * z > M, the clients a round (expected, under Poisson sampling): the Gaussian noise on the
      mean of the M clipped updates has standard deviation z·C/M per coordinate, more than the
      clip C, the norm no client's update exceeds; the noise then drowns the whole signal of
      every round, in every coordinate (DP-FedAvg, McMahan et al. 2018, trains at z·C/M ≪ C).
    * ε(z) < target/2: the search stops where ε(z) ≤ target < ε(z·(1 − tol)), so a continuous
      ε(z) would be within a hair of the target; one far below it is a jump of the accountant's
      arithmetic (RDP's conversion to (ε, δ) bottoms out at 0.0 for large z), not a bound it
      resolved: a target below that floor is "met" by the floor.
    """
    from fedjax_pfl.errors import OptionWarning

    words = []
    if z > clients_per_round:
        words.append(f"above the {clients_per_round:g} clients a round, the noise on the mean "
                     "update (z·C/M) exceeds the clip C: the run can hardly learn")
    reached = epsilon(z)
    if reached < target / 2:
        words.append(f"its ε = {reached:.3g} is the accountant's precision floor, not the target "
                     f"met (ε = {epsilon(z * (1 - tolerance)):.3g} just below that z)")
    if words:
        warnings.warn(OptionWarning(f"{arg('target_epsilon')} {target:g} calls for "
                                    f"{arg('dp_noise_multiplier', 'hparams')} {z:.4g}: "
                                    + "; ".join(words)), stacklevel=3)


def plan(cfg, hparams: dict[str, Any], num_clients: int) -> tuple[dict[str, Any], PrivacyPlan | None]:
    """(the hyperparameters, with the noise multiplier `target_epsilon` calls for; the run's
    privacy plan, None without `dp_clip`). OptionErrors name the setting."""
    clip = hparams.get("dp_clip")
    if clip is None:
        for name, value in (("target_epsilon", cfg.target_epsilon), ("dp_delta", cfg.dp_delta)):
            if value is not None:
                raise OptionError(f"{arg(name)} needs {arg('dp_clip', 'hparams')} (client-level "
                                  "DP of the uplink)")
        return hparams, None
    from fedjax_pfl.privacy import accounting  # (dp-accounting: only for private runs)

    q = hparams["participation"]
    poisson = hparams.get("sampling") == "poisson"
    delta = cfg.dp_delta if cfg.dp_delta is not None else default_delta(num_clients)
    if poisson:
        m = core.poisson_capacity(num_clients, q)
        common = dict(num_clients=num_clients, rate=q, sampling="poisson", delta=delta)
    else:
        m = core.num_sampled_clients(num_clients, q)
        if cfg.dp_accountant == "pld":
            raise OptionError(f"{arg('dp_accountant')} pld: dp-accounting's PLD accountant does "
                              "not support the engine's fixed-size sampling (M of N without "
                              f"replacement); use rdp, or {arg('sampling', 'hparams')} poisson")
        common = dict(num_clients=num_clients, clients_per_round=m, sampling="fixed",
                      delta=delta)
    z = hparams["dp_noise_multiplier"]
    if cfg.target_epsilon is not None:
        if z:
            raise OptionError(f"give {arg('dp_noise_multiplier', 'hparams')} or "
                              f"{arg('target_epsilon')}, not both")
        z = accounting.noise_multiplier_for(cfg.target_epsilon, rounds=cfg.rounds,
                                            accountant=cfg.dp_accountant, **common)
        hparams = {**hparams, "dp_noise_multiplier": z}
        warn_unhelpful_target(cfg.target_epsilon, z, q * num_clients if poisson else m,
                              lambda z: accounting.epsilon(z, rounds=cfg.rounds,
                                                           accountant=cfg.dp_accountant, **common))
    adaptive = None
    if hparams.get("dp_clip_quantile") is not None:
        from fedjax_pfl.algorithms import EngineConfig, engine
        from fedjax_pfl.ops import dp

        config, _ = EngineConfig.split({**hparams, "dp_noise_multiplier": z})
        engine.check_adaptive_clip(config, num_clients)
        sigma = float(engine.count_noise(config, engine.expected_clients(config, num_clients)))
        adaptive = {"quantile": hparams["dp_clip_quantile"], "lr": hparams["dp_clip_lr"],
                    "count_noise": sigma,
                    "update_noise_multiplier": float(dp.update_noise_multiplier(z, sigma))}
    epsilons = accounting.epsilons(z, rounds=cfg.rounds, accountant="rdp", **common)
    # No noise bounds nothing: ε = ∞, written as null (JSON has no infinity).
    finite = tuple(float(e) if math.isfinite(e) else None for e in epsilons)
    return hparams, PrivacyPlan(float(z), float(clip), float(delta), cfg.dp_accountant,
                                common["sampling"], num_clients, m, finite, cfg.target_epsilon,
                                rate=float(q) if poisson else None,
                                slots=m if poisson else None, adaptive=adaptive)
