"""MNIST, Fashion-MNIST, EMNIST and CIFAR from TensorFlow Datasets (TFDS), and the --download probe.

Read (step 1 of `sources.load_raw`'s lookup): an already-prepared TFDS copy in ``tfds_dir``
(``--tfds-dir``, else ``$TFDS_DATA_DIR``, else ``~/tensorflow_datasets``), i.e. the folder
``<tfds_dir>/<name>[/<split>]/<version>/`` that ``tfds.builder(...).download_and_prepare()`` writes.
array_record copies are read with NumPy/PIL through TFDS's random-access source; tfrecord copies
need TensorFlow, and are skipped with a note when it is not installed. This step never downloads.

Written and then read (step 3, only with ``--download``): `_download_and_read` lets TFDS fetch the
dataset from its usual servers and prepare it as array_record into ``tfds_dir``; `sources` calls it
only after `_can_reach` has opened a TCP connection to the download host within
`_PROBE_TIMEOUT_S` seconds.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import numpy as np

from fedjax_pfl.data._raw_common import _ImageSpec, _Loaded, _merge
from fedjax_pfl.data.idx import _emnist_fix
from fedjax_pfl.errors import arg, render

_log = logging.getLogger(__name__)

# The --download probe: TFDS retries an unreachable host for minutes, so we fail in seconds instead.
_PROBE_TIMEOUT_S = 3.0


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
            f"file_format='array_record', or put the original files in {arg('data_dir', 'data')}"
        )
        _log.warning("skipping %s: %s", builder.data_dir, render(notes[-1]))
        return None
    return _read_tfds(builder, spec, split, merge_splits)


def _can_reach(host: str, port: int, timeout: float = _PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to host:port opens within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _download_and_read(
    spec: _ImageSpec, split: str | None, tfds_dir: str, merge_splits: bool
) -> _Loaded:
    """TFDS downloads and prepares the dataset as array_record into ``tfds_dir``; we read it.

    The network part of step 3; `sources._download_with_tfds` probes first and turns any error
    raised here into `DatasetNotFoundError`.
    """
    import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

    full_name = _tfds_full_name(spec, split)
    builder = tfds.builder(full_name, data_dir=tfds_dir, file_format="array_record")
    builder.download_and_prepare(file_format="array_record")
    return _read_tfds(builder, spec, split, merge_splits)
