"""Natural-client datasets by name: which file formats hold each, how the format is detected, and
the path from files to a `FederatedData` (reader → cache → client subset → device).

    data, info = load_natural("shakespeare", data_dir="~/leaf/data/shakespeare/data")

Formats (one reader module each): ``leaf`` (LEAF's ``train/*.json`` and ``test/*.json``,
`data/leaf.py`), ``tff`` (TensorFlow Federated's ``*_train.h5`` / ``*_test.h5``, `data/tff.py`),
``fedjax`` (FedJAX's SQLite files, `data/fedjax_sqlite.py`), ``jsonl`` (JSON Lines text clients
for fine-tuning with a pretrained tokenizer, `data/jsonl.py`; ``data_dir`` may be one file). The
first read converts the files to a client-sorted cache under the data directory
(`data/cache.py`); later runs open the cache.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib
import os
from typing import Any

import numpy as np

from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.data.natural import NaturalClients
from fedjax_pfl.errors import OptionError, arg

__all__ = ["NATURAL_DATASETS", "FORMATS", "READERS", "UsageError", "detect_format", "open_reader",
           "load_natural", "to_federated"]

# dataset -> the formats that hold it, in the order detection tries them.
NATURAL_DATASETS: dict[str, tuple[str, ...]] = {
    "femnist": ("leaf",),
    "emnist62": ("tff", "fedjax"),
    "emnist10": ("tff", "fedjax"),
    "shakespeare": ("leaf", "tff", "fedjax"),
    "stackoverflow_nwp": ("tff", "fedjax"),
    "stackoverflow_tp": ("tff", "fedjax"),
    "sent140": ("leaf",),
    "celeba": ("leaf",),
    "cifar100_fl": ("tff", "fedjax"),
    "jsonl": ("jsonl",),
}
FORMATS = ("leaf", "tff", "fedjax", "jsonl")
# format -> (reader module, its open function)
READERS = {"leaf": ("fedjax_pfl.data.leaf", "open_leaf"),
           "tff": ("fedjax_pfl.data.tff", "open_tff"),
           "fedjax": ("fedjax_pfl.data.fedjax_sqlite", "open_fedjax"),
           "jsonl": ("fedjax_pfl.data.jsonl", "open_jsonl")}


class UsageError(OptionError):
    """A format that cannot be chosen or used (several present, a reader or its package missing):
    one line, naming the data options (`errors.arg`)."""


def _glob_detect(fmt: str, data_dir: str) -> bool:
    """The format's file signature directly in `data_dir` (used when its reader module offers no
    `detect`)."""
    has = lambda *parts: bool(glob.glob(os.path.join(data_dir, *parts)))  # noqa: E731
    if fmt == "leaf":
        return has("train", "*.json") and has("test", "*.json")
    if fmt == "tff":
        return has("*_train.h5") or has("*_test.h5")
    if fmt == "jsonl":
        return os.path.isfile(data_dir) or has("*.jsonl")
    return has("*.sqlite")


def detect_format(data_dir: str, name: str | None = None) -> str:
    """The file format in `data_dir`: "leaf" (train/*.json and test/*.json), "tff" (*_train.h5 or
    *_test.h5) or "fedjax" (*.sqlite). A reader module's own `detect(data_dir, name)` decides for
    its format where it has one (LEAF's accepts the nested `DIR/data/train/` layouts too). Raises
    DatasetNotFoundError when no format is there, UsageError when several are (`fmt` decides)."""
    from fedjax_pfl.data.sources import DatasetNotFoundError

    found = []
    for fmt in FORMATS:
        if name in NATURAL_DATASETS and fmt not in NATURAL_DATASETS[name]:
            continue
        detect = None
        if name is not None:
            try:
                detect = getattr(importlib.import_module(READERS[fmt][0]), "detect", None)
            except ImportError:
                detect = None
        try:
            hit = detect(data_dir, name) if detect is not None else _glob_detect(fmt, data_dir)
        except Exception:                             # noqa: BLE001 (e.g. a dataset the format lacks):
            hit = False                               # detection never fails, it only finds nothing
        if hit:
            found.append(fmt)
    if not found:
        raise DatasetNotFoundError(
            f"no natural-client files in {data_dir}: looked for LEAF's train/*.json and test/*.json, "
            f"TFF's *_train.h5 / *_test.h5 and FedJAX's *.sqlite")
    if len(found) > 1:
        raise UsageError(f"{data_dir} holds files of several formats ({', '.join(found)}): "
                         f"choose one with {arg('fmt', 'data')}")
    return found[0]


def open_reader(name: str, data_dir: str, fmt: str | None = None, **options: Any):
    """The reader (`natural.NaturalReader`) of dataset `name` in `data_dir`, in format `fmt`
    (detected when None). Absent files raise `sources.DatasetNotFoundError` in one line naming
    the files looked for and the script that makes them (the dataset's first format's reader says
    it when no format is detected); the reader module is imported only now, so a missing optional
    package (h5py) matters only to the format that needs it."""
    from fedjax_pfl.data.sources import DatasetNotFoundError

    if fmt is not None and fmt not in READERS:
        raise UsageError(f"{arg('fmt', 'data')} must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt is not None and name in NATURAL_DATASETS and fmt not in NATURAL_DATASETS[name]:
        raise UsageError(f"{arg('fmt', 'data')} {fmt}: {name} is read from "
                         f"{list(NATURAL_DATASETS[name])} files")
    data_dir = os.path.abspath(os.path.expanduser(data_dir))
    if name == "jsonl":                               # a file or a folder: the reader says which
        fmt = "jsonl"
    elif not os.path.isdir(data_dir):
        raise DatasetNotFoundError(f"{arg('data_dir', 'data')} {data_dir} is not a directory")
    if fmt is None:
        try:
            fmt = detect_format(data_dir, name)
        except DatasetNotFoundError:
            if name not in NATURAL_DATASETS:
                raise
            fmt = NATURAL_DATASETS[name][0]           # its reader names the files and the script
    module_name, func = READERS[fmt]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            raise UsageError(f"the {fmt} reader ({module_name}) is not available in this "
                             "installation") from None
        raise UsageError(f"the {fmt} reader needs the package {e.name!r}: pip install {e.name}") from None
    return getattr(module, func)(name, data_dir, **options)


def to_federated(nc: NaturalClients, selected: np.ndarray | None = None, *,
                 device: bool = True, max_train: int | None = None) -> FederatedData:
    """Client blocks of `nc` (all, or the client indices `selected`, in that order) on device
    (or, `device=False`, in host memory), each client keeping its own train/test split;
    `max_train`: each client's first K training samples only (in the files' order, as TFF's
    `max_elements_per_user` takes a client's first elements), its test split whole."""
    task, src = nc.task, nc.source
    if max_train is not None:
        if selected is None:                               # (a per-client cut: per-client slices)
            selected = np.arange(nc.num_clients)
    elif selected is not None and np.array_equal(selected, np.arange(nc.num_clients)):
        selected = None                   # every client in order: whole arrays, no per-client slices
    if selected is None and nc.all_x is not None:      # a cache's mapped file: no copy
        x, y = nc.all_x, nc.all_y
        train_counts, test_counts = nc.train_counts(), nc.test_counts()
    elif selected is None:
        x = np.concatenate([np.asarray(nc.train_x), np.asarray(nc.test_x)])
        y = np.concatenate([np.asarray(nc.train_y), np.asarray(nc.test_y)])
        train_counts, test_counts = nc.train_counts(), nc.test_counts()
    else:
        selected = np.asarray(selected, np.int64)
        to, eo = nc.train_offsets, nc.test_offsets
        train_end = to[selected + 1] if max_train is None else np.minimum(
            to[selected + 1], to[selected] + int(max_train))
        train = lambda a: [a[to[i]:end] for i, end in zip(selected, train_end)]
        test = lambda a: [a[eo[i]:eo[i + 1]] for i in selected]
        x = np.concatenate(train(nc.train_x) + test(nc.test_x))
        y = np.concatenate(train(nc.train_y) + test(nc.test_y))
        train_counts, test_counts = train_end - to[selected], eo[selected + 1] - eo[selected]
    if task.inputs == "tokens":
        x = x.astype(np.int32, copy=False)
    return FederatedData.from_blocks(x, y, train_counts, test_counts, num_classes=task.num_classes,
                                     input_scale=src.input_scale, input_shift=src.input_shift,
                                     name=src.name, task=task, device=device)


TOKEN_ACCURACY = ("default", "all", "no_oov")


def with_token_accuracy(nc: NaturalClients, rule: str) -> NaturalClients:
    """`nc` with the targets that per-token accuracy leaves out chosen by `rule` (padding never
    counts): "default" keeps the reader's (FedJAX's: end of sentence too), "all" scores every
    real target, "no_oov" leaves out end of sentence and out-of-vocabulary targets too (TFF's
    `accuracy_without_out_of_vocab_or_end_of_sentence`). Special ids are found by name in the
    source vocabulary ("<eos>", "<oov>")."""
    if rule not in TOKEN_ACCURACY:
        raise OptionError(f"{arg('token_accuracy', 'data')} must be one of {list(TOKEN_ACCURACY)}, "
                          f"got {rule!r}")
    if rule == "default":
        return nc
    if nc.task.kind != "sequence":
        raise OptionError(f"{arg('token_accuracy', 'data')} applies to per-token tasks; "
                          f"{nc.source.name} is a {nc.task.kind} task")
    vocab = list(nc.source.vocab)
    names = () if rule == "all" else ("<eos>", "<oov>")
    excluded = tuple(vocab.index(n) for n in names if n in vocab)
    return dataclasses.replace(nc, task=dataclasses.replace(nc.task, metric_excluded=excluded))


def load_natural(name: str, *, data_dir: str | None, fmt: str | None = None,
                 max_clients: int | None = None, min_samples: int = 0, seed: int = 0,
                 max_client_samples: int | None = None,
                 cache_dir: str | None = None, token_accuracy: str = "default", log=print,
                 device: bool = True, **options: Any) -> tuple[FederatedData, dict[str, Any]]:
    """Reads (or opens the cache of) dataset `name`, takes the LEAF-style client subset
    (`cache.select`: clients with ≥ `min_samples` training samples, then `max_clients` of them at
    random with `seed`; each client's first `max_client_samples` training samples) and returns
    it on device with a JSON-ready description. The description's
    "client_ids" (an array, not JSON) are the natural ids of the clients, by row."""
    from fedjax_pfl.data import cache

    if not data_dir:
        raise OptionError(f"{arg('dataset')} {name} reads natural-client files: give "
                          f"{arg('data_dir', 'data')} DIR (the folder holding the "
                          f"{'/'.join(NATURAL_DATASETS.get(name, ()))} files)")
    reader = open_reader(name, data_dir, fmt, **options)
    where = os.path.abspath(os.path.expanduser(data_dir))
    if os.path.isfile(where):                         # (jsonl: one file) the cache beside it
        where = os.path.dirname(where)
    root = cache_dir or os.path.join(where, ".fedjax_pfl_cache")
    nc = with_token_accuracy(cache.load(reader, root, log=log), token_accuracy)
    selected = cache.select(nc, max_clients=max_clients, min_samples=min_samples, seed=seed)
    selected = np.asarray(selected, np.int64)
    data = to_federated(nc, selected, device=device, max_train=max_client_samples)
    train = nc.train_counts()[selected]
    if max_client_samples is not None:
        train = np.minimum(train, int(max_client_samples))
    test = nc.test_counts()[selected]
    info = {
        "dataset": name,
        "format": nc.source.format,
        "source": os.path.dirname(nc.source.files[0]) if nc.source.files else data_dir,
        "task": {"kind": nc.task.kind, "inputs": nc.task.inputs, "num_classes": nc.task.num_classes,
                 "metric_excluded": list(nc.task.metric_excluded)},
        "num_clients": int(selected.size),
        "clients_in_files": nc.num_clients,
        "train_size": {"min": int(train.min()), "mean": float(train.mean()),
                       "max": int(train.max()), "total": int(train.sum())},
        "test_size": {"min": int(test.min()), "mean": float(test.mean()),
                      "max": int(test.max()), "total": int(test.sum())},
        "clients_without_test": int((test == 0).sum()),
        "rounded_values": int(nc.source.rounded),
        "client_ids": np.asarray(nc.client_ids)[selected],
    }
    return data, info
