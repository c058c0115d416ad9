"""Algorithms: `get(name, model=..., **hparams)` returns an `Algorithm(init, round_fn, evaluate)`.

Every module of this package registers its algorithms with `base.register` when imported; all
modules are imported here, so adding an algorithm is adding one module.
"""

import importlib as _importlib
import pkgutil as _pkgutil

from fedjax_pfl.algorithms.base import (
    COMMON_HPARAMS,
    Algorithm,
    AlgorithmSpec,
    EngineConfig,
    HParam,
    get,
    names,
    spec,
)

for _module in sorted(m.name for m in _pkgutil.iter_modules(__path__)):
    if _module != "base":
        _importlib.import_module(f"{__name__}.{_module}")

__all__ = ["COMMON_HPARAMS", "Algorithm", "AlgorithmSpec", "EngineConfig", "HParam", "get", "names",
           "spec"]
