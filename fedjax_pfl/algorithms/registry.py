"""The algorithm registry and hyperparameters: `HParam` declarations (the command line, its
help and validation come from them), the common ones (`COMMON_HPARAMS`), `AlgorithmSpec` and
`algorithms.get`.

A factory is `factory(model, config: EngineConfig, *, <its own hyperparameters by name>)`;
`get` validates the hyperparameters (`AlgorithmSpec.resolve`) and splits them between the two
(`AlgorithmSpec.build`). Each module registers its algorithms with an `AlgorithmSpec`, including
the small configuration the cross-cutting tests run it with (`test_hparams`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from fedjax_pfl import core
from fedjax_pfl.algorithms.engine import EngineConfig
from fedjax_pfl.algorithms.interface import Algorithm
from fedjax_pfl.core.rows import PlacedRows
from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.errors import OptionError, arg
from fedjax_pfl.models.model import Model
from fedjax_pfl.ops.attacks import ATTACKS, MODEL_ATTACKS
from fedjax_pfl.ops.robust import AGGREGATORS
from fedjax_pfl.ops.server_opt import SERVER_OPTIMISERS


@dataclasses.dataclass(frozen=True)
class Check:
    """A validity condition with the words used in the error message."""

    test: Callable[[Any], bool]
    words: str


POSITIVE = Check(lambda v: v > 0, "> 0")
NON_NEGATIVE = Check(lambda v: v >= 0, ">= 0")
AT_LEAST_ONE = Check(lambda v: v >= 1, ">= 1")
UNIT_OPEN_CLOSED = Check(lambda v: 0 < v <= 1, "in (0, 1]")
UNIT_CLOSED = Check(lambda v: 0 <= v <= 1, "in [0, 1]")
UNIT_CLOSED_OPEN = Check(lambda v: 0 <= v < 1, "in [0, 1)")


@dataclasses.dataclass(frozen=True)
class HParam:
    """One hyperparameter: keyword name, type, default, help text and constraints.

    `flag` is its command-line spelling; `aliases` are extra spellings of the same flag.
    A default of None means "derived" (the help text says from what).
    """

    name: str
    type: type
    default: Any
    help: str
    choices: tuple | None = None
    check: Check | None = None
    flag: str | None = None
    aliases: tuple[str, ...] = ()

    def cli_flag(self, prefix: str | None) -> str:
        if self.flag:
            return self.flag
        stem = self.name.replace("_", "-")
        return f"--{prefix.replace('_', '-')}-{stem}" if prefix else f"--{stem}"

    def validate(self, value: Any, flag: str) -> Any:
        if value is None:
            if self.default is None:
                return None
            value = self.default
        if self.type is bool:
            if not isinstance(value, (bool, int)):
                raise ValueError(f"{flag} must be true or false, got {value!r}")
            value = bool(value)
        else:
            try:
                value = self.type(value)
            except (TypeError, ValueError):
                raise ValueError(f"{flag} must be {self.type.__name__}, got {value!r}") from None
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{flag} must be one of {list(self.choices)}, got {value!r}")
        if self.check is not None and not self.check.test(value):
            raise ValueError(f"{flag} must be {self.check.words}, got {value!r}")
        return value


COMMON_HPARAMS: tuple[HParam, ...] = (
    HParam("participation", float, 0.25,
           "fraction of clients sampled per round; M = ⌊N·rate⌋, the exact floor (one more than "
           "the reference codes' int(N·rate) in cases such as N = 100, rate 0.29: 29 vs 28)",
           check=UNIT_OPEN_CLOSED),
    HParam("local_epochs", int, 1, "local epochs E: every client visits each of its samples E times "
           "(not with --local-steps, which replaces it)",
           check=AT_LEAST_ONE),
    HParam("local_steps", int, None,
           "if set: exactly K local minibatch steps per client and round instead of "
           "--local-epochs (batches walk through reshuffled epochs of the client's data); "
           "--local-epochs with it is refused, as it is with an algorithm whose default sets it",
           check=AT_LEAST_ONE),
    HParam("batch_size", int, 10, "local minibatch size B", check=AT_LEAST_ONE),
    HParam("lr", float, 0.05, "client learning rate of local SGD", check=POSITIVE),
    HParam("momentum", float, 0.0, "SGD momentum of the client optimizer (0: plain SGD)",
           check=UNIT_CLOSED_OPEN),
    HParam("momentum_buffer", str, "reset",
           "per-client momentum buffer across participations: 'persist' keeps each client's "
           "buffer from its last round (the PGFed reference code), 'reset' starts at zero",
           choices=("persist", "reset"), aliases=("--pgfed-momentum-buffer",)),
    HParam("drop_last", bool, False,
           "drop each epoch's last partial batch: ⌊n/B⌋ steps instead of ⌈n/B⌉"),
    HParam("backend", str, "chunked",
           "how sampled clients run: 'chunked' (vmap over chunks of --chunk-size clients, "
           "sequential over chunks), 'vmap' (all clients in one vectorised step), 'loop' (one "
           "client at a time, the reference) or 'debug' (no jit at all; an error names the "
           "client, round and stage); with several devices clients are split across them",
           choices=core.BACKENDS),
    HParam("chunk_size", int, 0,
           "clients per chunk for --backend chunked and for evaluation; 0 picks it from XLA's "
           "memory analysis of one client's step: temporaries within 16 MB and temporaries plus "
           "parameters within 1 GiB per CPU device (whole vmap on accelerators)",
           check=NON_NEGATIVE),
    HParam("eval_batch_size", int, 0,
           "test samples per evaluation batch; 0 picks the largest multiple of 8 up to 256 whose "
           "forward pass keeps its temporaries within 2 MiB on a CPU device (XLA's memory "
           "analysis: 256 for the MLP, 8 for the CNN, whose im2col patches then stay in cache). "
           "PGFed's full-data gradient pass uses the same batch",
           check=NON_NEGATIVE),
    HParam("dp_clip", float, None,
           "client-level differential privacy of the uplink (DP-FedAvg): each client's update "
           "clipped to this L2 norm C ('inf': no clipping) and the server's sum noised with "
           "--dp-noise-multiplier; unset: no privacy. Only algorithms that declare what they "
           "privatise accept it (docs/privacy.md)",
           check=POSITIVE),
    HParam("dp_noise_multiplier", float, 0.0,
           "z: Gaussian noise of standard deviation z·C on the sum of the clipped updates "
           "(with --dp-clip; --target-epsilon computes it)",
           check=NON_NEGATIVE),
    HParam("dp_clip_quantile", float, None,
           "adaptive clipping (Andrew et al., NeurIPS 2021): the clip norm, starting at "
           "--dp-clip, follows this quantile γ of the clients' update norms, learnt from a noised "
           "count each round (C ← C·exp(−η(b̃ − γ))); unset: a fixed clip",
           check=Check(lambda v: 0 < v < 1, "in (0, 1)")),
    HParam("dp_clip_lr", float, 0.2,
           "η: the step of the adaptive clip's geometric update (with --dp-clip-quantile)",
           check=POSITIVE),
    HParam("dp_count_noise", float, None,
           "σ_b: the noise standard deviation on the adaptive clip's count of unclipped updates "
           "(with --dp-clip-quantile); default: the expected clients per round / 20",
           check=POSITIVE),
    HParam("sampling", str, "fixed",
           "how a round's clients are drawn: 'fixed' (M = ⌊N·rate⌋ distinct clients, uniformly) "
           "or 'poisson' (each client independently with probability rate; the round holds "
           "K slots, K exceeded with probability ≤ 1e-12, unused slots empty). 'poisson' needs "
           "--dp-clip ('inf' for no clipping): only the private server step masks the empty slots",
           choices=("fixed", "poisson")),
    # The server optimiser (ops/server_opt.py; docs/server-optimisers.md): only the algorithms
    # whose server step is an averaged pseudo-gradient take them (SERVER_OPTIMISED).
    HParam("server_opt", str, "sgd",
           "the server's optimiser on the round's mean update Δ (Reddi et al., ICLR 2021, "
           "Algorithm 2): 'sgd' x ← x + η·Δ (FedAvg at --server-lr 1), 'momentum' / 'nesterov' "
           "(FedAvgM), 'adam', 'yogi', 'adagrad' (FedAdam, FedYogi, FedAdagrad: no bias "
           "correction, v starts at τ²); with --dp-clip on the noised mean update",
           choices=SERVER_OPTIMISERS, flag="--server-opt"),
    HParam("server_opt_lr", float, 1.0, "η: the server learning rate of --server-opt",
           check=POSITIVE, flag="--server-lr"),
    HParam("server_opt_momentum", float, 0.9,
           "the server momentum of --server-opt momentum / nesterov (0: plain SGD)",
           check=UNIT_CLOSED_OPEN, flag="--server-momentum"),
    HParam("server_opt_b1", float, 0.9,
           "β1: the first-moment decay of --server-opt adam / yogi / adagrad (0: none; "
           "google-research/federated's FedAdagrad has none)",
           check=UNIT_CLOSED_OPEN, flag="--server-b1"),
    HParam("server_opt_b2", float, 0.99,
           "β2: the second-moment decay of --server-opt adam / yogi",
           check=UNIT_CLOSED_OPEN, flag="--server-b2"),
    HParam("server_opt_eps", float, 1e-3,
           "τ: the adaptivity of --server-opt adam / yogi / adagrad (√v + τ in the denominator, "
           "v starting at τ²; with --server-bias-correction optax's eps, v starting at 0)",
           check=POSITIVE, flag="--server-eps"),
    HParam("server_opt_bias_correction", bool, False,
           "--server-opt adam as optax.adam: moments divided by 1 − β^t, v starting at 0 "
           "(the paper's Algorithm 2 corrects no bias)", flag="--server-bias-correction"),
    # The reduction (ops/robust.py; docs/robust-aggregation.md): only the algorithms that
    # aggregate their clients' uploads through the server chain take one (ROBUST_AGGREGATED).
    HParam("aggregator", str, "mean",
           "the server's reduction of the clients' updates: 'mean' (the weighted mean, as "
           "always), or a robust rule over the updates: 'median' / 'trimmed_mean' (coordinate-"
           "wise, Yin et al. 2018), 'krum' / 'multi_krum' (Blanchard et al. 2017), 'bulyan' "
           "(El Mhamdi et al. 2018), 'geomed' (RFA, Pillutla et al. 2022), 'centered_clip' "
           "(Karimireddy et al. 2021), 'norm_bound' (Sun et al. 2019); not with --dp-clip; "
           "a --server-opt steps along the rule's update",
           choices=AGGREGATORS, flag="--aggregator"),
    HParam("aggregator_beta", float, 0.1,
           "β: the fraction --aggregator trimmed_mean removes from EACH end of every "
           "coordinate (⌊β·M⌋ values; 0: the uniform mean)",
           check=Check(lambda v: 0 <= v < 0.5, "in [0, 0.5)"), flag="--aggregator-beta"),
    HParam("aggregator_f", int, None,
           "f: the Byzantine clients --aggregator krum / multi_krum / bulyan assume among the "
           "M of a round; default: the most the rule tolerates, ⌊(M − 3)/2⌋ (Krum: 2f + 2 < M) "
           "or ⌊(M − 3)/4⌋ (Bulyan: M ≥ 4f + 3)",
           check=NON_NEGATIVE, flag="--aggregator-f"),
    HParam("aggregator_m", int, None,
           "m: the lowest-scored updates --aggregator multi_krum averages; default M − f",
           check=AT_LEAST_ONE, flag="--aggregator-m"),
    HParam("aggregator_iters", int, None,
           "the iterations of --aggregator geomed (smoothed Weiszfeld steps; default 5) or "
           "centered_clip (clipping steps from the previous aggregate; default 1)",
           check=AT_LEAST_ONE, flag="--aggregator-iters"),
    HParam("aggregator_nu", float, 1e-6,
           "ν: the smoothing of --aggregator geomed (an update within ν of the estimate weighs "
           "as if at distance ν)", check=POSITIVE, flag="--aggregator-nu"),
    HParam("aggregator_tau", float, None,
           "τ: the clipping radius of --aggregator centered_clip, in update units; default: "
           "the median distance of the updates from the centre, each step",
           check=POSITIVE, flag="--aggregator-tau"),
    HParam("aggregator_radius", float, None,
           "ρ: the L2 norm --aggregator norm_bound clips each update to; default: the median "
           "of the round's update norms", check=POSITIVE, flag="--aggregator-radius"),
    # The adversaries (ops/attacks.py, ops/poison.py; docs/attacks.md): a seeded set of
    # malicious clients (the seed is the run's: --attack-seed) and what they do.
    HParam("attack", str, "none",
           "what the malicious clients (--attack-fraction) do: 'label_flip' / 'backdoor' poison "
           "their training data; 'sign_flip' (−S·Δ), 'scale' (S·Δ, model replacement), "
           "'gaussian' (N(0, σ²) uploads), 'alie' (μ − zσ of the benign updates, Baruch et al. "
           "2019), 'ipm' (−ε·μ, Xie et al. 2020) replace the update they upload",
           choices=ATTACKS, flag="--attack"),
    HParam("attack_fraction", float, 0.0,
           "F: the malicious clients, ⌈F·N⌉ of the N, drawn from --attack-seed; 0: none",
           check=UNIT_CLOSED_OPEN, flag="--attack-fraction"),
    HParam("attack_redraw", bool, False,
           "re-draw the malicious set every round (default: one set for the whole run)",
           flag="--attack-redraw"),
    HParam("attack_scale", float, None,
           "S of --attack sign_flip (−S·Δ; default 1) and scale (S·Δ; default the round's "
           "clients M, Bagdasaryan et al.'s n/η)", check=POSITIVE, flag="--attack-scale"),
    HParam("attack_std", float, 1.0, "σ of --attack gaussian: each malicious upload ~ N(0, σ²I)",
           check=POSITIVE, flag="--attack-std"),
    HParam("attack_z", float, None,
           "z of --attack alie (μ − z·σ); default Baruch et al.'s z_max = Φ⁻¹((n − s)/n), "
           "s = ⌊n/2 + 1⌋ − f, from the round's n clients and f malicious",
           check=NON_NEGATIVE, flag="--attack-z"),
    HParam("attack_eps", float, 0.1, "ε of --attack ipm (−ε × the benign mean update)",
           check=POSITIVE, flag="--attack-eps"),
    HParam("attack_target", int, None,
           "the target label of --attack backdoor (default 0) and label_flip (every label set "
           "to it; default the permutation y → C − 1 − y)",
           check=NON_NEGATIVE, flag="--attack-target"),
    HParam("attack_poison_fraction", float, 0.5,
           "--attack backdoor: the share of each malicious client's training examples that "
           "carry the trigger (a seeded, fixed subset)", check=UNIT_OPEN_CLOSED,
           flag="--attack-poison-fraction"),
    HParam("attack_trigger_size", int, 2,
           "--attack backdoor: the trigger, the bottom-right k×k pixels set to the top of the "
           "input range (the last k features or tokens)", check=AT_LEAST_ONE,
           flag="--attack-trigger-size"),
)


@dataclasses.dataclass(frozen=True)
class AlgorithmSpec:
    """A registered algorithm: its factory, own hyperparameters and overrides of common defaults."""

    name: str
    factory: Callable[..., Algorithm]
    summary: str
    hparams: tuple[HParam, ...] = ()
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    flag_prefix: str | None = None
    # Hyperparameters the factory uses only in arithmetic: a sweep may pass them as traced
    # arrays and vmap one compiled program over their values (fedjax_pfl.sweep).
    traceable: tuple[str, ...] = ("lr",)
    # The algorithm's test configuration: hyperparameters (common or own) on top of its
    # defaults that keep a test run small and training on the tests' linear model {w, b}
    # (tests/support/helpers.py): a few local steps where the defaults would run many, both parts
    # non-empty in a split model, persistent momentum rows where the algorithm keeps them. The
    # cross-cutting tests (tests/core/test_sharding.py, tests/core/test_cached_evaluation.py) run
    # every registered algorithm with it on top of their own small common settings. None: not
    # declared (tests/algorithms/test_registry.py requires every algorithm to declare one).
    test_hparams: Mapping[str, Any] | None = None
    # What the algorithm privatises under --dp-clip (its uplink: e.g. "the global model's
    # update"); None: it does not support client-level DP, and --dp-clip is refused.
    private_uplink: str | None = None
    # Why it does not (said when --dp-clip is refused), where the reason is known.
    not_private: str | None = None

    def all_hparams(self) -> list[tuple[HParam, str]]:
        """(hparam with this algorithm's default, CLI flag) for common and own hyperparameters."""
        out = []
        for hp in COMMON_HPARAMS:
            if hp.name in self.defaults:
                hp = dataclasses.replace(hp, default=self.defaults[hp.name])
            out.append((hp, hp.cli_flag(None)))
        out += [(hp, hp.cli_flag(self.flag_prefix or self.name)) for hp in self.hparams]
        return out

    def resolve(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        """Validated hyperparameters: overrides on top of defaults; unknown names are errors."""
        table = {hp.name: (hp, flag) for hp, flag in self.all_hparams()}
        unknown = sorted(set(overrides) - set(table))
        if unknown:
            raise ValueError(
                f"{self.name} has no hyperparameter {', '.join(unknown)}; valid: {sorted(table)}"
            )
        return {name: hp.validate(overrides.get(name), flag) for name, (hp, flag) in table.items()}

    def build(self, model: Model, hparams: Mapping[str, Any]) -> Algorithm:
        """`factory(model, EngineConfig(common), **own)` from a full set of hyperparameters (e.g.
        `resolve`'s): the common ones (`COMMON_HPARAMS`) go into the engine configuration, this
        algorithm's own ones to the factory by name. Nothing is validated or converted here, so
        a sweep may pass traced arrays (fedjax_pfl.sweep)."""
        config, own = EngineConfig.split(hparams)
        if config.dp_clip is not None and self.private_uplink is None:
            supported = sorted(n for n, sp in _REGISTRY.items() if sp.private_uplink)
            why = f" ({self.not_private})" if self.not_private else ""
            raise ValueError(f"{self.name} does not privatise its uplink (--dp-clip){why}; "
                             f"client-level DP is built for: {', '.join(supported)}")
        check_server_optimiser(self.name, config)
        check_aggregator(self.name, config)
        check_attack(self.name, config)
        if config.sampling == "poisson" and config.dp_clip is None:
            raise ValueError("--sampling poisson needs --dp-clip (use --dp-clip inf for no "
                             "clipping): a round's empty slots are masked out by the private "
                             "server step only")
        return self.factory(model, config, **own)


_REGISTRY: dict[str, AlgorithmSpec] = {}


# The privacy parameters reach a private algorithm's program only as arithmetic on the uploads
# (the server chain, `core.server`, ops/dp.py): every algorithm that privatises its uplink can sweep them.
DP_TRACEABLE = ("dp_clip", "dp_noise_multiplier")


# The algorithms whose server step is an averaged pseudo-gradient: the new server value is the
# server chain's mean of uploads that started from it (the global model, a shared part, FedRoD's
# (θ, ψ), TDPFed's factors), so a server optimiser (--server-opt) can step along mean − start
# (docs/server-optimisers.md). Algorithms that post-process the mean take the optimiser's
# value in its place: pFedMe's β-mixing scales its step by β, FedDyn's h and θ are computed
# from it, TDPFed's β-mixing (and ACT's refit) follow it.
SERVER_OPTIMISED = frozenset({
    "apfl", "ditto", "fedala", "fedavg", "fedavg_ft", "fedavg_sar", "fedbabu", "feddpa", "feddyn",
    "fedper", "fedprox", "fedprox_ft", "fedrep", "fedrod", "ffa_lora", "lg_fedavg", "moon",
    "perfedavg", "pfedme", "pgfed", "pgfed_ce", "pgfedmo", "tdpfed",
})
# Why an algorithm that aggregates still takes no server optimiser (said when it is refused).
NO_SERVER_OPTIMISER = {
    "scaffold": "its server step x ← x + η_g·mean Δy is its own --scaffold-server-lr, and its "
                "upload also carries the control variates' Δc, which a server optimiser must "
                "not transform",
    "pfedsop": "it keeps no server model: the mean update is sent back as the direction of "
               "each client's own second-order step",
}
# The server optimiser's hyperparameters reach the program only as arithmetic on the mean
# update (ops/server_opt.py): the algorithms that take one can sweep them.
SERVER_OPT_TRACEABLE = ("server_opt_lr", "server_opt_momentum", "server_opt_b1", "server_opt_b2",
                        "server_opt_eps")
# The server optimiser's settings, with the --server-opt values each applies to (None: all).
SERVER_OPT_SETTINGS = {"server_opt": None, "server_opt_lr": None,
                       "server_opt_momentum": ("momentum", "nesterov"),
                       "server_opt_b1": ("adam", "yogi", "adagrad"),
                       "server_opt_b2": ("adam", "yogi"),
                       "server_opt_eps": ("adam", "yogi", "adagrad"),
                       "server_opt_bias_correction": ("adam",)}


def server_optimiser_refusal(name: str) -> str | None:
    """Why algorithm `name` takes no server optimiser (one clause), or None where it takes one."""
    if name in SERVER_OPTIMISED:
        return None
    return NO_SERVER_OPTIMISER.get(
        name, "its server step is not an averaged pseudo-gradient: no server model of its is "
              "the mean of its clients' uploads")


def check_server_optimiser(name: str, config: EngineConfig) -> None:
    """ValueError naming the flag where algorithm `name` is given a server optimiser it does
    not take, or --server-bias-correction without --server-opt adam (a traced learning rate
    counts as given: only a sweep traces it)."""
    lr = config.server_opt_lr
    given = config.server_opt != "sgd" or isinstance(lr, jax.core.Tracer) or float(lr) != 1.0
    why = server_optimiser_refusal(name)
    if given and why is not None:
        supported = ", ".join(sorted(n for n in _REGISTRY if n in SERVER_OPTIMISED))
        raise OptionError(f"{name} takes no server optimiser ({arg('server_opt', 'hparams')} / "
                          f"{arg('server_opt_lr', 'hparams')}): {why}; built for: {supported}")
    if config.server_opt_bias_correction and config.server_opt != "adam":
        raise OptionError(f"{arg('server_opt_bias_correction', 'hparams')} applies to "
                          f"{arg('server_opt', 'hparams')} adam only, not "
                          f"{arg('server_opt', 'hparams')} {config.server_opt}")


# The algorithms whose server chain reduces their clients' uploads (Engine.aggregate) and may do
# so robustly (--aggregator): those with a server pseudo-gradient, and pFedSOP, whose mean
# update of the clients' updates is sent back as their direction (a robust rule over the same
# updates in its place).
ROBUST_AGGREGATED = SERVER_OPTIMISED | {"pfedsop"}
# Why an algorithm that aggregates still takes no robust rule (said when it is refused).
NO_ROBUST_AGGREGATOR = {
    "scaffold": "its upload is two parts (Δy, Δc): the server control variate must stay the "
                "mean of the clients' c_i (c ← c + (|S|/N)·mean Δc), which a robust rule, per "
                "part or on the pair, breaks",
}
# The reduction's settings, with the --aggregator values each applies to (None: all).
AGGREGATOR_SETTINGS = {"aggregator": None,
                       "aggregator_beta": ("trimmed_mean",),
                       "aggregator_f": ("krum", "multi_krum", "bulyan"),
                       "aggregator_m": ("multi_krum",),
                       "aggregator_iters": ("geomed", "centered_clip"),
                       "aggregator_nu": ("geomed",),
                       "aggregator_tau": ("centered_clip",),
                       "aggregator_radius": ("norm_bound",)}


def aggregator_refusal(name: str) -> str | None:
    """Why algorithm `name` takes no robust aggregator (one clause), or None where it takes one."""
    if name in ROBUST_AGGREGATED:
        return None
    return NO_ROBUST_AGGREGATOR.get(
        name, "it aggregates no uploads through the server chain (no server model of its is a "
              "mean of its clients' uploads)")


def aggregator_dp_refusal() -> str:
    """Why a robust rule is refused with --dp-clip (one clause)."""
    return ("a robust rule is not defined under client-level DP: the server's estimate is one "
            "noised sum of clipped updates, not a rule over each client's update")


def check_aggregator(name: str, config: EngineConfig) -> None:
    """OptionError naming the flag where algorithm `name` is given a robust --aggregator it does
    not take, or one with --dp-clip."""
    if config.aggregator == "mean":
        return
    why = aggregator_refusal(name)
    if why is not None:
        supported = ", ".join(sorted(n for n in _REGISTRY if n in ROBUST_AGGREGATED))
        raise OptionError(f"{name} takes no robust aggregator ({arg('aggregator', 'hparams')} "
                          f"{config.aggregator}): {why}; built for: {supported}")
    if config.dp_clip is not None:
        raise OptionError(f"{arg('aggregator', 'hparams')} {config.aggregator} does not apply "
                          f"with {arg('dp_clip', 'hparams')}: {aggregator_dp_refusal()}")


# The algorithms whose clients' uploads go through the server chain (Engine.aggregate), where a
# model-poisoning --attack replaces the malicious ones: those that may aggregate robustly, and
# SCAFFOLD (its (Δy, Δc) replaced together).
MODEL_ATTACKED = ROBUST_AGGREGATED | {"scaffold"}
# The attack's settings, with the --attack values each applies to.
ATTACK_SETTINGS = {"attack_scale": ("sign_flip", "scale"), "attack_std": ("gaussian",),
                   "attack_z": ("alie",), "attack_eps": ("ipm",),
                   "attack_target": ("label_flip", "backdoor"),
                   "attack_poison_fraction": ("backdoor",),
                   "attack_trigger_size": ("backdoor",)}


def attack_refusal(name: str, kind: str) -> str | None:
    """Why algorithm `name` cannot be given --attack `kind` (one clause), or None."""
    if kind in MODEL_ATTACKS and name not in MODEL_ATTACKED:
        return ("it aggregates no uploads through the server chain, so no malicious upload can "
                "be replaced; the data attacks label_flip and backdoor apply")
    return None


def check_attack(name: str, config: EngineConfig) -> None:
    """OptionError naming the flag where algorithm `name` is given a model-poisoning --attack
    it has no uploads for, or an attack's setting under another --attack."""
    why = attack_refusal(name, config.attack)
    if why is not None:
        supported = ", ".join(sorted(n for n in _REGISTRY if n in MODEL_ATTACKED))
        raise OptionError(f"{name} takes no {arg('attack', 'hparams')} {config.attack}: {why}; "
                          f"model poisoning is built for: {supported}")
    defaults = EngineConfig()
    for setting, kinds in ATTACK_SETTINGS.items():
        if (getattr(config, setting) != getattr(defaults, setting)
                and config.attack not in kinds):
            raise OptionError(f"{arg(setting, 'hparams')} applies to {arg('attack', 'hparams')} "
                              f"{' / '.join(kinds)} only, not {arg('attack', 'hparams')} "
                              f"{config.attack}")
    if config.attack_redraw and not config.attack_fraction:
        raise OptionError(f"{arg('attack_redraw', 'hparams')} re-draws the malicious set, and "
                          f"{arg('attack_fraction', 'hparams')} 0 has none")


def register(spec: AlgorithmSpec) -> AlgorithmSpec:
    if spec.name in _REGISTRY:
        raise ValueError(f"algorithm {spec.name!r} is registered twice")
    if spec.private_uplink is not None:
        spec = dataclasses.replace(spec, traceable=tuple(dict.fromkeys(spec.traceable + DP_TRACEABLE)))
    if spec.name in SERVER_OPTIMISED:
        spec = dataclasses.replace(spec, traceable=tuple(dict.fromkeys(
            spec.traceable + SERVER_OPT_TRACEABLE)))
    _REGISTRY[spec.name] = spec
    return spec


def names() -> list[str]:
    return sorted(_REGISTRY)


def spec(name: str) -> AlgorithmSpec:
    if name not in _REGISTRY:
        raise ValueError(f"unknown algorithm {name!r}; expected one of {names()}")
    return _REGISTRY[name]


def get(name: str, *, model: Model, unseen_clients: float = 0.0, unseen_seed: int = 0,
        attack_seed: int = 0, **hparams: Any) -> Algorithm:
    """Builds algorithm `name` for `model` with validated hyperparameters (others at defaults).

    `unseen_clients` FRAC, `unseen_seed` S: ⌈FRAC·N⌉ clients drawn once from S never train
    (`engine.unseen_ids`; the run's --unseen-clients and --seed): no hyperparameter, a setting
    of the run's engine. `attack_seed`: the seed of the malicious set (--attack-fraction;
    `engine.malicious_mask`), the run's --attack-seed or --seed.

    Its functions check their inputs first, in one line each (`OptionError` naming the
    argument): `init(key, data)` that the model fits the data (`check_model_fits`) and that the
    data has labels the task reads (`check_labels`); `round_fn(state, data, key)` and
    `evaluate(state, data, ...)` those labels and that `state` is one this algorithm's `init`
    makes for this data (`InputChecks.state`: not another algorithm's, not made for another
    client count). The checks read shapes and tree structures only, so under `jax.jit` they run
    when the function is traced and cost nothing per round; called eagerly, a call whose
    structure was accepted before is not checked again."""
    s = spec(name)
    resolved = s.resolve(hparams)
    held_out = {"unseen_clients": unseen_clients, "unseen_seed": unseen_seed} if unseen_clients else {}
    if resolved.get("attack_fraction"):
        held_out["attack_seed"] = attack_seed
    algo = s.build(model, {**resolved, **held_out})
    checks = InputChecks(name, algo.init)
    inner_init, inner_round, inner_evaluate = algo.init, algo.round_fn, algo.evaluate

    def init(key: jax.Array, data: FederatedData):
        check_model_fits(model, data)
        check_labels(data, "init")
        state = inner_init(key, data)
        checks.made(state, data)
        return state

    def round_fn(state, data: FederatedData, key: jax.Array):
        checks.inputs(state, data, "round_fn")
        return inner_round(state, data, key)

    def evaluate(state, data: FederatedData, *args, **kwargs):
        checks.inputs(state, data, "evaluate")
        return inner_evaluate(state, data, *args, **kwargs)

    return algo._replace(name=name, hparams=resolved, init=init, round_fn=round_fn,
                         evaluate=evaluate)


# Every state tree structure an `algorithms.get` init has made -> the algorithms that made it, so
# that a state passed to another algorithm's round is named by the algorithm it came from.
_MADE_BY: dict[Any, set[str]] = {}


def _flatten(state: Any) -> tuple[list, Any]:
    """`state`'s leaves and structure, the rows a placement keeps off the devices
    (`core.rows.PlacedRows`, where an [N, ...] leaf stands) taken as leaves."""
    return jax.tree.flatten(state, is_leaf=lambda x: isinstance(x, PlacedRows))


def _shapes(leaves: list) -> tuple:
    """Each leaf's shape; None for placed rows (their shape is the round's, not the state's)."""
    return tuple(None if isinstance(x, PlacedRows) else tuple(getattr(x, "shape", ())) for x in leaves)


def _same_shapes(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is None or y is None or x == y for x, y in zip(a, b))


class InputChecks:
    """The input checks of one algorithm's functions (`get`): the states its `init` made, by
    tree structure, leaf shapes and client count, and the call signatures already accepted."""

    _KEEP = 16                 # states' signatures remembered (a notebook makes a few)

    def __init__(self, name: str, init: Callable[[jax.Array, FederatedData], Any]):
        self.name = name
        self._init = init
        self._made: list[tuple[Any, tuple, int]] = []   # (structure, leaf shapes, clients)
        self._accepted: set = set()

    def made(self, state: Any, data: FederatedData) -> None:
        """Records a state this algorithm's init made for `data`."""
        leaves, treedef = _flatten(state)
        _MADE_BY.setdefault(treedef, set()).add(self.name)
        entry = (treedef, _shapes(leaves), data.num_clients)
        if entry not in self._made:
            self._made = [entry] + self._made[:self._KEEP - 1]

    def _expected(self, data: FederatedData) -> tuple[Any, tuple, int] | None:
        """What init makes for `data`, abstractly (a state from elsewhere, e.g. a checkpoint,
        before any init of this algorithm ran); None where init cannot run on abstract data."""
        try:
            state = jax.eval_shape(self._init, jax.random.key(0), data)
        except Exception:      # noqa: BLE001 (a staged or placed dataset: no reference, no check)
            return None
        leaves, treedef = _flatten(state)
        return treedef, _shapes(leaves), data.num_clients

    def inputs(self, state: Any, data: FederatedData, where: str) -> None:
        """OptionError in one line unless `data` has labels its task reads and `state` is one
        this algorithm's init makes for `data`."""
        if not isinstance(data, FederatedData):
            raise OptionError(f"{where}(state, {arg('data')}, ...): {arg('data')} must be a "
                              f"fedjax_pfl.data.FederatedData, got {type(data).__name__}")
        leaves, treedef = _flatten(state)
        shapes = _shapes(leaves)
        y = data.y
        signature = (treedef, shapes, data.num_clients, data.task,
                     getattr(y, "shape", None), str(getattr(y, "dtype", None)),
                     getattr(data.x, "shape", (None,))[0])
        try:
            if signature in self._accepted:
                return
        except TypeError:      # (an unhashable part: check every time)
            signature = None
        check_labels(data, where)
        self.state(treedef, shapes, type(state), data, where)
        if signature is not None and len(self._accepted) < 256:
            self._accepted.add(signature)

    def state(self, treedef: Any, shapes: tuple, kind: type, data: FederatedData,
              where: str) -> None:
        """OptionError naming the mismatch unless a state of this structure and these leaf
        shapes is what this algorithm's init makes for `data`'s clients. What init made before
        decides where it can; otherwise init is run abstractly on `data` (`jax.eval_shape`),
        and a state it cannot tell wrong is accepted."""
        n = data.num_clients
        same = [(sh, k) for t, sh, k in self._made if t == treedef]
        if any(k == n and _same_shapes(sh, shapes) for sh, k in same):
            return
        reference = self._expected(data)
        if reference is None:
            if not self._made or same:
                return
            reference = self._made[0]
        if reference[0] == treedef and _same_shapes(reference[1], shapes):
            if reference[2] == n:
                self._made = [reference] + self._made[:self._KEEP - 1]
            return
        if reference[0] != treedef:
            others = sorted(_MADE_BY.get(treedef, set()) - {self.name})
            if others:
                raise OptionError(f"{arg('state')}: made by {' or '.join(others)}'s init, not "
                                  f"{self.name}'s: {self.name}.{where} takes the state "
                                  f"{self.name}'s init makes")
            raise OptionError(f"{arg('state')}: a {kind.__name__} of another structure than "
                              f"the state {self.name}'s init makes ({_describe(reference[0])}): "
                              f"{self.name}.{where} takes the state {self.name}'s init makes")
        for sh, k in same:
            if _same_shapes(sh, shapes):
                raise OptionError(f"{arg('state')}: made for {k} clients, this {arg('data')} "
                                  f"has {n}")
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
            treedef.unflatten([0] * treedef.num_leaves))[0]]
        for path, want, got in zip(paths, reference[1], shapes):
            if want is None or got is None or want == got:
                continue
            if want[:1] == (n,) and len(got) == len(want) and got[1:] == want[1:]:
                raise OptionError(f"{arg('state')}: made for {got[0]} clients, this "
                                  f"{arg('data')} has {n}")
            raise OptionError(f"{arg('state')}{path} has shape {list(got)}, {self.name}'s init "
                              f"makes {list(want)} for this {arg('data')} (a state of another "
                              "model or other hyperparameters?)")


