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
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.resources
import logging
import os
import pickle
import socket
import tarfile
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

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


class DatasetNotFoundError(FileNotFoundError):
    """No readable copy of a dataset was found. The message lists where we looked and what to do."""


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

# Debian/Ubuntu's `dataset-fashion-mnist` package installs the four original .gz files here.
# A module constant so tests can point it elsewhere.
_DEBIAN_FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"

# The --download probe: TFDS retries an unreachable host for minutes, so we fail in seconds instead.
_PROBE_TIMEOUT_S = 3.0

# Synthetic(α, β): each client's sample count is lognormal(4, 2) + 50, whose tail is unbounded
# (e^(4 + 2·3) ≈ 22,000 at three sigma); we cap it so one client cannot dominate memory and time.
SYNTHETIC_MAX_SAMPLES_PER_CLIENT = 1000
_SYNTHETIC_NUM_CLASSES = 10

_MNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)


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

    Returns:
      A `RawDataset`. Image datasets: ``x`` uint8 [n, H, W, C], ``input_scale = 2 / max_pixel``
      and ``input_shift = -1`` (pixels to [-1, 1]). ``synthetic``: ``x`` float32 [n, d], scale 1,
      shift 0, and ``client_ids`` set.

    Raises:
      ValueError: unknown ``name``, invalid option value, or a corrupt data file.
      DatasetNotFoundError: no readable copy found (and ``download`` off or impossible).
    """
    if name == "digits":
        return _load_digits()
    if name == "synthetic":
        return _generate_synthetic(
            alpha=synthetic_alpha,
            beta=synthetic_beta,
            num_clients=synthetic_clients,
            dim=synthetic_dim,
            seed=seed,
        )
    if name not in _IMAGE_DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")
    if name == "emnist" and emnist_split not in EMNIST_SPLITS:
        raise ValueError(
            f"--emnist-split must be one of {', '.join(EMNIST_SPLITS)}, got {emnist_split!r}"
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
# digits and synthetic.
# ---------------------------------------------------------------------------------------------


def _load_digits() -> RawDataset:
    """The 1,797 8×8 digits (scikit-learn's copy of the UCI set), pixels 0..16, from the package"""
    resource = importlib.resources.files("fedjax_pfl.data").joinpath("digits.npz")
    with resource.open("rb") as f, np.load(f, allow_pickle=False) as npz:
        x = np.asarray(npz["x"], dtype=np.uint8)
        y = np.asarray(npz["y"], dtype=np.int32)
    return RawDataset(
        name="digits",
        x=x,
        y=y,
        num_classes=10,
        input_scale=2.0 / 16.0,
        input_shift=-1.0,
        client_ids=None,
        source="embedded: fedjax_pfl/data/digits.npz",
    )


def _generate_synthetic(
    *, alpha: float, beta: float, num_clients: int, dim: int, seed: int
) -> RawDataset:
    """Synthetic(α, β) of Li et al., "Federated Optimization in Heterogeneous Networks" (2020).

    For each client k: u_k ~ N(0, α), B_k ~ N(0, β); W_k ∈ R^{10×d} and b_k ∈ R^10 with entries
    ~ N(u_k, 1); v_k ∈ R^d with entries ~ N(B_k, 1); x ~ N(v_k, Σ), Σ = diag(j^(-1.2)), j = 1..d;
    y = argmax(W_k x + b_k). Client k has n_k = min(int(lognormal(4, 2)) + 50, 1000) samples; the
    cap is ours (see `SYNTHETIC_MAX_SAMPLES_PER_CLIENT`).

    α and β are variances, as in the paper's notation N(mean, variance); the authors' generator
    passes them to `np.random.normal` as standard deviations, which agrees for α, β ∈ {0, 1} only.
    Note that u_k shifts every logit of a sample by the same u_k·(Σ_j x_j + 1), so α changes no
    label: it only changes the (unobserved) W_k, b_k. Heterogeneity in the data comes from β.
    """
    for flag, value in (("--synthetic-alpha", alpha), ("--synthetic-beta", beta)):
        if not (np.isfinite(value) and value >= 0):
            raise ValueError(f"{flag} must be a finite variance >= 0, got {value!r}")
    if int(num_clients) != num_clients or num_clients < 1:
        raise ValueError(f"--synthetic-clients must be an integer >= 1, got {num_clients!r}")
    if int(dim) != dim or dim < 1:
        raise ValueError(f"--synthetic-dim must be an integer >= 1, got {dim!r}")
    num_clients, dim = int(num_clients), int(dim)

    rng = np.random.default_rng(seed)
    c = _SYNTHETIC_NUM_CLASSES
    feature_std = np.arange(1, dim + 1, dtype=np.float64) ** (-1.2 / 2)  # sqrt(Σ_jj)
    # Draw all sample counts first (as the reference generator does), then the clients one by one.
    counts = rng.lognormal(mean=4.0, sigma=2.0, size=num_clients).astype(np.int64) + 50
    counts = np.minimum(counts, SYNTHETIC_MAX_SAMPLES_PER_CLIENT)
    xs, ys = [], []
    for n_k in counts:
        # Means are drawn as sqrt(variance) · N(0, 1) and added to separately drawn unit normals,
        # so one seed gives the same underlying normals for every (α, β): only the shifts change.
        u_k = np.sqrt(alpha) * rng.standard_normal()
        b_mean_k = np.sqrt(beta) * rng.standard_normal()
        w_k = u_k + rng.standard_normal((c, dim))
        b_k = u_k + rng.standard_normal(c)
        v_k = b_mean_k + rng.standard_normal(dim)
        x_k = v_k + feature_std * rng.standard_normal((int(n_k), dim))
        # Logits in float64 so the labels do not depend on float32 rounding near ties.
        ys.append(np.argmax(x_k @ w_k.T + b_k, axis=1))
        xs.append(x_k)
    return RawDataset(
        name="synthetic",
        x=np.concatenate(xs).astype(np.float32),
        y=np.concatenate(ys).astype(np.int32),
        num_classes=c,
        input_scale=1.0,
        input_shift=0.0,
        client_ids=np.repeat(np.arange(num_clients, dtype=np.int32), counts),
        source=(
            f"generated: Synthetic(alpha={alpha:g}, beta={beta:g}), {num_clients} clients, "
            f"d={dim}, seed={seed}"
        ),
    )


# ---------------------------------------------------------------------------------------------
# Image datasets: what each one is called, where its files live, how to read them.
# ---------------------------------------------------------------------------------------------

# (x uint8 NHWC, y int32, source description), or None when a lookup step found nothing.
_Loaded = tuple[np.ndarray, np.ndarray, str]
_FileLoader = Callable[["_ImageSpec", "str | None", str, bool, list[str]], "_Loaded | None"]


@dataclasses.dataclass(frozen=True)
class _ImageSpec:
    name: str
    num_classes: int
    tfds_name: str  # "emnist" gets "/<split>" appended
    load_files: _FileLoader  # step 2 of the lookup
    expected: Callable[[str | None], str]  # the file names step 2 wants, for the error message
    url: str  # where a person downloads the original files
    probe: tuple[str, int]  # the host TFDS downloads from, for the --download probe
    extra_help: str = ""


def _with_split(spec: _ImageSpec, split: str | None) -> str:
    return f"{spec.name} (split {split!r})" if split else spec.name


def _check_labels(y: np.ndarray, num_classes: int, source: str) -> None:
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(
            f"{source}: labels must lie in [0, {num_classes}), found [{y.min()}, {y.max()}]; "
            f"the file is corrupt or belongs to another dataset"
        )


def _merge(
    train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray] | None
) -> tuple[np.ndarray, np.ndarray]:
    if test is None:
        return train
    return np.concatenate([train[0], test[0]]), np.concatenate([train[1], test[1]])


