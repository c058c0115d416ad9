"""Raw dataset loaders: whole datasets as host-side NumPy arrays, before any client partitioning.

`load_raw(name)` returns every sample of one dataset as a `RawDataset`. Nothing here touches JAX;
partitioning into clients and moving arrays to the device happen elsewhere in `fedjax_pfl.data`.

Where each dataset comes from:

* ``digits``: the 8×8 scikit-learn digits, embedded in the package as ``digits.npz`` (no network,
  no scikit-learn).
* ``synthetic``: Synthetic(α, β) of Li et al. (FedProx), generated from ``seed``.
* ``mnist``, ``fashion_mnist``, ``emnist``, ``cifar10``, ``cifar100``: looked up in this order, and
  the first readable copy wins:

  1. a prepared TensorFlow Datasets (TFDS) directory (``tfds_dir``, else ``$TFDS_DATA_DIR``, else
     ``~/tensorflow_datasets``). Only already-prepared data is read; this step never downloads;
  2. the original distribution files (IDX ``.gz`` files, CIFAR python pickles or their ``.tar.gz``;
     the pickles are read by an unpickler that admits only NumPy arrays, dtypes and builtin
     containers, so a crafted batch cannot run code)
     under ``data_dir`` (default `default_data_dir()`), and for Fashion-MNIST also Debian's
     ``/usr/share/datasets/fashion-mnist`` (``apt-get install dataset-fashion-mnist``);
  3. only with ``download=True``: a TFDS download into ``tfds_dir``, after a 3 s connectivity probe.

  If none of these gives the data, `DatasetNotFoundError` says which directories were searched,
  which files were expected and where to get them. There is never a silent download.

Images are returned as uint8 NHWC with the normalisation to [-1, 1] given as `input_scale` and
`input_shift` (the model sees ``x * input_scale + input_shift``), so the (large) arrays stay uint8
on the host until a batch is formed.

One module per format family; this one is the dispatcher (the lookup order, the registry of image
datasets and the not-found message):

* `fedjax_pfl.data.synthetic`: ``digits`` (embedded) and ``synthetic`` (generated);
* `fedjax_pfl.data.idx`: MNIST, Fashion-MNIST and EMNIST IDX files;
* `fedjax_pfl.data.cifar_pickle`: CIFAR python batches and the restricted unpickler;
* `fedjax_pfl.data.tfds_source`: prepared TFDS copies, the ``--download`` probe and download;
* `fedjax_pfl.data._raw_common`: what the image readers share (`_ImageSpec`, file-set lookup).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from fedjax_pfl.data import idx
from fedjax_pfl.data._raw_common import _ImageSpec, _Loaded
from fedjax_pfl.data.cifar_pickle import (  # UnsafePickleError: re-exported, callers catch it here
    UnsafePickleError,  # noqa: F401
    _cifar_dirs,
    _cifar_expected,
    _load_cifar_files,
)
from fedjax_pfl.data.idx import (
    _emnist_dirs,
    _emnist_expected,
    _load_emnist_files,
    _load_mnist_files,
    _mnist_dirs,
    _mnist_expected,
)
from fedjax_pfl.data.synthetic import SYNTHETIC_MAX_SAMPLES_PER_CLIENT, _generate_synthetic, _load_digits

# `_download_with_tfds` calls `_can_reach` through this module's globals, so tests patch
# `sources._can_reach` (patching `tfds_source._can_reach` would not reach it).
from fedjax_pfl.data.tfds_source import (
    _PROBE_TIMEOUT_S,
    _can_reach,
    _download_and_read,
    _from_prepared_tfds,
    _resolve_tfds_dir,
    _tfds_full_name,
)
from fedjax_pfl.errors import MarkedError, OptionError, arg

__all__ = [
    "DATASETS",
    "EMNIST_SPLITS",
    "SYNTHETIC_MAX_SAMPLES_PER_CLIENT",
    "DatasetNotFoundError",
    "RawDataset",
    "default_data_dir",
    "load_raw",
]

_log = logging.getLogger(__name__)


class RawDataset(NamedTuple):
    """One whole dataset on the host, before it is split into clients."""

    name: str
    x: np.ndarray  # images: [n, H, W, C] uint8 (NHWC); tabular: [n, F] float32
    y: np.ndarray  # [n] int32 labels in [0, num_classes)
    num_classes: int
    input_scale: float  # the model sees x.astype(float32) * input_scale + input_shift
    input_shift: float
    client_ids: np.ndarray | None  # [n] int32 natural client of each sample (synthetic), else None
    source: str  # human-readable: where the data was read from (path / "embedded" / "generated")
    # [natural clients] bool: whose features x holds (the others' rows are zeros, see
    # `synthetic._generate_synthetic`'s `materialise`); None: every sample's
    written: np.ndarray | None = None


class DatasetNotFoundError(MarkedError, FileNotFoundError):
    """No readable copy of a dataset was found. The message lists where we looked and what to do
    (naming the data options, `errors.arg`)."""


DATASETS: tuple[str, ...] = (
    "digits",
    "synthetic",
    "mnist",
    "fashion_mnist",
    "emnist",
    "cifar10",
    "cifar100",
)

# EMNIST split -> number of classes (Cohen et al. 2017, Table II). "letters" files label the 26
# letters 1..26; we shift them to 0..25.
EMNIST_SPLITS: dict[str, int] = {
    "byclass": 62,
    "bymerge": 47,
    "balanced": 47,
    "letters": 26,
    "digits": 10,
    "mnist": 10,
}


# ---------------------------------------------------------------------------------------------
# Public entry points.
# ---------------------------------------------------------------------------------------------


def default_data_dir() -> str:
    """The default ``data_dir``: ``$FEDJAX_PFL_DATA_DIR`` if set, else ``~/fedjax_pfl_data``."""
    env = os.environ.get("FEDJAX_PFL_DATA_DIR")
    if env:
        return os.path.expanduser(env)
    return os.path.join(os.path.expanduser("~"), "fedjax_pfl_data")


def load_raw(
    name: str,
    *,
    data_dir: str | None = None,
    tfds_dir: str | None = None,
    download: bool = False,
    merge_splits: bool = True,
    seed: int = 0,
    synthetic_alpha: float = 1.0,
    synthetic_beta: float = 1.0,
    synthetic_clients: int = 30,
    synthetic_dim: int = 60,
    emnist_split: str = "balanced",
    materialise: Callable[[np.ndarray], np.ndarray] | None = None,
) -> RawDataset:
    """Loads one whole dataset as host-side NumPy arrays.

    Args:
      name: one of `DATASETS`.
      data_dir: directory holding the original distribution files (``--data-dir``); the loaders look
        in ``data_dir/<name>/`` and in ``data_dir/`` itself. Default: `default_data_dir()`.
      tfds_dir: TensorFlow Datasets data directory (``--tfds-dir``). Default: ``$TFDS_DATA_DIR``,
        else ``~/tensorflow_datasets``. Read first if it holds a prepared copy of the dataset.
      download: let TFDS download and prepare the dataset into ``tfds_dir`` when no local copy is
        found (``--download``). Without it a missing dataset raises `DatasetNotFoundError`.
      merge_splits: concatenate the official train and test splits (train first), as our papers
        re-partition all samples among clients; ``False`` returns only the official train split.
        No effect on ``digits`` and ``synthetic``, which have no official split.
      seed: seed of the ``synthetic`` generator (ignored by the other datasets).
      synthetic_alpha: α ≥ 0, the variance of each client's model mean u_k (Synthetic(α, β)).
      synthetic_beta: β ≥ 0, the variance of each client's feature mean B_k.
      synthetic_clients: number of synthetic clients (≥ 1).
      synthetic_dim: synthetic feature dimension d (≥ 1; 60 in the paper).
      emnist_split: one of `EMNIST_SPLITS` (``--emnist-split``).
      materialise: ``synthetic`` only: given the natural clients' sample counts, a bool per client
        whose features are generated (``RawDataset.written``); the others' rows stay zeros that
        take no memory. Default: every client.

    Returns:
      A `RawDataset`. Image datasets: ``x`` uint8 [n, H, W, C], ``input_scale = 2 / max_pixel``
      and ``input_shift = -1`` (pixels to [-1, 1]). ``synthetic``: ``x`` float32 [n, d], scale 1,
      shift 0, and ``client_ids`` set.

    Raises:
      ValueError: unknown ``name``, invalid option value, or a corrupt data file.
      DatasetNotFoundError: no readable copy found (and ``download`` off or impossible).
    """
    if name == "digits":
        return RawDataset(**_load_digits())
    if name == "synthetic":
        return RawDataset(
            **_generate_synthetic(
                alpha=synthetic_alpha,
                beta=synthetic_beta,
                num_clients=synthetic_clients,
                dim=synthetic_dim,
                seed=seed,
                materialise=materialise,
            )
        )
    if name not in _IMAGE_DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")
    if name == "emnist" and emnist_split not in EMNIST_SPLITS:
        raise OptionError(
            f"{arg('emnist_split', 'data')} must be one of {', '.join(EMNIST_SPLITS)}, got "
            f"{emnist_split!r}"
        )

    spec = _IMAGE_DATASETS[name]
    split = emnist_split if name == "emnist" else None
    data_dir = os.path.expanduser(data_dir) if data_dir else default_data_dir()
    tfds_dir = _resolve_tfds_dir(tfds_dir)
    notes: list[str] = []  # why each place we looked did not give the data; goes into the error

    # 1. A prepared TFDS copy.
    loaded = _from_prepared_tfds(spec, split, tfds_dir, merge_splits, notes)
    # 2. The original distribution files.
    if loaded is None:
        loaded = spec.load_files(spec, split, data_dir, merge_splits, notes)
    if loaded is not None:
        x, y, source = loaded
    elif download:
        # 3. TFDS download, only when asked for.
        x, y, source = _download_with_tfds(spec, split, data_dir, tfds_dir, merge_splits, notes)
    else:
        raise DatasetNotFoundError(_not_found_message(spec, split, data_dir, tfds_dir, notes))

    num_classes = EMNIST_SPLITS[split] if split else spec.num_classes
    _check_labels(y, num_classes, source)
    _log.info("loaded %s: %d samples from %s", name, len(y), source)
    return RawDataset(
        name=name,
        x=x,
        y=y,
        num_classes=num_classes,
        input_scale=2.0 / 255.0,
        input_shift=-1.0,
        client_ids=None,
        source=source,
    )


# ---------------------------------------------------------------------------------------------
# Image datasets: what each one is called, where its files live, how to read them.
# ---------------------------------------------------------------------------------------------


def _with_split(spec: _ImageSpec, split: str | None) -> str:
    return f"{spec.name} (split {split!r})" if split else spec.name


def _check_labels(y: np.ndarray, num_classes: int, source: str) -> None:
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(
            f"{source}: labels must lie in [0, {num_classes}), found [{y.min()}, {y.max()}]; "
            f"the file is corrupt or belongs to another dataset"
        )


_IMAGE_DATASETS: dict[str, _ImageSpec] = {
    "mnist": _ImageSpec(
        name="mnist",
        num_classes=10,
        tfds_name="mnist",
        load_files=_load_mnist_files,
        expected=_mnist_expected,
        url=(
            "https://ossci-datasets.s3.amazonaws.com/mnist/ "
            "(mirror of http://yann.lecun.com/exdb/mnist/)"
        ),
        probe=("storage.googleapis.com", 443),
    ),
    "fashion_mnist": _ImageSpec(
        name="fashion_mnist",
        num_classes=10,
        tfds_name="fashion_mnist",
        load_files=_load_mnist_files,
        expected=_mnist_expected,
        url="https://github.com/zalandoresearch/fashion-mnist",
        probe=("fashion-mnist.s3-website.eu-central-1.amazonaws.com", 80),
        extra_help=(
            "On Debian/Ubuntu, `apt-get install dataset-fashion-mnist` installs them in "
            f"{idx._DEBIAN_FASHION_MNIST_DIR}, which is searched too."
        ),
    ),
    "emnist": _ImageSpec(
        name="emnist",
        num_classes=47,  # replaced by EMNIST_SPLITS[split]
        tfds_name="emnist",
        load_files=_load_emnist_files,
        expected=_emnist_expected,
        url="https://www.nist.gov/itl/products-and-services/emnist-dataset",
        probe=("biometrics.nist.gov", 443),
    ),
    "cifar10": _ImageSpec(
        name="cifar10",
        num_classes=10,
        tfds_name="cifar10",
        load_files=_load_cifar_files,
        expected=_cifar_expected("cifar10"),
        url="https://www.cs.toronto.edu/~kriz/cifar.html (CIFAR-10 python version)",
        probe=("www.cs.toronto.edu", 443),
    ),
    "cifar100": _ImageSpec(
        name="cifar100",
        num_classes=100,
        tfds_name="cifar100",
        load_files=_load_cifar_files,
        expected=_cifar_expected("cifar100"),
        url="https://www.cs.toronto.edu/~kriz/cifar.html (CIFAR-100 python version)",
        probe=("www.cs.toronto.edu", 443),
    ),
}


# ---------------------------------------------------------------------------------------------
# Step 3: the TensorFlow Datasets download (--download).
# ---------------------------------------------------------------------------------------------


def _download_with_tfds(
    spec: _ImageSpec,
    split: str | None,
    data_dir: str,
    tfds_dir: str,
    merge_splits: bool,
    notes: list[str],
) -> _Loaded:
    """Step 3 (--download): TFDS downloads and prepares the dataset as array_record; we read it."""
    host, port = spec.probe
    if not _can_reach(host, port):
        notes.append(
            f"{arg('download', 'data')}: cannot reach {host}:{port} within {_PROBE_TIMEOUT_S:g} s "
            "(no network?)"
        )
        raise DatasetNotFoundError(_not_found_message(spec, split, data_dir, tfds_dir, notes))
    # Imported before the try: without TFDS installed, --download raises this ImportError as is.
    import tensorflow_datasets  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import

    full_name = _tfds_full_name(spec, split)
    _log.info("downloading %s with TFDS into %s", full_name, tfds_dir)
    try:
        return _download_and_read(spec, split, tfds_dir, merge_splits)
    except Exception as e:  # TFDS raises many error types; keep the cause chained
        notes.append(f"{arg('download', 'data')}: TFDS failed to download/prepare {full_name}: "
                     f"{e!r}")
        raise DatasetNotFoundError(
            _not_found_message(spec, split, data_dir, tfds_dir, notes)
        ) from e


# ---------------------------------------------------------------------------------------------
# The not-found message.
# ---------------------------------------------------------------------------------------------


def _searched_dirs(spec: _ImageSpec, split: str | None, data_dir: str) -> list[Path]:
    del split
    if spec.name in ("mnist", "fashion_mnist"):
        return _mnist_dirs(spec, data_dir)
    if spec.name == "emnist":
        return _emnist_dirs(data_dir)
    return [*_cifar_dirs(spec, data_dir), Path(data_dir)]  # data_dir itself: for the archive


def _not_found_message(
    spec: _ImageSpec, split: str | None, data_dir: str, tfds_dir: str, notes: Sequence[str]
) -> str:
    lines = [
        f"dataset {_with_split(spec, split)} not found. Searched, in order:",
        f"  TFDS data dir ({arg('tfds_dir', 'data')} / $TFDS_DATA_DIR): {tfds_dir}",
        *(f"  {d}" for d in _searched_dirs(spec, split, data_dir)),
        f"Expected files: {spec.expected(split)}.",
        f"Get them from {spec.url} and put them in {Path(data_dir) / spec.name}/ "
        f"(or pass {arg('data_dir', 'data')} DIR).",
    ]
    if spec.extra_help:
        lines.append(spec.extra_help)
    lines.append(
        f"Or pass {arg('download', 'data')} to let TensorFlow Datasets fetch and prepare "
        f"{_tfds_full_name(spec, split)} into {tfds_dir}."
    )
    lines.extend(f"Note: {note}" for note in notes)
    return "\n".join(lines)
