"""FedRep (Collins, Hassani, Mokhtari & Shakkottai, "Exploiting Shared Representations for
Personalized Federated Learning", ICML 2021, arXiv:2102.07078), Algorithm 1.

The parameters split by path (`models/split.py`) into the representation (body) φ, shared by all,
and the head h_i of client i (--fedrep-head, default the last dense layer). Per round t, each
sampled client i ∈ S_t, from (φ^t, h_i):

    head phase, τ_h = --fedrep-head-epochs epochs:    h_i ← GRD(f_i(φ^t, h_i), h_i, η)   φ frozen
    body phase, the other E − τ_h epochs:             φ_i ← GRD(f_i(φ, h_i), φ, η)      h_i frozen
    server:  φ^{t+1} = Σ_{i∈S_t} (n_i / Σ_{k∈S_t} n_k) φ_i   (the paper writes a uniform mean;
             FedAvg's sample weights, as FedPer here and the PGFed reference code)

GRD is a minibatch SGD step (the client optimizer, --lr, --momentum). A frozen part gets a zero
update (`split.train_only`), so it stays bit for bit what it was; the body phase trains on the
head the head phase just produced. Unsampled clients keep their heads; every head starts from
the common initialisation. Communication per round: the body, down to and up from each sampled
client. Evaluated: each client's (φ, h_i).

Readings:
  * Epoch budget: E = --local-epochs in total, the first τ_h for the head and the remaining
    E − τ_h for the body, as the FedRep authors' code (`local_ep` in total, `local_rep_ep` of
    them for the body; the paper's experiments: 10 head epochs, 1 body epoch). The PGFed
    reference code instead runs τ_h (`-pls`) head epochs AND then E body epochs; to reproduce
    it, raise --local-epochs by τ_h. τ_h = 0 trains only the body (FedPer with the head frozen
    at its initialisation, i.e. FedBABU's federated phase); τ_h ≥ E is an error (no body epoch
    would be left: nothing would be federated), so E = 1 needs τ_h = 0 or --local-epochs 2.
  * Default τ_h = 1 (the PGFed reference code's example `-pls 1`) with E = 2 by default (one head
    epoch, one body epoch; on the embedded digits this reaches ≈ 0.9). Under
    --preset pgfed_paper (E = 5) it is 1 head and 4 body epochs.
  * Optimizer state: one per phase (the reference code's two torch optimizers); with
    --momentum-buffer persist each client keeps both buffers across rounds, otherwise they
    start at zero in every phase. The reference FedRep runs plain SGD (no buffer).
  * --local-steps is not supported: the phases are counted in epochs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_pfl import core
from fedjax_pfl.algorithms.engine import Engine, EngineConfig, Trained
from fedjax_pfl.algorithms.interface import Algorithm, evaluated_ids
from fedjax_pfl.algorithms.registry import NON_NEGATIVE, AlgorithmSpec, Check, HParam, register
from fedjax_pfl.core.local import LocalTrainer
from fedjax_pfl.models import split as split_lib
from fedjax_pfl.models.model import Model

Params = Any


class State(NamedTuple):
    body: Params       # representation φ (None on head leaves)                  leaves [...]
    heads: Params      # heads h_i (None on body leaves)                          leaves [N, ...]
    opt_head: Any      # per-client head-phase optimizer states [N, ...] (persist), else None
    opt_body: Any      # per-client body-phase optimizer states [N, ...] (persist), else None
    server: Any        # the server chain's state (Engine.init_server)
    round: jax.Array   # rounds completed; shape=(), int32
    CLIENT_FIELDS = ("heads", "opt_head", "opt_body")  # per-client rows [N, ...]


def fedrep(model: Model, config: EngineConfig, *, head: str, head_epochs: int
           ) -> Algorithm:
    """FedRep; see the module docstring."""
    if config.local_steps is not None:
        raise ValueError("fedrep counts its head and body phases in epochs: use --local-epochs "
                         "and --fedrep-head-epochs, not --local-steps")
    epochs = config.local_epochs
    if head_epochs >= epochs:
        raise ValueError(f"--fedrep-head-epochs must be < --local-epochs ({epochs}): the head "
                         f"epochs are part of the local epochs and the body needs at least one, "
                         f"got {head_epochs}")
    engine = Engine(model, config)
    template = jax.eval_shape(model.init, jax.random.key(0))
    mask = split_lib.personal_mask(template, head)                     # fails early on a bad regex
    body_size = split_lib.count(split_lib.split(template, mask)[0])
    tx = optax.sgd(config.lr, momentum=config.momentum or None)

    def phase(trainable, phase_epochs):
        if phase_epochs == 0:
            return None
        return LocalTrainer(model, split_lib.train_only(tx, trainable), epochs=phase_epochs,
                            batch_size=config.batch_size, mapper=engine.mapper,
                            drop_last=config.drop_last)

    head_phase = phase(mask, head_epochs)                              # h_i trains, φ frozen
    body_phase = phase(split_lib.complement(mask), epochs - head_epochs)  # φ trains, h_i frozen
    persist = engine.persist_opt_state

    def fresh_opt(trainer, params, n):
        return None if trainer is None else core.broadcast(trainer.init_opt_state(params), n)

    def init(key: jax.Array, data) -> State:
        params = model.init(key)                   # the same initial model as every algorithm
        body, head0 = split_lib.split(params, mask)
        n = data.num_clients
        return State(body, core.broadcast(head0, n),
                     fresh_opt(head_phase, params, n) if persist else None,
                     fresh_opt(body_phase, params, n) if persist else None,
                     engine.init_server(body, data), jnp.zeros((), jnp.int32))

    def run_phase(rnd, trainer, stored, params, key):
        """One phase for the sampled clients: (their params after it, the stored optimizer
        rows, its result)."""
        if trainer is None:
            return params, stored, None
        result = engine.train(rnd, params, opt_rows=stored, key=key, trainer=trainer)
        return result.params, result.opt_rows, result

    def round_fn(state: State, data, key: jax.Array) -> tuple[State, dict]:
        rnd = engine.begin(data, key)                      # FedAvg's keys: τ_h = 0 is FedAvg
        body_key = rnd.keys["train"]
        head_key = jax.random.fold_in(body_key, 1)         # on the body, batch order included
        idx = rnd.idx                                                              # S_t
        params = split_lib.merge(core.broadcast(state.body, rnd.m), core.gather(state.heads, idx),
                                 mask)
        params, opt_head, head_result = run_phase(rnd, head_phase, state.opt_head, params,
                                                  head_key)                        # h_i, φ frozen
        params, opt_body, body_result = run_phase(rnd, body_phase, state.opt_body, params,
                                                  body_key)                        # φ_i, h_i frozen
        bodies, heads = split_lib.split(params, mask)
        body, server, agg = (engine.aggregate(rnd, state.body, bodies, rnd.train_counts,
                                              state.server)
                             if body_result is not None else (state.body, state.server, {}))
        new_state = State(body, core.scatter(state.heads, idx, heads), opt_head, opt_body,
                          server, state.round + 1)
        results = [r for r in (head_result, body_result) if r is not None]
        steps = sum(r.num_steps for r in results)
        # The mean minibatch loss over both phases, each phase's mean weighted by its steps.
        loss = (sum(r.loss * r.num_steps for r in results)
                / jnp.maximum(steps, 1).astype(results[0].loss.dtype))
        both = Trained(params, None, None, loss, steps)
        metrics = engine.metrics(rnd, both, up=body_size, down=body_size, server=agg)
        return new_state, metrics

    def evaluate(state: State, data, ids=None) -> dict[str, core.ClientEval]:
        ids = evaluated_ids(data, ids)
        params = split_lib.merge(core.broadcast(state.body, ids.shape[0]),
                                 core.gather(state.heads, ids), mask)
        return {"client": engine.evaluator.rows(data, params, ids)}

    return engine.algorithm("fedrep", init, round_fn, evaluate, host_state=True)


register(AlgorithmSpec(
    name="fedrep",
    factory=fedrep,
    summary="FedRep: each client trains its own head (body frozen), then the shared body (head "
            "frozen); FedAvg on the body",
    hparams=(
        HParam("head", str, "head",
                    "the personal head kept on each client: 'head' (the last dense layer) or a "
                    "regex searched in each leaf path such as 'Dense_1/'",
                    check=Check(split_lib.is_pattern, "'head', 'all', 'none' or a regex")),
        HParam("head_epochs", int, 1,
                    "τ_h: of the --local-epochs E, the first τ_h train the head with the body "
                    "frozen and the other E − τ_h the body with the head frozen (0: body only; "
                    "must be < E)",
                    check=NON_NEGATIVE),
    ),
    defaults={"local_epochs": 2},
    # The tests' linear model {w, b}: its bias as the head, so both parts are non-empty.
    test_hparams={"head": "^b$", "momentum": 0.9, "momentum_buffer": "persist"},
    private_uplink="each client's update of the body; its head stays on the client",
))