# --- IDX files (MNIST, Fashion-MNIST, EMNIST) -------------------------------------------------


def _read_bytes(path: Path) -> bytes:
    """The file's content, gunzipped when it starts with the gzip magic (whatever its name says)."""
    raw = path.read_bytes()
    if raw[:2] != b"\x1f\x8b":
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"{path}: corrupt or truncated gzip file ({e}); download it again") from e


def _read_idx(path: Path, ndim: int) -> np.ndarray:
    """Parses an IDX file holding uint8 data of rank ``ndim`` (LeCun's MNIST format).

    Layout: magic = 0x00 0x00 0x08 (uint8) ``ndim``; then ``ndim`` big-endian uint32 sizes; then the
    data in row-major order. Images have magic 0x00000803, labels 0x00000801.
    """
    data = _read_bytes(path)
    expected_magic = bytes([0, 0, 0x08, ndim])
    if data[:4] != expected_magic:
        raise ValueError(
            f"{path}: not an IDX file of rank-{ndim} uint8 data (magic {data[:4].hex()}, "
            f"expected {expected_magic.hex()}); the file is corrupt or not the one expected"
        )
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{path}: truncated IDX header ({len(data)} bytes); download it again")
    shape = tuple(int(s) for s in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    size = int(np.prod(shape, dtype=np.int64))
    if len(data) - header != size:
        raise ValueError(
            f"{path}: IDX header says shape {shape} ({size} bytes of data) but the file has "
            f"{len(data) - header}; it is truncated or corrupt, download it again"
        )
    # A copy: frombuffer views the immutable bytes, and callers may want to write to the arrays.
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape).copy()


