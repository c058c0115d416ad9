"""Adaptive clipping to a target quantile (`--dp-clip-quantile γ`): Andrew, Thakkar, McMahan &
Ramaswamy, "Differentially Private Learning with Adaptive Clipping", NeurIPS 2021, Algorithm 1
(the geometric update), wrapped around any algorithm that privatises its uplink.

The clip norm becomes server state, C_0 = `--dp-clip`. In round t the algorithm runs its private
round at C_t, and the server also learns, with noise, how many of the participants' updates were
within C_t:

    b̃_t = ( Σ_{k∈S_t} 1[‖Δ_k‖ ≤ C_t] + N(0, σ_b²) ) / D          D: the expected clients a round
    C_{t+1} = C_t · exp(−η_C (b̃_t − γ))                          η_C = `--dp-clip-lr` (0.2)

so C_t follows the γ-quantile of the update norms. σ_b = `--dp-count-noise`, by default D/20
(the paper's recommendation, Section 3.1).

Privacy: the count query has sensitivity 1/2 after centring (b_k − 1/2) and noise σ_b, the sum
sensitivity C and noise z_Δ·C; together they are the Gaussian mechanism with noise multiplier
z = (z_Δ⁻² + (2σ_b)⁻²)^(−1/2) (the paper's Theorem 1 reading, Section 3.1). We keep z, the
`--dp-noise-multiplier` (or what `--target-epsilon` computes), as the accounted multiplier, so
the accountant is unchanged, and noise the updates with the larger

    z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2),         which needs 2σ_b > z.

With z = 0 nothing is noised (z_Δ = 0, σ_b = 0): the clip still tracks the quantile, without
privacy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_pfl import core
from fedjax_pfl.core import placement
from fedjax_pfl.algorithms.engine import EngineConfig, expected_clients
from fedjax_pfl.algorithms.interface import Algorithm, EvaluateParts

# The stream of a round's key that the count's noise draws from (the update noise uses
# DP_NOISE): the round's other keys are those of the round at a fixed clip.
DP_COUNT_NOISE = 0x0DA


class AdaptiveClipState(NamedTuple):
    """The wrapped algorithm's state and the clip norm C_t of the next round."""

    inner: Any
    clip: jax.Array          # () float32


def count_noise(config: EngineConfig, num_real: int):
    """σ_b: `--dp-count-noise`, or D/20; 0 without noise (z = 0)."""
    sigma = (config.dp_count_noise if config.dp_count_noise is not None
             else expected_clients(config, num_real) / 20.0)
    z = config.dp_noise_multiplier
    if isinstance(z, jax.core.Tracer):                  # (swept)
        return jnp.where(z > 0, sigma, 0.0)
    return float(sigma) if z > 0 else 0.0


def update_noise_multiplier(z, sigma_b):
    """z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) (0 for z = 0; NaN where 2σ_b ≤ z: `check` refuses it)."""
    z = jnp.asarray(z, jnp.float32)
    safe = jnp.where(z > 0, z, 1.0)
    inv = safe ** -2 - (2.0 * jnp.maximum(sigma_b, 1e-30)) ** -2
    return jnp.where(z > 0, jnp.where(inv > 0, inv, jnp.nan) ** -0.5, 0.0)


def check(config: EngineConfig, num_real: int | None = None) -> None:
    """ValueError naming the flag, for settings that can be checked before tracing."""
    if config.dp_clip is None:
        raise ValueError("--dp-clip-quantile needs --dp-clip (the initial clip norm C_0)")
    if not 0.0 < config.dp_clip_quantile < 1.0:
        raise ValueError(f"--dp-clip-quantile must be in (0, 1), got {config.dp_clip_quantile!r}")
    concrete = not isinstance(config.dp_clip, jax.core.Tracer)
    if concrete and not math.isfinite(config.dp_clip):
        raise ValueError("--dp-clip-quantile adapts a finite --dp-clip (C_0), got inf")
    z = config.dp_noise_multiplier
    if num_real is None or isinstance(z, jax.core.Tracer) or not z > 0:
        return
    sigma = float(count_noise(config, num_real))
    if not 2 * sigma > z:
        raise ValueError(
            f"--dp-clip-quantile: the count's noise σ_b = {sigma:.3g} must exceed z/2 = {z / 2:.3g} "
            "(the update noise z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) keeps the accounted z): raise "
            "--dp-count-noise, or sample more clients a round")


def adaptive_clipping(build: Callable[[EngineConfig], Algorithm],
                      config: EngineConfig) -> Algorithm:
    """The algorithm `build(config)` with its clip norm adapted to the quantile
    `config.dp_clip_quantile` (module docstring). `build` is called with configurations whose
    `dp_clip` (C_t) and `dp_noise_multiplier` (z_Δ) may be traced."""
    check(config)
    fixed = dataclasses.replace(config, dp_clip_quantile=None)
    at_start = build(fixed)
    # The round builds its algorithm at C_t inside the trace: in the placement it was built for
    # (a sweep builds its runs' algorithms with their clients on one device).
    single = placement.single_device_requested()

    def at(clip, data) -> Algorithm:
        sigma = count_noise(config, data.num_real_clients)
        z_delta = update_noise_multiplier(config.dp_noise_multiplier, sigma)
        with core.single_device_clients() if single else contextlib.nullcontext():
            return build(dataclasses.replace(fixed, dp_clip=clip, dp_noise_multiplier=z_delta))

    def init(key: jax.Array, data) -> AdaptiveClipState:
        check(config, data.num_real_clients)
        return AdaptiveClipState(at_start.init(key, data), jnp.asarray(config.dp_clip, jnp.float32))

    def round_fn(state: AdaptiveClipState, data, key: jax.Array):
        inner, metrics = at(state.clip, data).round_fn(state.inner, data, key)
        sampled = jnp.asarray(metrics["sampled"])
        took_part = jnp.sum(sampled < data.num_real_clients)
        within = jnp.round((1.0 - metrics["dp_clipped_fraction"]) * took_part)   # Σ 1[‖Δ‖ ≤ C]
        sigma = count_noise(config, data.num_real_clients)
        noise = sigma * jax.random.normal(jax.random.fold_in(key, DP_COUNT_NOISE), ())
        fraction = (within + noise) / expected_clients(config, data.num_real_clients)   # b̃_t
        clip = state.clip * jnp.exp(-config.dp_clip_lr * (fraction - config.dp_clip_quantile))
        metrics = {**metrics, "dp_clip": state.clip, "dp_unclipped_noisy": fraction}
        return AdaptiveClipState(inner, clip.astype(jnp.float32)), metrics

    def evaluate(state: AdaptiveClipState, data, ids=None):
        return at_start.evaluate(state.inner, data, ids)

    inner_parts, parts = at_start.evaluate_parts, None
    if inner_parts is not None:
        parts = EvaluateParts(
            rows=lambda state, data, ids=None: inner_parts.rows(state.inner, data, ids),
            rest=lambda state, data, ids=None: inner_parts.rest(state.inner, data, ids))
    return at_start._replace(init=init, round_fn=round_fn, evaluate=evaluate,
                             evaluate_parts=parts)
