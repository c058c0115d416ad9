"""FedProx and FedProx-FT (Li, Sahu, Zaheer, Sanjabi, Talwalkar & Smith, "Federated
Optimization in Heterogeneous Networks", MLSys 2020, arXiv:1812.06127, Algorithm 2).

Each round the sampled clients S_t start from the global model w^t and approximately minimise
the proximal local objective (Algorithm 2 line 5, eq. 2)

    h_k(w; w^t) = F_k(w) + (μ/2)‖w − w^t‖²

by E epochs of minibatch SGD, i.e. every step uses the gradient ∇F_k(w; B) + μ(w − w^t)
(`_prox.add_proximal_term` chained before sgd(lr, momentum)); the server then takes FedAvg's
sample-weighted mean w^{t+1} = Σ_{k∈S_t} (n_k / Σ_{j∈S_t} n_j) w_k.

Readings:
  * "γ-inexact solution" is read as FedAvg's fixed local work (E epochs, or --local-steps K), as
    in the paper's experiments; no per-client variable work (the paper's straggler simulation).
  * Aggregation is FedAvg's sample-weighted mean (Algorithm 2 writes a plain mean over the
    selected devices, sampled with probability p_k; the authors' code weights by samples).
  * μ = 0 is FedAvg bit for bit (same sampling, keys and batch order; tests check this).
FedProx evaluates the global model. FedProx-FT evaluates, for each client, the global model
after --ft-epochs local epochs of plain SGD on the client's training data (fresh optimizer, no
proximal term: the fine-tuning of fedavg_ft), so fedprox_ft with μ = 0 is fedavg_ft.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_pfl import core, ops
from fedjax_pfl.algorithms import _prox
from fedjax_pfl.algorithms._global_model import GlobalModelState
from fedjax_pfl.algorithms.engine import Engine, EngineConfig
from fedjax_pfl.algorithms.interface import Algorithm
from fedjax_pfl.algorithms.registry import AT_LEAST_ONE, NON_NEGATIVE, AlgorithmSpec, HParam, register
from fedjax_pfl.core.local import LocalTrainer
from fedjax_pfl.models.model import Model

State = GlobalModelState     # FedAvg's: the global model, optimizer rows, round, rng


def fedprox(model: Model, config: EngineConfig, *, mu: float, ft_epochs: int | None = None
            ) -> Algorithm:
    """FedProx; with `ft_epochs` set, FedProx-FT. State is FedAvg's (`GlobalModelState`)."""
    engine = Engine(model, config, client_transform=_prox.add_proximal_term(mu))
    fine_tuner = None
    if ft_epochs is not None:
        fine_tuner = LocalTrainer(
            model, _prox.local_sgd(config.lr, config.momentum), epochs=ft_epochs,
            batch_size=config.batch_size, mapper=engine.evaluator.mapper,
            drop_last=config.drop_last,
        )

    def init(key: jax.Array, data) -> State:
        params = model.init(key)
        return State(params, engine.init_opt_rows(params, data.num_clients),
                     engine.init_server(params, data), jnp.zeros((), jnp.int32),
                     jax.random.fold_in(key, 1))

    def round_fn(state: State, data, key: jax.Array) -> tuple[State, dict]:
        rnd = engine.begin(data, key)                                            # S_t
        trained = engine.train(rnd, state.params, opt_rows=state.opt_state, shared_start=True,
                               extra={"anchor": core.broadcast(state.params, rnd.m)})  # min h_k(w; w^t)
        params, server, agg = engine.aggregate(rnd, state.params, trained.params,  # Σ (n_k/n) w_k
                                               rnd.train_counts, state.server)
        d = ops.tree_size(params)
        metrics = engine.metrics(rnd, trained, up=d, down=d, server=agg)
        return State(params, trained.opt_rows, server, state.round + 1, state.rng), metrics

    evaluate, _ = engine.evaluation(shared=lambda state: state.params, fine_tuner=fine_tuner)
    return engine.algorithm("fedprox", init, round_fn, evaluate, host_state=True)


def fedprox_ft(model: Model, config: EngineConfig, *, mu: float, ft_epochs: int
               ) -> Algorithm:
    return fedprox(model, config, mu=mu, ft_epochs=ft_epochs)


_MU = HParam(
    "mu", float, 0.01,
    "μ, weight of the proximal term (μ/2)‖w − w_global‖² in each client's local objective; "
    "0 is FedAvg. Default 0.01: the value of the paper's grid {0.001, 0.01, 0.1, 0.5, 1} that "
    "trains best at the default lr 0.05 on digits", check=NON_NEGATIVE)

register(AlgorithmSpec(
    name="fedprox", factory=fedprox,
    summary="FedProx: FedAvg whose local objective adds (μ/2)‖w − w_global‖²; global model evaluated",
    hparams=(_MU,), traceable=("lr", "mu"),
    test_hparams={"momentum": 0.9, "momentum_buffer": "persist"},
    private_uplink="each client's model update (the whole model)",
))

register(AlgorithmSpec(
    name="fedprox_ft", factory=fedprox_ft,
    summary="FedProx-FT: FedProx whose global model each client fine-tunes before evaluation",
    hparams=(_MU, HParam("ft_epochs", int, 1,
                              "local epochs of fine-tuning the global model on each client before "
                              "evaluation", check=AT_LEAST_ONE, flag="--ft-epochs")),
    flag_prefix="fedprox", traceable=("lr", "mu"),
    test_hparams={"momentum": 0.9, "momentum_buffer": "persist"},
    private_uplink="each client's model update (the whole model)",
))