def _find_file(directory: Path, name: str) -> Path | None:
    """``name`` (a .gz file name) in ``directory``, or its gunzipped twin, or None."""
    for candidate in (name, name.removesuffix(".gz")):
        if (directory / candidate).is_file():
            return directory / candidate
    return None


def _find_file_set(
    directories: Sequence[Path], names: Sequence[str], notes: list[str]
) -> list[Path] | None:
    """The first directory holding every file in ``names``; notes any partial copy on the way."""
    for directory in directories:
        found = [_find_file(directory, n) for n in names]
        if all(found):
            return found  # type: ignore[return-value]
        if any(found):
            missing = [n for n, f in zip(names, found) if f is None]
            notes.append(f"{directory} has only part of the files; missing: {', '.join(missing)}")
    return None


def _read_idx_pair(images: Path, labels: Path) -> tuple[np.ndarray, np.ndarray]:
    x = _read_idx(images, ndim=3)
    y = _read_idx(labels, ndim=1)
    if len(x) != len(y):
        raise ValueError(f"{images} has {len(x)} images but {labels} has {len(y)} labels")
    return x[..., None], y.astype(np.int32)  # [n, H, W] -> NHWC with C = 1


def _mnist_dirs(spec: _ImageSpec, data_dir: str) -> list[Path]:
    dirs = [Path(data_dir) / spec.name, Path(data_dir)]
    if spec.name == "fashion_mnist":
        dirs.append(Path(_DEBIAN_FASHION_MNIST_DIR))
    return dirs


def _load_mnist_files(
    spec: _ImageSpec, split: str | None, data_dir: str, merge_splits: bool, notes: list[str]
) -> _Loaded | None:
    """MNIST / Fashion-MNIST from the four original IDX files."""
    del split
    paths = _find_file_set(_mnist_dirs(spec, data_dir), _MNIST_FILES, notes)
    if paths is None:
        return None
    train = _read_idx_pair(paths[0], paths[1])
    test = _read_idx_pair(paths[2], paths[3]) if merge_splits else None
    x, y = _merge(train, test)
    return x, y, str(paths[0].parent)