def _describe(treedef: Any) -> str:
    """A state's structure in a few words: its class and top-level fields."""
    try:
        node = treedef.unflatten([0] * treedef.num_leaves)
    except Exception:          # noqa: BLE001 (a node type that checks its leaves: say less)
        return "another structure"
    fields = getattr(node, "_fields", None)
    if fields is not None:
        return f"a {type(node).__name__} of {', '.join(fields)}"
    return f"a {type(node).__name__}"


def check_labels(data: FederatedData, where: str = "init") -> None:
    """OptionError naming `data.y` unless the dataset has labels of the shape and dtype its
    task reads: [n] integer class ids for classification (`task` None or "classify"), [n, T]
    or [n, K] integer ids for per-token ("sequence") and multi-label targets (`data.natural`'s
    conventions), n the rows of `data.x`. Shapes and dtypes only: works on abstract arrays.
    Labels that are no array (a placement's blocks of rows) are the placement's to check."""
    y = data.y
    if y is None:
        raise OptionError(f"{where}: {arg('data')}.y is None: the dataset has no labels (the "
                          "algorithms train on one integer class id per sample)")
    shape, dtype = getattr(y, "shape", None), getattr(y, "dtype", None)
    if shape is None or dtype is None:
        return
    kind = data.task.kind if data.task is not None else "classify"
    ndim = 1 if kind == "classify" else 2
    n = getattr(data.x, "shape", (None,))[0]
    want = "[n]" if ndim == 1 else "[n, T]" if kind == "sequence" else "[n, K]"
    if len(shape) != ndim or (n is not None and shape[0] != n):
        raise OptionError(f"{where}: {arg('data')}.y has shape {list(shape)}; {kind} labels are "
                          f"{want} with n = {n}, the rows of {arg('data')}.x")
    if not jnp.issubdtype(dtype, jnp.integer):
        raise OptionError(f"{where}: {arg('data')}.y has dtype {dtype}; labels are integer class "
                          "ids (int32)")


