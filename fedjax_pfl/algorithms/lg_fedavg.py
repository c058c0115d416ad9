"""LG-FedAvg (Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov & Morency, "Think Locally,
Act Globally: Federated Learning with Local and Global Representations", arXiv:2001.01523, 2020):
local representations, a global head.

FedPer's split the other way round (`split_fedavg`): the parameters split by path
(`models/split.py`) into the global layers θ_G (--lg-fedavg-head, default the last dense layer,
as the PGFed reference code's `LocalModel(base, predictor)` aggregates only `predictor`), shared
by all, and the local layers ℓ_i of client i (everything else: the representation). Per round:

    each sampled i ∈ S_t starts from (ℓ_i, θ_G) and runs E epochs of local SGD on all its
    parameters (the paper's joint update of the local and global parts, its Algorithm 1)
    θ_G ← Σ_{i∈S_t} (n_i / Σ_{k∈S_t} n_k) θ_G,i       the global layers only, FedAvg's weights
    ℓ_i ← the representation client i trained; unsampled clients keep theirs

Communication per round: the global layers, |θ_G| floats, down to and up from each sampled client.
Evaluated: each client's (ℓ_i, θ_G).

Readings where the sources differ:
  * Local update: the paper trains the local and global parts jointly (one gradient step on
    both per minibatch); the PGFed reference code alternates, per minibatch, a step on the body
    with the head frozen and a step on the head. We implement the paper's joint step.
  * Initialisation: the paper starts the global layers from a FedAvg-pretrained model; here,
    as for every algorithm in this package, all clients start from the common θ0.
  * The optimizer is the common client optimizer (--momentum, --momentum-buffer); the reference
    code resets its momentum buffer every round (--momentum-buffer reset, the default).
Limits: --lg-fedavg-head all (everything global, nothing local) is FedAvg bit for bit;
--lg-fedavg-head none (nothing global) is Local. --lg-fedavg-head R equals --algo fedper with
--fedper-head the complement of R (the same split), bit for bit.
"""

from __future__ import annotations

import jax

from fedjax_pfl.algorithms._split_fedavg import split_fedavg
from fedjax_pfl.algorithms.engine import EngineConfig
from fedjax_pfl.algorithms.interface import Algorithm
from fedjax_pfl.algorithms.registry import AlgorithmSpec, Check, HParam, register
from fedjax_pfl.models import split as split_lib
from fedjax_pfl.models.model import Model


def lg_fedavg(model: Model, config: EngineConfig, *, head: str) -> Algorithm:
    """LG-FedAvg; see the module docstring. `head` selects the GLOBAL layers; each client keeps
    the rest (`split_fedavg` with FedPer's mask complemented)."""
    template = jax.eval_shape(model.init, jax.random.key(0))
    global_mask = split_lib.personal_mask(template, head)             # fails early on a bad regex
    return split_fedavg("lg_fedavg", model, config, split_lib.complement(global_mask))


register(AlgorithmSpec(
    name="lg_fedavg",
    factory=lg_fedavg,
    summary="LG-FedAvg: each client keeps its own representation (body), FedAvg on the head",
    flag_prefix="lg-fedavg",
    hparams=(
        HParam("head", str, "head",
                    "the GLOBAL layers, averaged by the server; every other layer is local to "
                    "each client: 'head' (the last dense layer), 'all' (= fedavg), 'none' "
                    "(= local) or a regex searched in each leaf path such as 'Dense_1/'",
                    check=Check(split_lib.is_pattern, "'head', 'all', 'none' or a regex")),
    ),
    # The tests' linear model {w, b}: its bias as the head, so both parts are non-empty.
    test_hparams={"head": "^b$"},
    private_uplink="each client's update of the global head; its representation layers "
                   "stay on the client",
))