def _emnist_dirs(data_dir: str) -> list[Path]:
    # data_dir/gzip/ is where unzipping NIST's gzip.zip in data_dir puts the files.
    root = Path(data_dir)
    return [root / "emnist", root / "emnist" / "gzip", root, root / "gzip"]


def _emnist_files(split: str) -> tuple[str, ...]:
    return tuple(
        f"emnist-{split}-{part}-{kind}-idx{rank}-ubyte.gz"
        for part in ("train", "test")
        for kind, rank in (("images", 3), ("labels", 1))
    )


def _emnist_fix(
    x: np.ndarray, y: np.ndarray, split: str, source: str
) -> tuple[np.ndarray, np.ndarray]:
    """EMNIST as distributed (files and TFDS alike) -> upright images and 0-based labels.

    NIST stores each EMNIST image transposed (column-major); swapping H and W makes it upright like
    MNIST. The ``letters`` split labels a..z as 1..26; we shift them to 0..25.
    """
    x = np.ascontiguousarray(np.swapaxes(x, 1, 2))
    if split == "letters":
        if y.size and y.min() < 1:
            raise ValueError(f"{source}: EMNIST letters labels must be 1..26, found {y.min()}")
        y = y - 1
    return x, y


def _load_emnist_files(
    spec: _ImageSpec, split: str | None, data_dir: str, merge_splits: bool, notes: list[str]
) -> _Loaded | None:
    """EMNIST ``split`` from NIST's "gzip" distribution (the contents of gzip.zip)."""
    assert split is not None
    paths = _find_file_set(_emnist_dirs(data_dir), _emnist_files(split), notes)
    if paths is None:
        return None
    train = _read_idx_pair(paths[0], paths[1])
    test = _read_idx_pair(paths[2], paths[3]) if merge_splits else None
    x, y = _merge(train, test)
    source = str(paths[0].parent)
    x, y = _emnist_fix(x, y, split, source)
    return x, y, source


# --- CIFAR python pickles --------------------------------------------------------------------


def _cifar_layout(name: str) -> tuple[str, str, tuple[str, ...], tuple[str, ...], bytes]:
    """(folder, archive, train members, test members, label key) of a CIFAR python distribution."""
    if name == "cifar10":
        train = tuple(f"data_batch_{i}" for i in range(1, 6))
        return "cifar-10-batches-py", "cifar-10-python.tar.gz", train, ("test_batch",), b"labels"
    return "cifar-100-python", "cifar-100-python.tar.gz", ("train",), ("test",), b"fine_labels"


def _cifar_dirs(spec: _ImageSpec, data_dir: str) -> list[Path]:
    """Folders that may hold the extracted batches (the archive is looked for separately)."""
    folder = _cifar_layout(spec.name)[0]
    root = Path(data_dir)
    return [root / spec.name / folder, root / folder, root / spec.name]


def _decode_cifar_batch(
    batch: object, label_key: bytes, where: str
) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR pickle dict -> (uint8 [n, 32, 32, 3], int32 [n])."""
    if not isinstance(batch, dict) or b"data" not in batch or label_key not in batch:
        raise ValueError(
            f"{where}: not a CIFAR python batch (expected a dict with b'data' and {label_key!r})"
        )
    data = np.asarray(batch[b"data"])
    labels = np.asarray(batch[label_key])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise ValueError(f"{where}: b'data' must be uint8 [n, 3072], got {data.dtype} {data.shape}")
    if labels.shape != (len(data),):
        raise ValueError(f"{where}: {len(data)} images but labels of shape {labels.shape}")
    # Each row is the red plane, then green, then blue, each 32×32 row-major: CHW -> HWC.
    x = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(x), labels.astype(np.int32)


class UnsafePickleError(ValueError):
    """A pickle asked for something a CIFAR batch never holds (a function, a class of its own):
    loading it would run code from the data file, so it is refused before anything runs."""


def _latin1_encode(text: str, encoding: str = "utf-8") -> bytes:
    """`_codecs.encode` as Python 3 pickles bytes at protocol 2 (text, 'latin1'); no other codec."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode with {encoding!r} (only latin1 is admitted)")
    return text.encode("latin1")