def check_model_fits(model: Model, data: Any) -> None:
    """TypeError / ValueError naming the mismatch unless `data` is a `FederatedData` whose
    samples `model` takes and whose classes its outputs score: a classifier (the default loss,
    softmax cross-entropy, and metric, argmax = label) must give `num_classes` outputs, else
    its loss and accuracy compare output positions with labels of another range. From shapes
    only (`jax.eval_shape`), so it
    costs one trace of the model and works inside a trace."""
    if not isinstance(data, FederatedData):
        raise TypeError(f"init(key, data): data must be a fedjax_pfl.data.FederatedData, got "
                        f"{type(data).__name__}")
    from fedjax_pfl.models.model import softmax_cross_entropy

    if model.metric is not None or model.loss is not softmax_cross_entropy:
        return          # (a model with its own loss or metric reads its outputs its own way)
    params = jax.eval_shape(model.init, jax.random.key(0))
    x = jax.ShapeDtypeStruct((1,) + tuple(data.input_shape),
                             jnp.int32 if data.token_inputs else jnp.float32)
    try:
        out = jax.eval_shape(model.apply, params, x)
    except Exception as e:                    # (any error of the user's model on this input)
        raise ValueError(f"model {model.name!r} does not take this data's inputs of shape "
                         f"{tuple(data.input_shape)}: {type(e).__name__}: "
                         f"{' '.join(str(e).split())[:300]}") from None
    width = out.shape[-1] if out.shape else None
    if width != data.num_classes:
        raise ValueError(f"model {model.name!r} gives {width} outputs per example but the data "
                         f"{data.name or ''} has {data.num_classes} classes: build the model for "
                         f"num_classes={data.num_classes}")
