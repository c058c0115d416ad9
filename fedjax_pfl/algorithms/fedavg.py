"""FedAvg and FedAvg-FT (McMahan et al., AISTATS 2017, Algorithm 1).

Each round the sampled clients S_t start from the global model θ, run E epochs of local SGD, and
the server takes the sample-weighted mean of their models:

    θ ← Σ_{i∈S_t} (n_i / Σ_{k∈S_t} n_k) θ_i        (n_i: client i's number of TRAINING samples)

FedAvg evaluates the global model on every client's test split. FedAvg-FT evaluates, for each
client, the global model after `ft_epochs` local epochs of fine-tuning on that client's training
data (fresh optimizer state, the same learning rate): the usual personalised baseline.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_pfl import ops
from fedjax_pfl.algorithms._global_model import GlobalModelState
from fedjax_pfl.algorithms.engine import Engine, EngineConfig
from fedjax_pfl.algorithms.interface import Algorithm
from fedjax_pfl.algorithms.registry import AT_LEAST_ONE, AlgorithmSpec, HParam, register
from fedjax_pfl.core.local import LocalTrainer
from fedjax_pfl.models.model import Model

State = GlobalModelState     # the global model θ, per-client optimizer states, round, rng


def fedavg(model: Model, config: EngineConfig, *, ft_epochs: int | None = None
           ) -> Algorithm:
    """FedAvg; with `ft_epochs` set, FedAvg-FT (the global model fine-tuned before evaluation)."""
    engine = Engine(model, config)
    fine_tuner = None
    if ft_epochs is not None:
        fine_tuner = LocalTrainer(
            model, engine.trainer.optimizer, epochs=ft_epochs, batch_size=config.batch_size,
            mapper=engine.evaluator.mapper, drop_last=config.drop_last,
        )  # fine-tuning is always whole epochs (--ft-epochs), whatever --local-steps says

    def init(key: jax.Array, data) -> State:
        params = model.init(key)  # the same initial model as every other algorithm from this key
        rng = jax.random.fold_in(key, 1)
        return State(params, engine.init_opt_rows(params, data.num_clients),
                     engine.init_server(params, data), jnp.zeros((), jnp.int32), rng)

    def round_fn(state: State, data, key: jax.Array) -> tuple[State, dict]:
        rnd = engine.begin(data, key)                                            # S_t
        trained = engine.train(rnd, state.params, opt_rows=state.opt_state,      # θ_i ← θ, then
                               shared_start=True)                                # E local epochs
        params, server, agg = engine.aggregate(rnd, state.params, trained.params,  # Σ (n_i/n) θ_i
                                               rnd.train_counts, state.server)   # (or DP-FedAvg)
        d = ops.tree_size(params)
        metrics = engine.metrics(rnd, trained, up=d, down=d, server=agg)
        return State(params, trained.opt_rows, server, state.round + 1, state.rng), metrics

    evaluate, _ = engine.evaluation(shared=lambda state: state.params, fine_tuner=fine_tuner)
    return engine.algorithm("fedavg", init, round_fn, evaluate, host_state=True)


def fedavg_ft(model: Model, config: EngineConfig, *, ft_epochs: int) -> Algorithm:
    return fedavg(model, config, ft_epochs=ft_epochs)


register(AlgorithmSpec(
    name="fedavg",
    factory=fedavg,
    summary="FedAvg: sample-weighted average of local models; the global model is evaluated",
    test_hparams={"momentum": 0.9, "momentum_buffer": "persist"},
    private_uplink="each client's model update θ_i − θ (the whole model); its optimizer state "
                   "stays on the client",
))

register(AlgorithmSpec(
    name="fedavg_ft",
    factory=fedavg_ft,
    summary="FedAvg-FT: FedAvg whose global model each client fine-tunes before evaluation",
    hparams=(
        HParam("ft_epochs", int, 1,
                    "local epochs of fine-tuning the global model on each client before evaluation",
                    check=AT_LEAST_ONE, flag="--ft-epochs"),
    ),
    test_hparams={"ft_epochs": 1},
    private_uplink="each client's model update θ_i − θ (the whole model); fine-tuning for "
                   "evaluation stays on the client",
))