def _numpy_reconstruct() -> Callable:
    try:  # NumPy >= 2 keeps it in numpy._core; NumPy 1.x pickles name numpy.core
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # pragma: no cover (NumPy 1.x)
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


def _numpy_frombuffer() -> Callable:
    try:
        from numpy._core.numeric import _frombuffer
    except ImportError:  # pragma: no cover (NumPy 1.x)
        from numpy.core.numeric import _frombuffer
    return _frombuffer


# Everything a CIFAR python batch (or the same dict pickled again by Python 3 at any protocol)
# refers to by name: NumPy's array and dtype reconstructors, builtin containers, and bytes as
# Python 3 writes them at protocol 2. (module, name) -> the object, looked up here, never imported
# by the name the file gives. Dicts, lists, tuples, str, bytes and numbers need no name at all.
_ALLOWED_GLOBALS: dict[tuple[str, str], Callable[[], object]] = {
    **{(module, "_reconstruct"): _numpy_reconstruct
       for module in ("numpy.core.multiarray", "numpy._core.multiarray")},
    **{(module, "_frombuffer"): _numpy_frombuffer
       for module in ("numpy.core.numeric", "numpy._core.numeric")},
    ("numpy", "ndarray"): lambda: np.ndarray,
    ("numpy", "dtype"): lambda: np.dtype,
    ("_codecs", "encode"): lambda: _latin1_encode,
    **{(module, name): (lambda obj=obj: obj)
       for module in ("builtins", "__builtin__")
       for name, obj in (("set", set), ("frozenset", frozenset), ("list", list), ("dict", dict),
                         ("tuple", tuple), ("bytes", bytes), ("bytearray", bytearray),
                         ("str", str), ("unicode", str), ("int", int), ("long", int),
                         ("float", float), ("bool", bool))},
}


class _CifarUnpickler(pickle.Unpickler):
    """An unpickler that admits only what CIFAR's python batches contain (`_ALLOWED_GLOBALS`).

    A pickle runs code through the callables it names (GLOBAL / STACK_GLOBAL, and the copyreg
    extension codes, which also resolve through `find_class`) and then calls with REDUCE, so
    refusing every other name here means nothing from the file is ever called but NumPy's array
    reconstruction and builtin constructors. Persistent ids are refused by the base class.
    """

    def __init__(self, file, where: str):
        # encoding="bytes": the batches were written by Python 2, and their str keys stay bytes.
        super().__init__(file, encoding="bytes")
        self.where = where

    def find_class(self, module: str, name: str) -> object:
        found = _ALLOWED_GLOBALS.get((module, name))
        if found is None:
            raise UnsafePickleError(
                f"{self.where}: refused to unpickle {module}.{name}: a CIFAR batch holds only "
                "NumPy arrays, dtypes and builtin containers, so this file is not one (it could "
                "run code); replace it with the original download"
            )
        return found()


def _unpickle(f, where: str) -> object:
    """One CIFAR batch, read by `_CifarUnpickler` (never plain `pickle.load`)."""
    try:
        return _CifarUnpickler(f, where).load()
    except UnsafePickleError:
        raise
    except Exception as e:  # pickle raises many types on bad input
        raise ValueError(f"{where}: corrupt or truncated pickle ({e!r}); download it again") from e


