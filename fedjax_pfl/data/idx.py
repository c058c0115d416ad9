"""MNIST, Fashion-MNIST and EMNIST from their original IDX files (LeCun's format), gzipped or not.

Files read (step 2 of `sources.load_raw`'s lookup; the first folder holding the whole set wins):

* MNIST and Fashion-MNIST: ``train-images-idx3-ubyte.gz``, ``train-labels-idx1-ubyte.gz``,
  ``t10k-images-idx3-ubyte.gz``, ``t10k-labels-idx1-ubyte.gz`` in ``data_dir/<name>/``, then in
  ``data_dir/``, and for Fashion-MNIST then in Debian's ``/usr/share/datasets/fashion-mnist``
  (``apt-get install dataset-fashion-mnist``). They come from
  https://ossci-datasets.s3.amazonaws.com/mnist/ (a mirror of http://yann.lecun.com/exdb/mnist/)
  and https://github.com/zalandoresearch/fashion-mnist.
* EMNIST: ``emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte.gz``, the contents of
  NIST's ``gzip.zip`` (https://www.nist.gov/itl/products-and-services/emnist-dataset), in
  ``data_dir/emnist/``, ``data_dir/emnist/gzip/``, ``data_dir/`` or ``data_dir/gzip/``.

The same names without ``.gz`` also work: a file is gunzipped when it starts with the gzip magic.
EMNIST images are stored transposed and its ``letters`` labels start at 1; `_emnist_fix` (used by
`tfds_source` too) makes them upright and 0-based.
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np

from fedjax_pfl.data._raw_common import _find_file_set, _ImageSpec, _Loaded, _merge

# Debian/Ubuntu's `dataset-fashion-mnist` package installs the four original .gz files here.
# A module constant so tests can point it elsewhere (patch it here, in `idx`: `_mnist_dirs` reads it).
_DEBIAN_FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"

_MNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)


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


def _mnist_expected(split: str | None) -> str:
    del split
    return ", ".join(_MNIST_FILES) + " (the same names without .gz also work)"


def _emnist_expected(split: str | None) -> str:
    return (
        ", ".join(_emnist_files(split or "balanced"))
        + " (from gzip.zip: unzip it; the same names without .gz also work)"
    )
