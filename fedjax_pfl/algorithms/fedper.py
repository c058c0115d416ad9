"""FedPer (Arivazhagan, Aggarwal, Singh & Choudhary, arXiv:1912.00818, 2019): federated base
layers, personalisation layers kept on each client.

The parameters split by path (`models/split.py`) into the base (body) θ_B, shared by all, and the
personalisation layers (head) h_i of client i (--fedper-head, default the last dense layer).
Per round, as FedAvg (McMahan et al. 2017, Algorithm 1) on the whole model:

    each sampled i ∈ S_t starts from (θ_B, h_i) and runs E epochs of local SGD on all its parameters
    θ_B ← Σ_{i∈S_t} (n_i / Σ_{k∈S_t} n_k) θ_B,i        the body only, FedAvg's sample weights
    h_i ← the head client i trained; unsampled clients keep theirs

Communication per round: the body, d1 floats, down to and up from each sampled client.

Every head starts from the common initialisation. Evaluated: each client's (θ_B, h_i).
Limits: --fedper-head none (no personal layers) is FedAvg, bit for bit (the clients then start
from one shared model, as FedAvg's do); --fedper-head all (no shared layers) is Local.
"""

from __future__ import annotations

import jax

from fedjax_pfl.algorithms._split_fedavg import SplitModelState, split_fedavg
from fedjax_pfl.algorithms.engine import EngineConfig
from fedjax_pfl.algorithms.interface import Algorithm
from fedjax_pfl.algorithms.registry import AlgorithmSpec, Check, HParam, register
from fedjax_pfl.models import split as split_lib
from fedjax_pfl.models.model import Model

# body: the base layers θ_B; heads: the personalisation layers h_i, [N, ...]
State = SplitModelState


def fedper(model: Model, config: EngineConfig, *, head: str) -> Algorithm:
    """FedPer; see the module docstring. FedAvg on the body, each client keeps its head
    (`split_fedavg`)."""
    template = jax.eval_shape(model.init, jax.random.key(0))
    mask = split_lib.personal_mask(template, head)                     # fails early on a bad regex
    return split_fedavg("fedper", model, config, mask)


register(AlgorithmSpec(
    name="fedper",
    factory=fedper,
    summary="FedPer: FedAvg on the base layers, each client keeps its own head",
    hparams=(
        HParam("head", str, "head",
                    "the personalisation layers kept on each client: 'head' (the last dense "
                    "layer), 'all' (= local), 'none' (= fedavg) or a regex searched in each leaf "
                    "path such as 'Dense_1/'",
                    check=Check(split_lib.is_pattern, "'head', 'all', 'none' or a regex")),
    ),
    test_hparams={},
    private_uplink="each client's update of the base layers; its head stays on the client",
))