def _load_cifar_files(
    spec: _ImageSpec, split: str | None, data_dir: str, merge_splits: bool, notes: list[str]
) -> _Loaded | None:
    """CIFAR-10/100, python version: an extracted folder, else the .tar.gz read in memory."""
    del split
    folder, archive, train_names, test_names, label_key = _cifar_layout(spec.name)
    wanted = train_names + test_names if merge_splits else train_names
    root = Path(data_dir)
    paths = _find_file_set(_cifar_dirs(spec, data_dir), train_names + test_names, notes)
    batches: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    if paths is not None:
        source = str(paths[0].parent)
        for path in paths:
            if path.name in wanted:
                with open(path, "rb") as f:
                    batches[path.name] = _decode_cifar_batch(
                        _unpickle(f, str(path)), label_key, str(path)
                    )
    else:
        tar_path = next(
            (p for p in (root / spec.name / archive, root / archive) if p.is_file()), None
        )
        if tar_path is None:
            return None
        source = str(tar_path)
        # One sequential pass: random access into a .tar.gz decompresses from the start each time.
        try:
            with tarfile.open(tar_path, "r:*") as tar:
                for member in tar:
                    base = member.name.rsplit("/", 1)[-1]
                    if member.isfile() and base in wanted and base not in batches:
                        where = f"{tar_path}:{member.name}"
                        batch = _unpickle(tar.extractfile(member), where)
                        batches[base] = _decode_cifar_batch(batch, label_key, where)
        except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
            raise ValueError(
                f"{tar_path}: corrupt or truncated archive ({e}); download it again"
            ) from e
        missing = [n for n in wanted if n not in batches]
        if missing:
            raise ValueError(
                f"{tar_path}: archive lacks {', '.join(missing)}; it is truncated or not {archive}"
            )
    ordered = [batches[n] for n in wanted]  # train batches in order, then test
    x = np.concatenate([b[0] for b in ordered])
    y = np.concatenate([b[1] for b in ordered])
    return x, y, source


# --- The registry -----------------------------------------------------------------------------


def _mnist_expected(split: str | None) -> str:
    del split
    return ", ".join(_MNIST_FILES) + " (the same names without .gz also work)"


def _emnist_expected(split: str | None) -> str:
    return (
        ", ".join(_emnist_files(split or "balanced"))
        + " (from gzip.zip: unzip it; the same names without .gz also work)"
    )


def _cifar_expected(name: str) -> Callable[[str | None], str]:
    folder, archive, train, test, _ = _cifar_layout(name)
    members = ", ".join(train + test)
    return lambda split: f"the folder {folder}/ with {members}, or the archive {archive}"


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
            f"{_DEBIAN_FASHION_MNIST_DIR}, which is searched too."
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
# TensorFlow Datasets.
# ---------------------------------------------------------------------------------------------


def _resolve_tfds_dir(tfds_dir: str | None) -> str:
    if tfds_dir:
        return os.path.expanduser(tfds_dir)
    env = os.environ.get("TFDS_DATA_DIR")
    if env:
        return os.path.expanduser(env)
    return os.path.join(os.path.expanduser("~"), "tensorflow_datasets")


def _tfds_full_name(spec: _ImageSpec, split: str | None) -> str:
    return f"{spec.tfds_name}/{split}" if split else spec.tfds_name


def _tensorflow_importable() -> bool:
    try:
        import tensorflow  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    except ImportError:
        return False
    return True


def _read_tfds_split(builder, split_name: str) -> tuple[np.ndarray, np.ndarray]:
    """All (image, label) pairs of one split of a prepared builder, as uint8 NHWC and int32."""
    import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

    random_access = tfds.core.file_adapters.FileFormat.with_random_access()
    if builder.info.available_file_formats() & set(random_access):
        # array_record: a random-access source that decodes with NumPy/PIL, no TensorFlow needed.
        source = builder.as_data_source(split=split_name)
        n = len(source)
        images = np.empty((n, *builder.info.features["image"].shape), dtype=np.uint8)
        labels = np.empty((n,), dtype=np.int32)
        chunk = 4096
        for start in range(0, n, chunk):
            keys = list(range(start, min(start + chunk, n)))
            if hasattr(source, "__getitems__"):
                examples = source.__getitems__(keys)  # one batched read instead of n
            else:
                examples = [source[i] for i in keys]
            for offset, example in enumerate(examples):
                images[start + offset] = example["image"]
                labels[start + offset] = example["label"]  # cifar100: 'label' is the fine label
        return images, labels
    # tfrecord: only TensorFlow can read it; the caller checked that it is importable.
    data = tfds.as_numpy(builder.as_dataset(split=split_name, batch_size=-1))
    return np.asarray(data["image"], dtype=np.uint8), np.asarray(data["label"], dtype=np.int32)


