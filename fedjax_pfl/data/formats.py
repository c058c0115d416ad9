"""Natural-client datasets by name: which file formats hold each, how the format is detected, and
the path from files to a `FederatedData` (reader → cache → client subset → device).

    data, info = load_natural("shakespeare", data_dir="~/leaf/data/shakespeare/data")

Formats (one reader module each): ``leaf`` (LEAF's ``train/*.json`` and ``test/*.json``,
`data/leaf.py`), ``tff`` (TensorFlow Federated's ``*_train.h5`` / ``*_test.h5``, `data/tff.py`),
``fedjax`` (FedJAX's SQLite files, `data/fedjax_sqlite.py`). The first read converts the files to a
client-sorted cache under the data directory (`data/cache.py`); later runs open the cache.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import numpy as np

from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.data.natural import NaturalClients

__all__ = ["NATURAL_DATASETS", "FORMATS", "detect_format", "open_reader", "load_natural",
           "to_federated"]

# dataset -> the formats that hold it, in the order detection tries them.
NATURAL_DATASETS: dict[str, tuple[str, ...]] = {
    "femnist": ("leaf",),
    "emnist62": ("tff", "fedjax"),
    "emnist10": ("tff",),
    "shakespeare": ("leaf", "tff", "fedjax"),
    "stackoverflow_nwp": ("tff", "fedjax"),
    "stackoverflow_tp": ("tff", "fedjax"),
    "sent140": ("leaf",),
    "celeba": ("leaf",),
    "cifar100_fl": ("tff", "fedjax"),
}
FORMATS = ("leaf", "tff", "fedjax")
_MODULES = {"leaf": ("fedjax_pfl.data.leaf", "open_leaf"),
            "tff": ("fedjax_pfl.data.tff", "open_tff"),
            "fedjax": ("fedjax_pfl.data.fedjax_sqlite", "open_fedjax")}


def _module(fmt: str):
    name, _ = _MODULES[fmt]
    try:
        return importlib.import_module(name)
    except ImportError as e:  # h5py absent, or a reader not built
        raise ValueError(f"--format {fmt} needs {name} ({e}); pip install 'fedjax_pfl' "
                         "installs h5py") from None


def detect_format(name: str, data_dir: str) -> str | None:
    """The first format of `name` whose files are in `data_dir`, or None."""
    for fmt in NATURAL_DATASETS[name]:
        try:
            module = _module(fmt)
        except ValueError:
            continue
        detect = getattr(module, "detect", None)
        if detect is None:
            continue
        try:
            found = detect(data_dir, name)
        except TypeError:
            found = detect(data_dir)
        if found:
            return fmt
    return None


def open_reader(name: str, data_dir: str, fmt: str | None = None, **options: Any):
    """The reader (`natural.NaturalReader`) of dataset `name` in `data_dir`; `fmt` None: detected.
    A missing directory or files raise `sources.DatasetNotFoundError` (one line)."""
    if name not in NATURAL_DATASETS:
        raise ValueError(f"unknown natural dataset {name!r}; expected one of {list(NATURAL_DATASETS)}")
    if fmt is not None and fmt not in NATURAL_DATASETS[name]:
        raise ValueError(f"--format {fmt}: {name} is read from {list(NATURAL_DATASETS[name])} files")
    data_dir = os.path.abspath(os.path.expanduser(data_dir))
    if fmt is None:
        fmt = detect_format(name, data_dir) or NATURAL_DATASETS[name][0]
    module = _module(fmt)
    return getattr(module, _MODULES[fmt][1])(name, data_dir, **options)


def to_federated(nc: NaturalClients, selected: np.ndarray | None = None) -> FederatedData:
    """Client blocks of `nc` (all, or the client indices `selected`, in that order) on device,
    each client keeping its own train/test split."""
    task, src = nc.task, nc.source
    if selected is None:
        x = np.concatenate([np.asarray(nc.train_x), np.asarray(nc.test_x)])
        y = np.concatenate([np.asarray(nc.train_y), np.asarray(nc.test_y)])
        train_counts, test_counts = nc.train_counts(), nc.test_counts()
    else:
        selected = np.asarray(selected, np.int64)
        to, eo = nc.train_offsets, nc.test_offsets
        blocks = lambda a, o: [a[o[i]:o[i + 1]] for i in selected]
        x = np.concatenate(blocks(nc.train_x, to) + blocks(nc.test_x, eo))
        y = np.concatenate(blocks(nc.train_y, to) + blocks(nc.test_y, eo))
        train_counts, test_counts = to[selected + 1] - to[selected], eo[selected + 1] - eo[selected]
    if task.inputs == "tokens":
        x = x.astype(np.int32)
    return FederatedData.from_blocks(x, y, train_counts, test_counts, num_classes=task.num_classes,
                                     input_scale=src.input_scale, input_shift=src.input_shift,
                                     name=src.name, task=task)


def load_natural(name: str, *, data_dir: str | None, fmt: str | None = None,
                 max_clients: int | None = None, min_samples: int = 0, seed: int = 0,
                 cache_dir: str | None = None, log=print,
                 **options: Any) -> tuple[FederatedData, dict[str, Any]]:
    """Reads (or opens the cache of) dataset `name`, takes the LEAF-style client subset
    (`cache.select`: clients with ≥ `min_samples` training samples, then `max_clients` of them at
    random with `seed`) and returns it on device with a JSON-ready description. The description's
    "client_ids" (an array, not JSON) are the natural ids of the clients, by row."""
    from fedjax_pfl.data import cache

    if not data_dir:
        raise ValueError(f"--dataset {name} reads natural-client files: give --data-dir DIR "
                         f"(the folder holding the {'/'.join(NATURAL_DATASETS.get(name, ()))} files)")
    reader = open_reader(name, data_dir, fmt, **options)
    root = cache_dir or os.path.join(os.path.abspath(os.path.expanduser(data_dir)), ".fedjax_pfl_cache")
    nc = cache.load(reader, root, log=log)
    selected = cache.select(nc, max_clients=max_clients, min_samples=min_samples, seed=seed)
    selected = np.asarray(selected, np.int64)
    data = to_federated(nc, selected)
    train = nc.train_counts()[selected]
    test = nc.test_counts()[selected]
    info = {
        "dataset": name,
        "format": nc.source.format,
        "source": os.path.dirname(nc.source.files[0]) if nc.source.files else data_dir,
        "task": {"kind": nc.task.kind, "inputs": nc.task.inputs, "num_classes": nc.task.num_classes},
        "num_clients": int(selected.size),
        "clients_in_files": nc.num_clients,
        "train_size": {"min": int(train.min()), "mean": float(train.mean()),
                       "max": int(train.max()), "total": int(train.sum())},
        "test_size": {"min": int(test.min()), "mean": float(test.mean()),
                      "max": int(test.max()), "total": int(test.sum())},
        "clients_without_test": int((test == 0).sum()),
        "client_ids": np.asarray(nc.client_ids)[selected],
    }
    return data, info
