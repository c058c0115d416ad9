"""Algorithms: `get(name, model=..., **hparams)` returns an `Algorithm(init, round_fn, evaluate)`.

Every algorithm module of this package registers its algorithms with `registry.register` when
imported; all modules are imported here, so adding an algorithm is adding one module. The
package's other modules: `interface` (what an algorithm is), `registry` (hyperparameters and the
registry), `engine` (what algorithms are assembled from) and private helpers (`_*.py`).
"""

import importlib as _importlib
import pkgutil as _pkgutil

from fedjax_pfl.algorithms.engine import EngineConfig
from fedjax_pfl.algorithms.interface import Algorithm
from fedjax_pfl.algorithms.registry import COMMON_HPARAMS, AlgorithmSpec, HParam, check_labels, get, names, spec

for _module in sorted(m.name for m in _pkgutil.iter_modules(__path__)):
    _importlib.import_module(f"{__name__}.{_module}")

__all__ = ["COMMON_HPARAMS", "Algorithm", "AlgorithmSpec", "EngineConfig", "HParam", "check_labels", "get", "names",
           "spec"]
