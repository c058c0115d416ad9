"""FedJAX's SQLite files, read with sqlite3 and msgpack (no TensorFlow, no FedJAX).

Layout, from FedJAX's own source (``fedjax/core/sqlite_federated_data.py``, `SQLiteFederatedData`
and `SQLiteFederatedDataBuilder`): one file per split, each with one table ::

    CREATE TABLE federated_data (client_id BLOB NOT NULL PRIMARY KEY,
                                 data BLOB NOT NULL, num_examples INTEGER NOT NULL);

``data`` is ``zlib.compress(msgpack_serialize(examples))`` where ``examples`` is a dict feature
name → array (``fedjax/core/serialization.py``): msgpack with extension types 1 (a numeric ndarray
as the msgpack triple (shape, dtype name, C-order bytes)), 3 (a NumPy scalar, packed the same
way) and 4 (an ndarray of bytes as (shape, flat list of bytes)). The features are TFF's (see
`fedjax_pfl.data.tff`): EMNIST ``pixels`` float32 [n, 28, 28] and ``label``; Shakespeare
``snippets``; Stack Overflow ``tokens``, ``title``, ``tags`` (and more); CIFAR-100 ``image``
uint8, ``label``, ``coarse_label``. They go through the same conversions as TFF's HDF5 files.

Files, as ``fedjax.datasets.<name>.load_split`` names them (it downloads to ``~/.cache/fedjax``
from https://storage.googleapis.com/gresearch/fedjax/<dataset>/<file>):

* emnist62: ``federated_emnist_train.sqlite``, ``federated_emnist_test.sqlite``;
  emnist10: ``federated_emnist_digitsonly_{train,test}.sqlite``;
* shakespeare: ``shakespeare_{train,test}.sqlite``;
* stackoverflow_*: ``stackoverflow_{train,test}.sqlite`` (``eval_split="held_out"``:
  ``stackoverflow_held_out.sqlite``), with TFF's ``stackoverflow.word_count`` (FedJAX serves a
  copy beside its files) and, for tags, ``stackoverflow.tag_count``;
* cifar100_fl: ``federated_cifar100_{train,test}.sqlite`` (FedJAX builds them locally from TFF's
  ``cifar100.sqlite.lzma`` in ``fedjax.datasets.cifar100.load_split``).

Client ids are stored as bytes and decoded as UTF-8; clients come in sorted id order, one
client's row read per step (the id list is read once, not the data).
"""

from __future__ import annotations

import os
import sqlite3
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fedjax_pfl.data.natural import ClientBlock, DataFormatError, SourceInfo, Task
from fedjax_pfl.data.sources import DatasetNotFoundError
from fedjax_pfl.data.tff import DATASETS, DatasetSpec, check_lengths, dataset_spec, pair_clients, resolve_options

__all__ = ["DATASETS", "FedjaxSqliteReader", "fedjax_files", "open_fedjax", "detect",
           "decode_examples"]

_FEDJAX_URL = "https://storage.googleapis.com/gresearch/fedjax/"
_EXT_NDARRAY, _EXT_COMPLEX, _EXT_NPSCALAR, _EXT_BYTES_NDARRAY = 1, 2, 3, 4


class _DecodeError(ValueError):
    pass


def _ndarray(data: bytes) -> np.ndarray:
    import msgpack

    shape, dtype_name, buffer = msgpack.unpackb(data, raw=True)
    dtype = np.dtype(dtype_name.decode("ascii"))
    if dtype.kind not in "biuf":              # never object or structured dtypes from a file
        raise _DecodeError(f"unsupported array dtype {dtype}")
    return np.frombuffer(buffer, dtype=dtype).reshape(shape)


def _ext_hook(code: int, data: bytes):
    import msgpack

    if code == _EXT_NDARRAY:
        return _ndarray(data)
    if code == _EXT_NPSCALAR:
        return _ndarray(data)[()]
    if code == _EXT_BYTES_NDARRAY:
        shape, flat = msgpack.unpackb(data, raw=True)
        arr = np.empty(len(flat), dtype=object)
        arr[:] = flat
        return arr.reshape(shape)
    if code == _EXT_COMPLEX:
        real, imag = msgpack.unpackb(data)
        return complex(real, imag)
    raise _DecodeError(f"unknown msgpack extension type {code}")


