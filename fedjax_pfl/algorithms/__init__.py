"""Algorithms: `get(name, model=..., **hparams)` returns an `Algorithm(init, round_fn, evaluate)`."""

from fedjax_pfl.algorithms import fedavg as _fedavg  # noqa: F401  (registers fedavg, fedavg_ft)
from fedjax_pfl.algorithms import local as _local  # noqa: F401  (registers local)
from fedjax_pfl.algorithms import pfedsop as _pfedsop  # noqa: F401  (registers pfedsop)
from fedjax_pfl.algorithms import pgfed as _pgfed  # noqa: F401  (pgfed, pgfedmo, pgfed_ce)
from fedjax_pfl.algorithms.base import (
    COMMON_HPARAMS,
    Algorithm,
    AlgorithmSpec,
    HParam,
    get,
    names,
    spec,
)

__all__ = ["COMMON_HPARAMS", "Algorithm", "AlgorithmSpec", "HParam", "get", "names", "spec"]
