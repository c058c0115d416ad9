"""FedBABU (Oh, Kim & Yun, "FedBABU: Toward Enhanced Representation for Federated Image
Classification", ICLR 2022, arXiv:2106.06042), Algorithm 1: Federated Averaging with Body
Aggregation and Body Update, then fine-tuning.

The parameters split by path (`models/split.py`) into the body θ_B and the head θ_H (--fedbabu-head,
default the last dense layer). The head stays at its random initialisation θ_H^0 during federated
training; only the body learns and is averaged. Per round t:

    each sampled i ∈ S_t starts from (θ_B^t, θ_H^0) and runs E epochs of local SGD on θ_B only
        (the head gets a zero update, `split.train_only`: θ_H^0 bit for bit)
    θ_B^{t+1} = Σ_{i∈S_t} (n_i / Σ_{k∈S_t} n_k) θ_B,i          (the head is not averaged)

Evaluation ("client"): each client fine-tunes the WHOLE global model (θ_B^t, θ_H^0) for τ_f =
--fedbabu-finetune-epochs epochs on its own training data (fresh optimizer state, the client
optimizer with learning rate --fedbabu-finetune-lr) and is evaluated on its test split; "global"
is the global model (θ_B^t, θ_H^0) itself, which classifies with the random head.

Communication per round: the body, down to and up from each sampled client (the head never
changes, so nobody needs to send it after the common initialisation).

Readings:
  * τ_f default 1: the PGFed paper's Appendix E and its reference code (`-fts 1`) fine-tune for one
    epoch; the FedBABU paper also studies longer fine-tuning (raise the flag for that).
  * Fine-tuning learning rate: the PGFed paper tunes it on the same grid as --lr; its code's
    example fine-tunes at 0.001 with FL lr 0.005. Default (unset): --lr / 5, that example's
    ratio (0.001 exactly under --preset pgfed_paper). On the embedded digits (defaults, lr 0.05)
    fine-tuning at --lr itself makes the clients worse than the global model (last-round mean
    0.83 vs 0.87), at --lr / 5 better (0.90).
  * Fine-tuning momentum: the client optimizer (--momentum) with a fresh buffer, as the reference
    code's fresh SGD(momentum 0.9) per fine-tuning; the FL phase uses --momentum-buffer like
    every algorithm (the reference code resets its buffer every round, our default).
  * The statistic: the PGFed paper reports FedBABU after its final fine-tuning; evaluating at
    every round fine-tunes the current global model each time (FedAvg-FT does the same).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_pfl.algorithms.engine import Engine, EngineConfig
from fedjax_pfl.algorithms.interface import Algorithm
from fedjax_pfl.algorithms.registry import AT_LEAST_ONE, POSITIVE, AlgorithmSpec, Check, HParam, register
from fedjax_pfl.core.local import LocalTrainer
from fedjax_pfl.models import split as split_lib
from fedjax_pfl.models.model import Model

Params = Any


class State(NamedTuple):
    params: Params     # global model (θ_B, θ_H^0); θ_H^0 never changes              leaves [...]
    opt_state: Any     # per-client optimizer states [N, ...] (momentum_buffer=persist), else None
    server: Any        # the server chain's state (Engine.init_server)
    round: jax.Array   # rounds completed; shape=(), int32
    rng: jax.Array     # base key of the fine-tuning batch order at evaluation
    CLIENT_FIELDS = ("opt_state",)  # per-client rows [N, ...]


def fedbabu(model: Model, config: EngineConfig, *, head: str, finetune_epochs: int,
            finetune_lr: float | None) -> Algorithm:
    """FedBABU; see the module docstring."""
    template = jax.eval_shape(model.init, jax.random.key(0))
    mask = split_lib.personal_mask(template, head)                     # fails early on a bad regex
    sgd = lambda lr: optax.sgd(lr, momentum=config.momentum or None)
    engine = Engine(model, config, optimizer=split_lib.train_only(
        sgd(config.lr), split_lib.complement(mask)))                   # the body only
    body_size = split_lib.count(split_lib.split(template, mask)[0])
    finetune_lr = config.lr / 5 if finetune_lr is None else finetune_lr
    fine_tuner = LocalTrainer(model, sgd(finetune_lr), epochs=finetune_epochs,
                              batch_size=config.batch_size, mapper=engine.evaluator.mapper,
                              drop_last=config.drop_last)               # the whole model

    def init(key: jax.Array, data) -> State:
        params = model.init(key)                   # the same initial model as every algorithm
        return State(params, engine.init_opt_rows(params, data.num_clients),
                     engine.init_server(split_lib.split(params, mask)[0], data),
                     jnp.zeros((), jnp.int32), jax.random.fold_in(key, 1))

    def round_fn(state: State, data, key: jax.Array) -> tuple[State, dict]:
        rnd = engine.begin(data, key)                                              # S_t
        trained = engine.train(rnd, state.params, opt_rows=state.opt_state, shared_start=True)
        bodies, _ = split_lib.split(trained.params, mask)
        body, server, agg = engine.aggregate(rnd, split_lib.split(state.params, mask)[0], bodies,
                                             rnd.train_counts, state.server)      # θ_B average
        params = split_lib.merge(body, split_lib.split(state.params, mask)[1], mask)  # θ_H^0 kept
        new_state = State(params, trained.opt_rows, server, state.round + 1, state.rng)
        metrics = engine.metrics(rnd, trained, up=body_size, down=body_size, server=agg)
        return new_state, metrics

    evaluate, _ = engine.evaluation(shared=lambda state: state.params, fine_tuner=fine_tuner)
    return engine.algorithm("fedbabu", init, round_fn, evaluate, host_state=True)


register(AlgorithmSpec(
    name="fedbabu",
    factory=fedbabu,
    summary="FedBABU: FedAvg on the body with the head frozen at its initialisation; each client "
            "fine-tunes the whole model before evaluation",
    hparams=(
        HParam("head", str, "head",
                    "the head, frozen at its initialisation during federated training: 'head' "
                    "(the last dense layer) or a regex searched in each leaf path such as "
                    "'Dense_1/'",
                    check=Check(split_lib.is_pattern, "'head', 'all', 'none' or a regex")),
        HParam("finetune_epochs", int, 1,
                    "τ_f: epochs of fine-tuning the whole global model on each client before "
                    "evaluation (the PGFed code's -fts)",
                    check=AT_LEAST_ONE),
        HParam("finetune_lr", float, None,
                    "learning rate of the fine-tuning (default: --lr / 5, the PGFed code example's "
                    "0.001 at lr 0.005)", check=POSITIVE),
    ),
    traceable=("lr",),
    # The tests' linear model {w, b}: its bias as the head, so both parts are non-empty.
    test_hparams={"head": "^b$", "momentum": 0.9, "momentum_buffer": "persist"},
    private_uplink="each client's update of the body; the frozen head is never sent",
))