def decode_examples(blob: bytes) -> dict[str, Any]:
    """FedJAX's `decompress_and_deserialize`: zlib, then msgpack with its extension types.

    Raises:
      ValueError: the blob is not that (zlib, msgpack or extension error), or not a dict.
    """
    import msgpack

    try:
        out = msgpack.unpackb(zlib.decompress(blob), ext_hook=_ext_hook, raw=False)
    except (zlib.error, msgpack.UnpackException, ValueError, TypeError) as e:
        raise ValueError(f"not zlib-compressed FedJAX msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(out, dict):
        raise ValueError(f"examples are a {type(out).__name__}, not a dict of features")
    return out


def fedjax_files(name: str, eval_split: str = "test") -> tuple[str, str, str]:
    """(train file, test file, where FedJAX gets them) for `name`."""
    if name not in DATASETS:
        raise ValueError(f"unknown natural dataset {name!r}; choose from {', '.join(DATASETS)}")
    prefix, loader = {
        "emnist62": ("federated_emnist", "fedjax.datasets.emnist.load_data(only_digits=False), "
                                         f"from {_FEDJAX_URL}emnist/"),
        "emnist10": ("federated_emnist_digitsonly",
                     f"fedjax.datasets.emnist.load_data(only_digits=True), from {_FEDJAX_URL}emnist/"),
        "shakespeare": ("shakespeare", "fedjax.datasets.shakespeare.load_data(), "
                                       f"from {_FEDJAX_URL}shakespeare/"),
        "stackoverflow_nwp": ("stackoverflow", "fedjax.datasets.stackoverflow.load_data(), "
                                               f"from {_FEDJAX_URL}stackoverflow/"),
        "stackoverflow_tp": ("stackoverflow", "fedjax.datasets.stackoverflow.load_data(), "
                                              f"from {_FEDJAX_URL}stackoverflow/"),
        "cifar100_fl": ("federated_cifar100", "fedjax.datasets.cifar100.load_data(), which builds "
                                              "them from TFF's cifar100.sqlite.lzma"),
    }[name]
    return f"{prefix}_train.sqlite", f"{prefix}_{eval_split}.sqlite", loader


def _connect(path: str) -> sqlite3.Connection:
    # Read-only: a reader never creates or changes a database.
    return sqlite3.connect(Path(path).as_uri() + "?mode=ro", uri=True)


def _decode_id(raw: Any, path: str) -> str:
    if isinstance(raw, bytes):
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise DataFormatError(path, f"client id {raw!r} is not UTF-8") from None
    if isinstance(raw, str):
        return raw
    raise DataFormatError(path, f"client id {raw!r} is neither bytes nor text")


def _client_keys(conn: sqlite3.Connection, path: str) -> dict[str, Any]:
    """Decoded client id → the stored key (bytes), from FedJAX's ``federated_data`` table."""
    try:
        rows = conn.execute("SELECT client_id FROM federated_data").fetchall()
    except sqlite3.DatabaseError as e:
        raise DataFormatError(path, f"not a FedJAX SQLite file with a federated_data table "
                                    f"({e})") from None
    keys: dict[str, Any] = {}
    for (raw,) in rows:
        client = _decode_id(raw, path)
        if client in keys:
            # SQLite's key tells a BLOB from a TEXT of the same characters; the decoded ids
            # would silently merge two clients into one.
            raise DataFormatError(path, f"client id repeats after UTF-8 decoding (stored as "
                                        f"{keys[client]!r} and {raw!r})", client)
        keys[client] = raw
    return keys


class FedjaxSqliteReader:
    """`natural.NaturalReader` over one dataset's FedJAX SQLite files (module docstring)."""

    def __init__(self, spec: DatasetSpec, train_path: str, test_path: str, separate_test: bool):
        self._spec, self._train, self._test = spec, train_path, test_path
        self._separate = separate_test
        for path in (train_path, test_path):        # fail early on an unreadable file
            conn = _connect(path)
            try:
                conn.execute("SELECT client_id, data, num_examples FROM federated_data LIMIT 1")
            except sqlite3.DatabaseError as e:
                raise DataFormatError(path, f"not a FedJAX SQLite file with a federated_data "
                                            f"table ({e})") from None
            finally:
                conn.close()

    def task(self) -> Task:
        return self._spec.task

    def source(self) -> SourceInfo:
        s = self._spec
        return SourceInfo(name=s.name, format="fedjax",
                          files=(self._train, self._test, *s.extra_files),
                          input_scale=s.input_scale, input_shift=s.input_shift, vocab=s.vocab,
                          labels=s.labels, options=s.options, rounded=s.quantiser.rounded)

    def clients(self) -> Iterator[ClientBlock]:
        """Every client once, sorted by id; one row per file is read per step."""
        self._spec.quantiser.reset()
        ctrain, ctest = _connect(self._train), _connect(self._test)
        try:
            ktrain, ktest = _client_keys(ctrain, self._train), _client_keys(ctest, self._test)
            for client, in_train, in_test in pair_clients(list(ktrain), list(ktest), self._separate):
                train = self._read(ctrain, self._train, ktrain.get(in_train), client)
                test = self._read(ctest, self._test, ktest.get(in_test), client)
                yield ClientBlock(client, *train, *test)
        finally:
            ctrain.close()
            ctest.close()

    def _read(self, conn: sqlite3.Connection, path: str, key: Any, client: str):
        if key is None:
            return self._spec.empty
        try:
            row = conn.execute("SELECT data, num_examples FROM federated_data WHERE client_id = ?",
                               (key,)).fetchone()
        except sqlite3.DatabaseError as e:
            raise DataFormatError(path, f"cannot read ({e})", client) from None
        try:
            examples = decode_examples(row[0])
        except ValueError as e:
            raise DataFormatError(path, str(e), client) from None
        missing = [f for f in self._spec.features if f not in examples]
        if missing:
            raise DataFormatError(path, f"feature(s) {missing} missing (has {sorted(examples)})",
                                  client)
        features = {f: examples[f] for f in self._spec.features}
        check_lengths(features, path, client)
        n = np.shape(features[self._spec.features[0]])[0]
        if n != row[1]:
            raise DataFormatError(path, f"num_examples is {row[1]} but the data hold {n}", client)
        return self._spec.convert(features, path, client)


def _paths(name: str, data_dir: str, eval_split: str) -> tuple[str, str, str]:
    train, test, loader = fedjax_files(name, eval_split)
    return (os.path.abspath(os.path.join(data_dir, train)),
            os.path.abspath(os.path.join(data_dir, test)), loader)


def detect(data_dir: str, name: str) -> bool:
    """Whether `data_dir` holds FedJAX's train SQLite file of `name`."""
    return os.path.isfile(_paths(name, data_dir, "test")[0])


def open_fedjax(name: str, data_dir: str, **options: Any) -> FedjaxSqliteReader:
    """The reader of `name` in FedJAX's SQLite files under `data_dir` (options as `tff.open_tff`).

    Raises:
      DatasetNotFoundError: a file is absent (one line: the files and where they come from).
      DataFormatError: a file is not SQLite or has no ``federated_data`` table.
      ValueError: unknown dataset or option.
    """
    opts = resolve_options(name, options)
    train, test, loader = _paths(name, data_dir, opts.get("eval_split", "test"))
    missing = [os.path.basename(p) for p in (train, test) if not os.path.isfile(p)]
    if missing:
        raise DatasetNotFoundError(
            f"{name}: FedJAX SQLite file(s) {', '.join(missing)} not found in "
            f"{os.path.abspath(data_dir)}; {loader} downloads them to ~/.cache/fedjax")
    spec = dataset_spec(name, data_dir, opts)
    return FedjaxSqliteReader(spec, train, test, separate_test=(name == "cifar100_fl"
                                                                and opts["test_clients"] == "separate"))
