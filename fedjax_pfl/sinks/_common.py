"""What the sinks share: the run directory, run-id files and a flat view of nested records."""

from __future__ import annotations

import json
import numbers
import os
from typing import Any, Mapping

Flat = dict[str, bool | int | float | str]


def run_dir(own: str | None, start_out: str | None, sink: str) -> str:
    """The directory a sink writes to: the one it was made with, else the run's `out`."""
    from fedjax_pfl.errors import OptionError, arg

    out = own if own is not None else start_out
    if out is None:
        raise OptionError(f"{arg('log')} {sink} needs a run directory ({arg('out')})")
    os.makedirs(out, exist_ok=True)
    return out


def read_id(path: str) -> str | None:
    """The run id kept in `path`, or None when there is none."""
    try:
        with open(path) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def write_id(path: str, run_id: str) -> None:
    """Keeps `run_id` in `path` (a temporary renamed over it: never half-written)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(run_id + "\n")
    os.replace(tmp, path)


def flatten(record: Mapping[str, Any], sep: str = ".", prefix: str = "") -> Flat:
    """{"hparams": {"eta": 0.1}} -> {"hparams.eta": 0.1}: nested mappings joined by `sep`; bools,
    ints, floats and strings kept as they are; None, lists and anything else as compact JSON
    (the text the run's config.json shows)."""
    flat: Flat = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, sep, name + sep))
        elif isinstance(value, (bool, str)):
            flat[name] = value
        elif isinstance(value, numbers.Integral):  # NumPy integers too
            flat[name] = int(value)
        elif isinstance(value, numbers.Real):
            flat[name] = float(value)
        else:
            flat[name] = json.dumps(value, separators=(",", ":"), default=str)
    return flat
