"""CIFAR-10 and CIFAR-100 from their "python version" distributions, read without running code.

Files read (step 2 of `sources.load_raw`'s lookup), from https://www.cs.toronto.edu/~kriz/cifar.html:

* CIFAR-10: ``data_batch_1`` … ``data_batch_5`` and ``test_batch``, extracted, in
  ``data_dir/cifar10/cifar-10-batches-py/``, ``data_dir/cifar-10-batches-py/`` or
  ``data_dir/cifar10/``; else the archive ``cifar-10-python.tar.gz`` in ``data_dir/cifar10/`` or
  ``data_dir/``, read in memory in one sequential pass.
* CIFAR-100: ``train`` and ``test`` (fine labels), the same way with ``cifar100``,
  ``cifar-100-python/`` and ``cifar-100-python.tar.gz``.

Each batch is a Python 2 pickle of a dict. It is read by `_CifarUnpickler`, which admits only NumPy
arrays, dtypes and builtin containers (`_ALLOWED_GLOBALS`): a crafted batch that names anything
else raises `UnsafePickleError` before any of it runs.
"""

from __future__ import annotations

import pickle
import tarfile
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fedjax_pfl.data._raw_common import _find_file_set, _ImageSpec, _Loaded


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
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    return _reconstruct


def _numpy_frombuffer() -> Callable:
    try:
        from numpy._core.numeric import _frombuffer
    except ImportError:  # pragma: no cover (NumPy 1.x)
        from numpy.core.numeric import _frombuffer  # type: ignore[no-redef]
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


def _cifar_expected(name: str) -> Callable[[str | None], str]:
    folder, archive, train, test, _ = _cifar_layout(name)
    members = ", ".join(train + test)
    return lambda split: f"the folder {folder}/ with {members}, or the archive {archive}"
