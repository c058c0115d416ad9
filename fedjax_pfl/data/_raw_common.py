"""What the raw image-file readers share: the registry entry `_ImageSpec`, the `_Loaded` triple
every lookup step returns, finding a set of files among candidate folders, and train+test merging.

Reads no file itself. Used by `idx` (MNIST, Fashion-MNIST, EMNIST), `cifar_pickle` (CIFAR),
`tfds_source` (TensorFlow Datasets) and by `sources`, whose `load_raw` dispatches between them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

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


def _merge(
    train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray] | None
) -> tuple[np.ndarray, np.ndarray]:
    if test is None:
        return train
    return np.concatenate([train[0], test[0]]), np.concatenate([train[1], test[1]])


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