def _read_tfds(builder, spec: _ImageSpec, split: str | None, merge_splits: bool) -> _Loaded:
    train = _read_tfds_split(builder, "train")
    test = _read_tfds_split(builder, "test") if merge_splits else None
    x, y = _merge(train, test)
    source = f"TFDS {builder.data_dir}"
    if spec.name == "emnist":
        x, y = _emnist_fix(x, y, split or "", source)  # TFDS keeps NIST's transposed layout
    return x, y, source


def _from_prepared_tfds(
    spec: _ImageSpec, split: str | None, tfds_dir: str, merge_splits: bool, notes: list[str]
) -> _Loaded | None:
    """Step 1: read an already-prepared TFDS copy; never downloads."""
    full_name = _tfds_full_name(spec, split)
    # TFDS keeps a dataset in <data_dir>/<name>[/<config>]/<version>/. Checking the folder first
    # skips importing TFDS (and its warnings about empty folders) when there is nothing to read.
    if not (Path(tfds_dir) / full_name).is_dir():
        return None
    import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

    builder = tfds.builder(full_name, data_dir=tfds_dir)
    if not builder.is_prepared():
        notes.append(
            f"TFDS data dir {tfds_dir} has {full_name}/ but no prepared version {builder.version}"
        )
        return None
    random_access = set(tfds.core.file_adapters.FileFormat.with_random_access())
    if not builder.info.available_file_formats() & random_access and not _tensorflow_importable():
        notes.append(
            f"TFDS copy {builder.data_dir} is in {builder.info.file_format.value} format, which needs "
            "TensorFlow (not installed); install tensorflow, re-prepare it with "
            "file_format='array_record', or put the original files in --data-dir"
        )
        _log.warning("skipping %s: %s", builder.data_dir, notes[-1])
        return None
    return _read_tfds(builder, spec, split, merge_splits)


def _can_reach(host: str, port: int, timeout: float = _PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to host:port opens within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


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
            f"--download: cannot reach {host}:{port} within {_PROBE_TIMEOUT_S:g} s (no network?)"
        )
        raise DatasetNotFoundError(_not_found_message(spec, split, data_dir, tfds_dir, notes))
    import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

    full_name = _tfds_full_name(spec, split)
    _log.info("downloading %s with TFDS into %s", full_name, tfds_dir)
    try:
        builder = tfds.builder(full_name, data_dir=tfds_dir, file_format="array_record")
        builder.download_and_prepare(file_format="array_record")
        return _read_tfds(builder, spec, split, merge_splits)
    except Exception as e:  # TFDS raises many error types; keep the cause chained
        notes.append(f"--download: TFDS failed to download/prepare {full_name}: {e!r}")
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
        f"  TFDS data dir (--tfds-dir / $TFDS_DATA_DIR): {tfds_dir}",
        *(f"  {d}" for d in _searched_dirs(spec, split, data_dir)),
        f"Expected files: {spec.expected(split)}.",
        f"Get them from {spec.url} and put them in {Path(data_dir) / spec.name}/ "
        f"(or pass --data-dir DIR).",
    ]
    if spec.extra_help:
        lines.append(spec.extra_help)
    lines.append(
        f"Or pass --download to let TensorFlow Datasets fetch and prepare "
        f"{_tfds_full_name(spec, split)} into {tfds_dir}."
    )
    lines.extend(f"Note: {note}" for note in notes)
    return "\n".join(lines)
