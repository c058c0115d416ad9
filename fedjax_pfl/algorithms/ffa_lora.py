"""FFA-LoRA (Sun, Li, Ding & Wang, "Improving LoRA in Privacy-preserving Federated Learning",
ICLR 2024): LoRA with A frozen at its random initialisation, only B trained and aggregated.

With adapters (`models.lora`: y = x W + b + (α/r) x Aᵀ Bᵀ) every client shares one A, drawn
once and never changed, so the server's mean of the clients' B_i is the exact mean of their
low-rank updates, (α/r) (mean_i B_i) A, which FedAvg on both factors is not (mean of products ≠
product of means); the paper (§4) also finds it more stable under DP noise. Per round:

    each sampled i ∈ S_t starts from (A_0, B) and runs E epochs of local SGD on B alone
    B ← Σ_{i∈S_t} (n_i / Σ_k n_k) B_i              FedAvg's sample weights (or the server chain)
    A stays A_0, bit for bit (its update is zero: `models.split.train_only`)

Communication: B only (A_0 follows from the shared seed), down and up. Evaluated: the global
adapters (A_0, B). Frozen leaves: --ffa-lora-frozen, a regex on the parameter paths (default
the adapters' A, "lora_A"); on a model without adapters any part can be frozen so.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax

from fedjax_pfl.algorithms._global_model import GlobalModelState
from fedjax_pfl.algorithms.engine import Engine, EngineConfig
from fedjax_pfl.algorithms.interface import Algorithm
from fedjax_pfl.algorithms.registry import AlgorithmSpec, Check, HParam, register
from fedjax_pfl.errors import OptionError, arg
from fedjax_pfl.models import split as split_lib
from fedjax_pfl.models.model import Model

State = GlobalModelState     # the global adapters (A_0, B), optimizer rows, server, round, rng
FROZEN_A = r"(^|/)lora_A$"


def ffa_lora(model: Model, config: EngineConfig, *, frozen: str) -> Algorithm:
    """FFA-LoRA; see the module docstring."""
    template = jax.eval_shape(model.init, jax.random.key(0))
    if frozen == FROZEN_A and not any(map(re.compile(FROZEN_A).search,
                                          split_lib.leaf_paths(template))):
        raise OptionError(f"ffa_lora freezes LoRA's A matrices but model {model.name!r} has no "
                          f"adapters: build it with models.lora ({arg('peft')} lora), or name "
                          f"the parameters to freeze with {arg('frozen', 'hparams')}")
    fixed = split_lib.personal_mask(template, frozen)                  # True: A (never trained)
    if all(jax.tree.leaves(fixed)):
        raise ValueError(f"--ffa-lora-frozen {frozen!r} freezes every parameter: nothing trains")
    trained_part = split_lib.complement(fixed)
    client_tx = split_lib.train_only(
        optax.sgd(config.lr, momentum=config.momentum or None), trained_part)
    engine = Engine(model, config, optimizer=client_tx)
    size = split_lib.count(split_lib.split(template, fixed)[0])        # |B|: what is sent

    def init(key: jax.Array, data) -> State:
        params = model.init(key)                   # A_0 drawn here, once, for every client
        b = split_lib.split(params, fixed)[0]
        return State(params, engine.init_opt_rows(params, data.num_clients),
                     engine.init_server(b, data), jnp.zeros((), jnp.int32),
                     jax.random.fold_in(key, 1))

    def round_fn(state: State, data, key: jax.Array) -> tuple[State, dict]:
        rnd = engine.begin(data, key)                                            # S_t
        trained = engine.train(rnd, state.params, opt_rows=state.opt_state,      # B_i, A_0 fixed
                               shared_start=True)
        b, a = split_lib.split(state.params, fixed)
        uploads = split_lib.split(trained.params, fixed)[0]                      # the B_i only
        b, server, agg = engine.aggregate(rnd, b, uploads, rnd.train_counts,     # Σ (n_i/n) B_i
                                          state.server)
        params = split_lib.merge(b, a, fixed)                                    # A_0 unchanged
        metrics = engine.metrics(rnd, trained, up=size, down=size, server=agg)
        return State(params, trained.opt_rows, server, state.round + 1, state.rng), metrics

    evaluate, _ = engine.evaluation(shared=lambda state: state.params)
    return engine.algorithm("ffa_lora", init, round_fn, evaluate, host_state=True)


register(AlgorithmSpec(
    name="ffa_lora",
    factory=ffa_lora,
    summary="FFA-LoRA: LoRA's A frozen at its initialisation, only B trained and averaged",
    hparams=(
        HParam("frozen", str, FROZEN_A,
               "the parameters frozen at their initialisation (a regex searched in each leaf "
               "path; default the adapters' A matrices)",
               check=Check(split_lib.is_pattern, "a regex")),
    ),
    test_hparams={"frozen": "^b$"},
    private_uplink="each client's update of B (A is fixed and never sent)",
))
