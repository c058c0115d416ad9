"""Tests for fedjax_pfl.data.sources.

There is no network here, so every loader reads small files that the tests write in the real
formats (IDX, CIFAR pickles and tarballs, a prepared TFDS array_record directory). Expected values
come from the arrays we wrote and from the format definitions, not from the loader.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import shutil
import struct
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import run as cli  # noqa: E402  (experiments/run.py: how the command line says the names)

from fedjax_pfl.data import idx, sources
from fedjax_pfl.data.sources import DATASETS, DatasetNotFoundError, RawDataset, load_raw
from fedjax_pfl.errors import spelled

N_TRAIN, N_TEST = 12, 5
_REAL_DEBIAN_DIR = idx._DEBIAN_FASHION_MNIST_DIR


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Keeps every test away from data installed here (~/tensorflow_datasets, Debian's copy)."""
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "no_tfds"))
    monkeypatch.setenv("FEDJAX_PFL_DATA_DIR", str(tmp_path / "no_data"))
    monkeypatch.setattr(idx, "_DEBIAN_FASHION_MNIST_DIR", str(tmp_path / "no_debian"))


# ---------------------------------------------------------------------------------------------
# Writers for the real file formats.
# ---------------------------------------------------------------------------------------------


def idx_bytes(arr: np.ndarray) -> bytes:
    """IDX: 0x00 0x00 0x08(uint8) ndim, then big-endian uint32 sizes, then the data row-major."""
    assert arr.dtype == np.uint8
    return bytes([0, 0, 8, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()


def write_idx(path: Path, arr: np.ndarray, gz: bool = True) -> Path:
    data = idx_bytes(arr)
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


def random_split(rng, n, h=28, w=28, c=None, num_classes=10, low=0):
    shape = (n, h, w) if c is None else (n, h, w, c)
    return rng.integers(0, 256, shape, dtype=np.uint8), rng.integers(
        low, low + num_classes, n
    ).astype(np.uint8)


def write_mnist_like(directory: Path, seed=0, gz=True, prefix="", num_classes=10, label_low=0):
    """Writes the four IDX files; returns (x_train, y_train, x_test, y_test), images [n, 28, 28]."""
    rng = np.random.default_rng(seed)
    xtr, ytr = random_split(rng, N_TRAIN, num_classes=num_classes, low=label_low)
    xte, yte = random_split(rng, N_TEST, num_classes=num_classes, low=label_low)
    test_part = "test" if prefix else "t10k"  # EMNIST says "test", (Fashion-)MNIST "t10k"
    write_idx(directory / f"{prefix}train-images-idx3-ubyte", xtr, gz)
    write_idx(directory / f"{prefix}train-labels-idx1-ubyte", ytr, gz)
    write_idx(directory / f"{prefix}{test_part}-images-idx3-ubyte", xte, gz)
    write_idx(directory / f"{prefix}{test_part}-labels-idx1-ubyte", yte, gz)
    return xtr, ytr, xte, yte


def cifar_batch(x_nhwc: np.ndarray, labels: np.ndarray, label_key: bytes, extra=None) -> dict:
    """A CIFAR python batch: each b'data' row is the R, G, then B plane, each 32×32 row-major."""
    data = x_nhwc.transpose(0, 3, 1, 2).reshape(len(x_nhwc), 3072)
    batch = {b"data": data, label_key: [int(v) for v in labels], b"batch_label": b"test"}
    batch.update(extra or {})
    return batch


def write_cifar10(
    directory: Path, seed=0, sizes=(3, 2, 4, 1, 2), n_test=3, archive: Path | None = None
):
    """cifar-10-batches-py members; written to `directory`, or into the .tar.gz `archive`."""
    rng = np.random.default_rng(seed)
    members, xs, ys = {}, [], []
    for i, n in enumerate((*sizes, n_test)):
        x = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
        y = rng.integers(0, 10, n)
        name = f"data_batch_{i + 1}" if i < len(sizes) else "test_batch"
        members[name] = pickle.dumps(cifar_batch(x, y, b"labels"), protocol=2)
        xs.append(x)
        ys.append(y)
    _write_members(directory, "cifar-10-batches-py", members, archive)
    n_train = sum(sizes)
    x, y = np.concatenate(xs), np.concatenate(ys)
    return x, y, n_train


def write_cifar100(directory: Path, seed=0, n_train=7, n_test=4, archive: Path | None = None):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (n_train + n_test, 32, 32, 3), dtype=np.uint8)
    fine = rng.integers(20, 100, n_train + n_test)  # >= 20, so never a valid coarse label
    coarse = fine % 20
    members = {}
    for name, sl in (("train", slice(0, n_train)), ("test", slice(n_train, None))):
        extra = {b"coarse_labels": [int(v) for v in coarse[sl]]}
        members[name] = pickle.dumps(
            cifar_batch(x[sl], fine[sl], b"fine_labels", extra), protocol=2
        )
    members["meta"] = pickle.dumps({b"fine_label_names": []})
    _write_members(directory, "cifar-100-python", members, archive)
    return x, fine, n_train


def _write_members(directory: Path, folder: str, members: dict[str, bytes], archive: Path | None):
    if archive is None:
        directory.mkdir(parents=True, exist_ok=True)
        for name, data in members.items():
            (directory / name).write_bytes(data)
        return
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(f"{folder}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


# ---------------------------------------------------------------------------------------------
# General API.
# ---------------------------------------------------------------------------------------------


def test_datasets_and_unknown_name():
    assert DATASETS == (
        "digits",
        "synthetic",
        "mnist",
        "fashion_mnist",
        "emnist",
        "cifar10",
        "cifar100",
    )
    with pytest.raises(ValueError, match="unknown dataset 'imagenet'.*digits, synthetic, mnist"):
        load_raw("imagenet")


def test_default_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FEDJAX_PFL_DATA_DIR", str(tmp_path / "custom"))
    assert sources.default_data_dir() == str(tmp_path / "custom")
    monkeypatch.delenv("FEDJAX_PFL_DATA_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert sources.default_data_dir() == str(tmp_path / "home" / "fedjax_pfl_data")


def test_dataset_not_found_error_is_a_file_not_found_error():
    assert issubclass(DatasetNotFoundError, FileNotFoundError)


# ---------------------------------------------------------------------------------------------
# digits.
# ---------------------------------------------------------------------------------------------


def test_digits():
    ds = load_raw("digits", data_dir="/nonexistent")  # embedded: no directory is consulted
    assert isinstance(ds, RawDataset)
    assert ds.x.shape == (1797, 8, 8, 1) and ds.x.dtype == np.uint8
    assert ds.y.shape == (1797,) and ds.y.dtype == np.int32
    assert ds.num_classes == 10 and set(np.unique(ds.y)) == set(range(10))
    assert ds.x.max() == 16 and ds.x.min() == 0
    assert ds.input_scale == pytest.approx(2 / 16) and ds.input_shift == -1.0
    scaled = ds.x.astype(np.float32) * ds.input_scale + ds.input_shift
    assert scaled.min() == -1.0 and scaled.max() == 1.0
    assert ds.client_ids is None and "embedded" in ds.source
    # merge_splits has no meaning for digits (no official split).
    assert load_raw("digits", merge_splits=False).x.shape == ds.x.shape


# ---------------------------------------------------------------------------------------------
# MNIST and Fashion-MNIST (IDX files).
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mnist", "fashion_mnist"])
@pytest.mark.parametrize("gz", [True, False], ids=["gz", "raw"])
@pytest.mark.parametrize("in_subdir", [True, False], ids=["subdir", "root"])
def test_mnist_like_idx_files(tmp_path, name, gz, in_subdir):
    where = tmp_path / "data" / name if in_subdir else tmp_path / "data"
    xtr, ytr, xte, yte = write_mnist_like(where, seed=3, gz=gz)
    ds = load_raw(name, data_dir=str(tmp_path / "data"))
    assert ds.name == name and ds.num_classes == 10
    assert ds.x.shape == (N_TRAIN + N_TEST, 28, 28, 1) and ds.x.dtype == np.uint8
    assert ds.y.dtype == np.int32
    # Train first, then test; C = 1 appended.
    np.testing.assert_array_equal(ds.x[:N_TRAIN, :, :, 0], xtr)
    np.testing.assert_array_equal(ds.x[N_TRAIN:, :, :, 0], xte)
    np.testing.assert_array_equal(ds.y, np.concatenate([ytr, yte]))
    assert ds.input_scale == pytest.approx(2 / 255) and ds.input_shift == -1.0
    assert ds.client_ids is None
    assert ds.source == str(where)


def test_merge_splits_false_returns_train_only(tmp_path):
    xtr, ytr, _, _ = write_mnist_like(tmp_path / "mnist", seed=1)
    ds = load_raw("mnist", data_dir=str(tmp_path), merge_splits=False)
    assert ds.x.shape == (N_TRAIN, 28, 28, 1)
    assert ds.x.flags.writeable and ds.y.flags.writeable  # not views of the file's bytes
    np.testing.assert_array_equal(ds.x[..., 0], xtr)
    np.testing.assert_array_equal(ds.y, ytr)


def test_default_data_dir_is_used(tmp_path, monkeypatch):
    xtr, *_ = write_mnist_like(tmp_path / "env_data" / "mnist", seed=2)
    monkeypatch.setenv("FEDJAX_PFL_DATA_DIR", str(tmp_path / "env_data"))
    np.testing.assert_array_equal(load_raw("mnist").x[:N_TRAIN, ..., 0], xtr)


def test_subdir_wins_over_root(tmp_path):
    xtr_sub, *_ = write_mnist_like(tmp_path / "mnist", seed=4)
    write_mnist_like(tmp_path, seed=5)
    np.testing.assert_array_equal(
        load_raw("mnist", data_dir=str(tmp_path)).x[:N_TRAIN, ..., 0], xtr_sub
    )


def test_fashion_mnist_from_debian_dir_and_data_dir_priority(tmp_path, monkeypatch):
    debian = tmp_path / "usr_share"
    xtr_deb, *_ = write_mnist_like(debian, seed=6)
    monkeypatch.setattr(idx, "_DEBIAN_FASHION_MNIST_DIR", str(debian))
    ds = load_raw("fashion_mnist", data_dir=str(tmp_path / "empty"))
    np.testing.assert_array_equal(ds.x[:N_TRAIN, ..., 0], xtr_deb)
    assert ds.source == str(debian)
    # A copy in data_dir is found first.
    xtr_mine, *_ = write_mnist_like(tmp_path / "mine" / "fashion_mnist", seed=7)
    ds = load_raw("fashion_mnist", data_dir=str(tmp_path / "mine"))
    np.testing.assert_array_equal(ds.x[:N_TRAIN, ..., 0], xtr_mine)
    # MNIST never looks in the Fashion-MNIST directory.
    with pytest.raises(DatasetNotFoundError):
        load_raw("mnist", data_dir=str(tmp_path / "empty"))


# --- Corrupt files ---------------------------------------------------------------------------


def _corrupt(tmp_path, file_name, mutate):
    write_mnist_like(tmp_path / "mnist", seed=0, gz=False)
    path = tmp_path / "mnist" / file_name
    path.write_bytes(mutate(path.read_bytes()))
    return path


@pytest.mark.parametrize(
    "file_name, mutate, message",
    [
        ("train-images-idx3-ubyte", lambda b: b[:-100], "truncated or corrupt"),
        ("train-images-idx3-ubyte", lambda b: b + b"\0", "truncated or corrupt"),
        ("train-images-idx3-ubyte", lambda b: b[:10], "truncated IDX header"),
        (
            "train-images-idx3-ubyte",
            lambda b: b"\0\0\x08\x01" + b[4:],
            "magic 00000801, expected 00000803",
        ),
        ("t10k-labels-idx1-ubyte", lambda b: b"\0\0\x0d\x01" + b[4:], "magic"),  # float data
        ("train-labels-idx1-ubyte", lambda b: b"\0\0\x08\x03" + b[4:], "expected 00000801"),
        ("train-images-idx3-ubyte", lambda b: gzip.compress(b)[:-30], "corrupt or truncated gzip"),
    ],
    ids=[
        "truncated",
        "trailing",
        "header",
        "labels-as-images",
        "float",
        "images-as-labels",
        "bad-gz",
    ],
)
def test_corrupt_idx_raises_clear_error(tmp_path, file_name, mutate, message):
    path = _corrupt(tmp_path, file_name, mutate)
    with pytest.raises(ValueError, match=message) as info:
        load_raw("mnist", data_dir=str(tmp_path))
    assert str(path) in str(info.value)


def test_image_label_count_mismatch(tmp_path):
    write_mnist_like(tmp_path / "mnist", seed=0)
    write_idx(tmp_path / "mnist" / "train-labels-idx1-ubyte", np.zeros(N_TRAIN - 1, np.uint8))
    with pytest.raises(ValueError, match=f"{N_TRAIN} images but .* {N_TRAIN - 1} labels"):
        load_raw("mnist", data_dir=str(tmp_path))


def test_labels_out_of_range(tmp_path):
    write_mnist_like(tmp_path / "mnist", seed=0, num_classes=1, label_low=10)  # every label is 10
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 10\)"):
        load_raw("mnist", data_dir=str(tmp_path))


def test_partial_copy_is_reported(tmp_path):
    write_mnist_like(tmp_path / "mnist", seed=0)
    (tmp_path / "mnist" / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DatasetNotFoundError, match="missing: t10k-labels-idx1-ubyte.gz"):
        load_raw("mnist", data_dir=str(tmp_path))


# ---------------------------------------------------------------------------------------------
# EMNIST.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "split, num_classes, label_low",
    [
        ("balanced", 47, 0),
        ("byclass", 62, 0),
        ("bymerge", 47, 0),
        ("letters", 26, 1),
        ("digits", 10, 0),
        ("mnist", 10, 0),
    ],
)
def test_emnist_transposed_and_labels(tmp_path, split, num_classes, label_low):
    xtr, ytr, xte, yte = write_mnist_like(
        tmp_path / "emnist",
        seed=8,
        prefix=f"emnist-{split}-",
        num_classes=num_classes,
        label_low=label_low,
    )
    ds = load_raw("emnist", data_dir=str(tmp_path), emnist_split=split)
    assert ds.num_classes == num_classes
    written = np.concatenate([xtr, xte])
    # The files hold each image transposed; the loader makes it upright: out[i, r, c] = file[i, c, r]
    np.testing.assert_array_equal(ds.x[..., 0], written.transpose(0, 2, 1))
    assert ds.x[3, 5, 17, 0] == written[3, 17, 5]
    labels = np.concatenate([ytr, yte]).astype(np.int32)
    np.testing.assert_array_equal(ds.y, labels - label_low)  # letters: 1..26 -> 0..25
    assert ds.y.min() >= 0 and ds.y.max() < num_classes


@pytest.mark.parametrize("sub", ["emnist/gzip", "", "gzip"])
def test_emnist_locations(tmp_path, sub):
    where = tmp_path / sub if sub else tmp_path
    xtr, *_ = write_mnist_like(where, seed=9, prefix="emnist-balanced-", num_classes=47)
    ds = load_raw("emnist", data_dir=str(tmp_path), merge_splits=False)
    np.testing.assert_array_equal(ds.x[..., 0], xtr.transpose(0, 2, 1))
    assert ds.source == str(where)


def test_emnist_letters_zero_label_is_corrupt(tmp_path):
    write_mnist_like(
        tmp_path / "emnist", seed=0, prefix="emnist-letters-", num_classes=26, label_low=1
    )
    labels = np.arange(N_TRAIN, dtype=np.uint8)  # 0..11: label 0 does not exist in letters
    write_idx(tmp_path / "emnist" / "emnist-letters-train-labels-idx1-ubyte", labels)
    with pytest.raises(ValueError, match="letters labels must be 1..26"):
        load_raw("emnist", data_dir=str(tmp_path), emnist_split="letters")


def test_emnist_bad_split():
    with pytest.raises(
        ValueError, match="^emnist_split must be one of byclass, .*letters.*, got 'bogus'"
    ):
        load_raw("emnist", emnist_split="bogus")


# ---------------------------------------------------------------------------------------------
# CIFAR-10 / CIFAR-100.
# ---------------------------------------------------------------------------------------------


def _assert_cifar_pixels(ds, x_src, raw_rows):
    """Checks NHWC against the source images and against the flat CHW rows of the file format."""
    assert ds.x.shape == (len(x_src), 32, 32, 3) and ds.x.dtype == np.uint8
    np.testing.assert_array_equal(ds.x, x_src)
    # Row layout from the CIFAR page: 1024 red, 1024 green, 1024 blue values, each 32×32 row-major.
    for i, h, w, c in [(0, 0, 1, 0), (1, 5, 30, 2), (len(x_src) - 1, 31, 0, 1), (2, 7, 3, 1)]:
        assert ds.x[i, h, w, c] == raw_rows[i, c * 1024 + h * 32 + w]


@pytest.mark.parametrize("where", ["cifar10/cifar-10-batches-py", "cifar-10-batches-py", "cifar10"])
def test_cifar10_folder(tmp_path, where):
    x, y, n_train = write_cifar10(tmp_path / where, seed=10)
    ds = load_raw("cifar10", data_dir=str(tmp_path))
    rows = x.transpose(0, 3, 1, 2).reshape(len(x), -1)
    _assert_cifar_pixels(ds, x, rows)
    np.testing.assert_array_equal(ds.y, y)
    assert ds.num_classes == 10 and ds.y.dtype == np.int32
    assert ds.input_scale == pytest.approx(2 / 255) and ds.input_shift == -1.0
    assert ds.source == str(tmp_path / where)
    train = load_raw("cifar10", data_dir=str(tmp_path), merge_splits=False)
    assert len(train.y) == n_train == 12
    np.testing.assert_array_equal(train.x, x[:n_train])  # data_batch_1..5 in order


@pytest.mark.parametrize("where", ["cifar10/cifar-10-python.tar.gz", "cifar-10-python.tar.gz"])
def test_cifar10_archive(tmp_path, where):
    x, y, n_train = write_cifar10(tmp_path, seed=11, archive=tmp_path / where)
    ds = load_raw("cifar10", data_dir=str(tmp_path))
    _assert_cifar_pixels(ds, x, x.transpose(0, 3, 1, 2).reshape(len(x), -1))
    np.testing.assert_array_equal(ds.y, y)
    assert ds.source == str(tmp_path / where)
    assert not (tmp_path / "cifar-10-batches-py").exists()  # read in memory, nothing extracted
    assert len(load_raw("cifar10", data_dir=str(tmp_path), merge_splits=False).y) == n_train


def test_cifar_folder_wins_over_archive(tmp_path):
    write_cifar10(tmp_path, seed=12, archive=tmp_path / "cifar-10-python.tar.gz")
    x, *_ = write_cifar10(tmp_path / "cifar-10-batches-py", seed=13)
    np.testing.assert_array_equal(load_raw("cifar10", data_dir=str(tmp_path)).x, x)


@pytest.mark.parametrize("archive", [False, True], ids=["folder", "tar.gz"])
def test_cifar100_fine_labels(tmp_path, archive):
    if archive:
        x, fine, n_train = write_cifar100(
            tmp_path, seed=14, archive=tmp_path / "cifar100" / "cifar-100-python.tar.gz"
        )
    else:
        x, fine, n_train = write_cifar100(tmp_path / "cifar-100-python", seed=14)
    ds = load_raw("cifar100", data_dir=str(tmp_path))
    assert ds.num_classes == 100
    _assert_cifar_pixels(ds, x, x.transpose(0, 3, 1, 2).reshape(len(x), -1))
    np.testing.assert_array_equal(ds.y, fine)
    assert ds.y.min() >= 20  # fine labels, not the coarse ones (all < 20)
    train = load_raw("cifar100", data_dir=str(tmp_path), merge_splits=False)
    np.testing.assert_array_equal(train.y, fine[:n_train])


def test_cifar_corrupt_files(tmp_path):
    write_cifar10(tmp_path / "cifar-10-batches-py", seed=0)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").write_bytes(b"\x80\x02}q\x00")  # cut pickle
    with pytest.raises(ValueError, match="data_batch_3: corrupt or truncated pickle"):
        load_raw("cifar10", data_dir=str(tmp_path))
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").write_bytes(
        pickle.dumps({b"data": np.zeros((2, 10), np.uint8), b"labels": [0, 1]})
    )
    with pytest.raises(ValueError, match=r"uint8 \[n, 3072\]"):
        load_raw("cifar10", data_dir=str(tmp_path))
    shutil.rmtree(tmp_path / "cifar-10-batches-py")
    archive = tmp_path / "cifar-10-python.tar.gz"
    write_cifar10(tmp_path, seed=0, archive=archive)
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    with pytest.raises(ValueError, match="cifar-10-python.tar.gz.*corrupt or truncated"):
        load_raw("cifar10", data_dir=str(tmp_path))


# ---------------------------------------------------------------------------------------------
# Prepared TFDS directories (array_record; built without TensorFlow).
# ---------------------------------------------------------------------------------------------


def _png(a: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(a[..., 0] if a.shape[-1] == 1 else a).save(buf, format="PNG")
    return buf.getvalue()


def _fake_builder_class(
    tfds, name, version, image_shape, label_classes, splits, config=None, cifar100=False
):
    """A builder that writes `splits` ({split: (images, labels)}) under the registered name."""

    class Fake(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version(version)
        BUILDER_CONFIGS = [tfds.core.BuilderConfig(name=config)] if config else []

        def _info(self):
            features = {
                "image": tfds.features.Image(shape=image_shape),
                "label": tfds.features.ClassLabel(num_classes=label_classes),
            }
            if cifar100:  # same features as the registered cifar100 builder
                features["coarse_label"] = tfds.features.ClassLabel(num_classes=20)
                features["id"] = tfds.features.Text()
            return tfds.core.DatasetInfo(
                builder=self, features=tfds.features.FeaturesDict(features)
            )

        def _split_generators(self, dl_manager):
            return {s: self._generate_examples(*arrays) for s, arrays in splits.items()}

        def _generate_examples(self, images, labels):
            for i, (img, lbl) in enumerate(zip(images, labels)):
                ex = {"image": _png(img), "label": int(lbl)}
                if cifar100:
                    ex.update(coarse_label=int(lbl) % 20, id=f"x_{i}")
                yield i, ex

    Fake.name = name
    return Fake


def _image_splits(rng, image_shape, label_low, label_high, **sizes):
    """{split: (uint8 images [n, *image_shape], labels in [label_low, label_high))}."""
    return {
        split: (
            rng.integers(0, 256, (n, *image_shape), dtype=np.uint8),
            rng.integers(label_low, label_high, n),
        )
        for split, n in sizes.items()
    }


def _prepare(builder_cls, data_dir: Path, config=None):
    kwargs = {"config": config} if config else {}
    builder_cls(data_dir=str(data_dir), file_format="array_record", **kwargs).download_and_prepare()


@pytest.fixture(scope="module")
def tfds_mod():
    tfds = pytest.importorskip("tensorflow_datasets")
    tfds.disable_progress_bar()
    return tfds


@pytest.fixture(scope="module")
def fake_tfds(tmp_path_factory, tfds_mod):
    """A TFDS data dir with prepared mnist, emnist/letters and cifar100; returns it and the arrays."""
    tfds = tfds_mod
    root = tmp_path_factory.mktemp("tfds")
    rng = np.random.default_rng(20)
    arrays = {}
    # mnist: 20 train + 7 test.
    mn = _image_splits(rng, (28, 28, 1), 0, 10, train=20, test=7)
    _prepare(_fake_builder_class(tfds, "mnist", "3.0.1", (28, 28, 1), 10, mn), root)
    arrays["mnist"] = mn
    # emnist/letters as TFDS stores it: NIST's transposed images, labels 1..26 (37 classes declared)
    em = _image_splits(rng, (28, 28, 1), 1, 27, train=9, test=4)
    _prepare(
        _fake_builder_class(tfds, "emnist", "3.1.0", (28, 28, 1), 37, em, config="letters"),
        root,
        "letters",
    )
    arrays["emnist"] = em
    # cifar100 with its fine 'label' and 'coarse_label'.
    c100 = _image_splits(rng, (32, 32, 3), 0, 100, train=6, test=3)
    _prepare(
        _fake_builder_class(tfds, "cifar100", "3.0.2", (32, 32, 3), 100, c100, cifar100=True), root
    )
    arrays["cifar100"] = c100
    return root, arrays


def _as_pairs(x, y):
    """TFDS shuffles records when writing, so compare (image, label) multisets, not order."""
    return sorted((img.tobytes(), int(lbl)) for img, lbl in zip(x, y))


def test_tfds_prepared_wins_over_raw_files(tmp_path, fake_tfds):
    root, arrays = fake_tfds
    write_mnist_like(tmp_path / "mnist", seed=21)  # a different copy that must not be read
    ds = load_raw("mnist", data_dir=str(tmp_path), tfds_dir=str(root))
    (xtr, ytr), (xte, yte) = arrays["mnist"]["train"], arrays["mnist"]["test"]
    assert ds.x.shape == (27, 28, 28, 1) and ds.x.dtype == np.uint8 and ds.y.dtype == np.int32
    assert "TFDS" in ds.source and str(root) in ds.source
    # Train records first, then test.
    assert _as_pairs(ds.x[:20], ds.y[:20]) == _as_pairs(xtr, ytr)
    assert _as_pairs(ds.x[20:], ds.y[20:]) == _as_pairs(xte, yte)
    train = load_raw("mnist", data_dir=str(tmp_path), tfds_dir=str(root), merge_splits=False)
    assert _as_pairs(train.x, train.y) == _as_pairs(xtr, ytr)


def test_tfds_dir_from_environment(monkeypatch, tmp_path, fake_tfds):
    root, arrays = fake_tfds
    monkeypatch.setenv("TFDS_DATA_DIR", str(root))
    ds = load_raw("mnist", data_dir=str(tmp_path))
    assert len(ds.y) == 27 and str(root) in ds.source


def test_tfds_emnist_letters_transposed_and_shifted(tmp_path, fake_tfds):
    root, arrays = fake_tfds
    ds = load_raw("emnist", emnist_split="letters", tfds_dir=str(root), data_dir=str(tmp_path))
    assert ds.num_classes == 26 and ds.x.shape == (13, 28, 28, 1)
    x = np.concatenate([arrays["emnist"][s][0] for s in ("train", "test")])
    y = np.concatenate([arrays["emnist"][s][1] for s in ("train", "test")])
    # Same conventions as the raw files: upright (H and W swapped) and labels 0..25.
    assert _as_pairs(ds.x, ds.y) == _as_pairs(x.transpose(0, 2, 1, 3), y - 1)
    # The balanced split is not prepared there, so it is not found.
    with pytest.raises(DatasetNotFoundError, match=r"emnist \(split 'balanced'\)"):
        load_raw("emnist", tfds_dir=str(root), data_dir=str(tmp_path))


def test_tfds_cifar100_fine_label(tmp_path, fake_tfds):
    root, arrays = fake_tfds
    ds = load_raw("cifar100", tfds_dir=str(root), data_dir=str(tmp_path))
    x = np.concatenate([arrays["cifar100"][s][0] for s in ("train", "test")])
    y = np.concatenate([arrays["cifar100"][s][1] for s in ("train", "test")])
    assert ds.num_classes == 100 and ds.x.shape == (9, 32, 32, 3)
    assert _as_pairs(ds.x, ds.y) == _as_pairs(x, y)


def _tfrecord_copy(root: Path, dest: Path) -> Path:
    """A copy of the prepared mnist whose dataset_info.json claims the tfrecord format."""
    shutil.copytree(root / "mnist", dest / "mnist")
    info_path = next((dest / "mnist").glob("*/dataset_info.json"))
    info = json.loads(info_path.read_text())
    info["fileFormat"] = "tfrecord"
    info_path.write_text(json.dumps(info))
    return dest


def test_tfds_tfrecord_without_tensorflow(tmp_path, fake_tfds, monkeypatch):
    root, _ = fake_tfds
    tfrecord_dir = _tfrecord_copy(root, tmp_path / "tfrecord_tfds")
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # `import tensorflow` raises ImportError
    # Without raw files: a not-found error that explains why the TFDS copy was not used.
    with pytest.raises(
        DatasetNotFoundError, match=r"(?s)tfrecord format, which needs TensorFlow.*in data_dir"
    ):
        load_raw("mnist", tfds_dir=str(tfrecord_dir), data_dir=str(tmp_path / "raw"))
    # With raw files: they are read instead.
    xtr, *_ = write_mnist_like(tmp_path / "raw" / "mnist", seed=22)
    ds = load_raw("mnist", tfds_dir=str(tfrecord_dir), data_dir=str(tmp_path / "raw"))
    np.testing.assert_array_equal(ds.x[:N_TRAIN, ..., 0], xtr)


def test_tfds_unprepared_folder_is_skipped(tmp_path):
    (tmp_path / "tfds" / "mnist" / "3.0.1").mkdir(parents=True)  # e.g. an interrupted download
    xtr, *_ = write_mnist_like(tmp_path / "raw", seed=23)
    ds = load_raw("mnist", tfds_dir=str(tmp_path / "tfds"), data_dir=str(tmp_path / "raw"))
    np.testing.assert_array_equal(ds.x[:N_TRAIN, ..., 0], xtr)


# ---------------------------------------------------------------------------------------------
# Missing data and --download.
# ---------------------------------------------------------------------------------------------

_EXPECTED_IN_MESSAGE = {
    "mnist": [
        "train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte.gz",
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz",
        "https://ossci-datasets.s3.amazonaws.com/mnist/",
    ],
    "fashion_mnist": [
        "train-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz",
        "https://github.com/zalandoresearch/fashion-mnist",
        "apt-get install dataset-fashion-mnist",
    ],
    "emnist": [
        "emnist-balanced-train-images-idx3-ubyte.gz",
        "emnist-balanced-train-labels-idx1-ubyte.gz",
        "emnist-balanced-test-images-idx3-ubyte.gz",
        "emnist-balanced-test-labels-idx1-ubyte.gz",
        "https://www.nist.gov/itl/products-and-services/emnist-dataset",
    ],
    "cifar10": [
        "cifar-10-batches-py",
        "data_batch_1",
        "data_batch_5",
        "test_batch",
        "cifar-10-python.tar.gz",
        "https://www.cs.toronto.edu/~kriz/cifar.html",
    ],
    "cifar100": [
        "cifar-100-python",
        "cifar-100-python.tar.gz",
        "https://www.cs.toronto.edu/~kriz/cifar.html",
    ],
}


@pytest.mark.parametrize("name", sorted(_EXPECTED_IN_MESSAGE))
def test_missing_dataset_fails_fast_with_instructions(tmp_path, name, monkeypatch):
    monkeypatch.setattr(
        sources, "_can_reach", lambda *a, **k: pytest.fail("probed the network without --download")
    )
    data_dir, tfds_dir = tmp_path / "data", tmp_path / "tfds"
    start = time.monotonic()
    with pytest.raises(DatasetNotFoundError) as info:
        load_raw(name, data_dir=str(data_dir), tfds_dir=str(tfds_dir))
    assert time.monotonic() - start < 5
    message = str(info.value)
    assert name in message and "Or pass download to let TensorFlow Datasets" in message
    assert "TFDS data dir (tfds_dir / $TFDS_DATA_DIR)" in message
    # run.py says the flags: --download, --tfds-dir, --data-dir
    said = spelled(info.value, cli.spelling())
    assert "Or pass --download to let" in said and "(--tfds-dir / $TFDS_DATA_DIR)" in said
    assert "(or pass --data-dir DIR)" in said
    for directory in (tfds_dir, data_dir, data_dir / name):
        assert str(directory) in message
    for expected in _EXPECTED_IN_MESSAGE[name]:
        assert expected in message, expected
    if name == "fashion_mnist":
        assert idx._DEBIAN_FASHION_MNIST_DIR in message


def test_download_with_unreachable_host_fails_fast(tmp_path, monkeypatch):
    probed = []

    def fake_probe(host, port, timeout=3.0):
        probed.append((host, port))
        return False

    monkeypatch.setattr(sources, "_can_reach", fake_probe)
    tfds = pytest.importorskip("tensorflow_datasets")
    monkeypatch.setattr(
        tfds, "builder", lambda *a, **k: pytest.fail("TFDS called after a failed probe")
    )
    start = time.monotonic()
    with pytest.raises(DatasetNotFoundError, match="cannot reach storage.googleapis.com:443"):
        load_raw("mnist", data_dir=str(tmp_path), tfds_dir=str(tmp_path / "tfds"), download=True)
    assert time.monotonic() - start < 5
    assert probed == [("storage.googleapis.com", 443)]


def test_download_not_attempted_when_local_copy_exists(tmp_path, monkeypatch):
    monkeypatch.setattr(
        sources, "_can_reach", lambda *a, **k: pytest.fail("probed although files exist")
    )
    write_mnist_like(tmp_path / "mnist")
    assert len(load_raw("mnist", data_dir=str(tmp_path), download=True).y) == N_TRAIN + N_TEST


def test_download_prepares_array_record_and_reads_it(tmp_path, monkeypatch, tfds_mod):
    """The --download path end to end, with TFDS's network step replaced by a local generator."""
    tfds = tfds_mod
    rng = np.random.default_rng(24)
    splits = _image_splits(rng, (28, 28, 1), 0, 10, train=5, test=2)
    fake_cls = _fake_builder_class(tfds, "fashion_mnist", "3.0.1", (28, 28, 1), 10, splits)
    calls = []

    def fake_builder(name, *, data_dir, file_format):
        calls.append((name, data_dir, file_format))
        return fake_cls(data_dir=data_dir, file_format=file_format)

    monkeypatch.setattr(sources, "_can_reach", lambda host, port, timeout=3.0: True)
    monkeypatch.setattr(tfds, "builder", fake_builder)
    tfds_dir = tmp_path / "tfds"
    ds = load_raw(
        "fashion_mnist", data_dir=str(tmp_path / "none"), tfds_dir=str(tfds_dir), download=True
    )
    assert calls == [("fashion_mnist", str(tfds_dir), "array_record")]
    assert any(tfds_dir.glob("fashion_mnist/3.0.1/*.array_record-*"))
    x = np.concatenate([splits["train"][0], splits["test"][0]])
    y = np.concatenate([splits["train"][1], splits["test"][1]])
    assert _as_pairs(ds.x, ds.y) == _as_pairs(x, y)


def test_probe_returns_false_quickly_when_refused():
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    assert sources._can_reach("127.0.0.1", port, timeout=3.0) is False
    assert time.monotonic() - start < 3.5


# ---------------------------------------------------------------------------------------------
# Synthetic(α, β).
# ---------------------------------------------------------------------------------------------


def _synthetic(**kw):
    args = dict(
        seed=0, synthetic_alpha=1.0, synthetic_beta=1.0, synthetic_clients=30, synthetic_dim=60
    )
    args.update(kw)
    return load_raw("synthetic", **args)


def test_synthetic_shapes_and_clients():
    ds = _synthetic(synthetic_clients=25, synthetic_dim=12)
    n = len(ds.y)
    assert ds.x.shape == (n, 12) and ds.x.dtype == np.float32
    assert ds.y.dtype == np.int32 and ds.num_classes == 10 and 0 <= ds.y.min() and ds.y.max() < 10
    assert ds.input_scale == 1.0 and ds.input_shift == 0.0 and "generated" in ds.source
    assert ds.client_ids.shape == (n,) and ds.client_ids.dtype == np.int32
    assert np.all(np.diff(ds.client_ids) >= 0)  # clients are contiguous, in order
    counts = np.bincount(ds.client_ids)
    assert len(counts) == 25
    assert counts.min() >= 50 and counts.max() <= sources.SYNTHETIC_MAX_SAMPLES_PER_CLIENT


def test_synthetic_deterministic():
    a, b, c = _synthetic(seed=3), _synthetic(seed=3), _synthetic(seed=4)
    np.testing.assert_array_equal(a.x, b.x)
    np.testing.assert_array_equal(a.y, b.y)
    np.testing.assert_array_equal(a.client_ids, b.client_ids)
    assert a.x.shape != c.x.shape or not np.array_equal(a.x, c.x)


def test_synthetic_equals_the_generative_process_drawn_in_float64():
    """Synthetic(α = 0.5, β = 2) for 4 clients of d = 5, written out here from the docstring's
    process in one seed's draw order (every count first, then per client u_k, B_k, W_k, b_k, v_k,
    the samples), in float64, labels argmax(W_k x + b_k) of the float64 samples: the generator's
    float32 samples are these rounded once, its labels these exactly."""
    rng = np.random.default_rng(11)
    counts = np.minimum(rng.lognormal(4.0, 2.0, size=4).astype(np.int64) + 50, 1000)
    xs, ys = [], []
    for n in counts:
        u, b_mean = np.sqrt(0.5) * rng.standard_normal(), np.sqrt(2.0) * rng.standard_normal()
        w, b = u + rng.standard_normal((10, 5)), u + rng.standard_normal(10)
        v = b_mean + rng.standard_normal(5)
        x = v + np.arange(1, 6) ** -0.6 * rng.standard_normal((n, 5))
        xs.append(x)
        ys.append([int(np.argmax(w @ row + b)) for row in x])
    ds = _synthetic(seed=11, synthetic_alpha=0.5, synthetic_beta=2.0, synthetic_clients=4,
                    synthetic_dim=5)
    np.testing.assert_array_equal(ds.x, np.concatenate(xs).astype(np.float32))
    np.testing.assert_array_equal(ds.y, np.concatenate(ys))
    np.testing.assert_array_equal(np.bincount(ds.client_ids), counts)


def test_synthetic_generates_only_the_clients_asked_for():
    """`materialise` (a process of a multi-process run generating its own clients): given the
    counts drawn first, it picks clients 1 and 3 of the float64 reference above; their features
    are the reference's, the others' rows zeros, every label the reference's."""
    rng = np.random.default_rng(11)
    counts = np.minimum(rng.lognormal(4.0, 2.0, size=4).astype(np.int64) + 50, 1000)
    full = _synthetic(seed=11, synthetic_alpha=0.5, synthetic_beta=2.0, synthetic_clients=4,
                      synthetic_dim=5)
    seen = []

    def pick(c):
        seen.append(np.array(c))
        return np.array([False, True, False, True])

    part = _synthetic(seed=11, synthetic_alpha=0.5, synthetic_beta=2.0, synthetic_clients=4,
                      synthetic_dim=5, materialise=pick)
    np.testing.assert_array_equal(seen[0], counts)
    np.testing.assert_array_equal(part.written, [False, True, False, True])
    mine = np.isin(part.client_ids, [1, 3])
    np.testing.assert_array_equal(part.x[mine], full.x[mine])
    assert not part.x[~mine].any()
    np.testing.assert_array_equal(part.y, full.y)
    assert full.written.all()


@pytest.mark.slow
def test_synthetic_rows_not_generated_take_no_memory():
    """3,000 clients (~170 MB of features), the first tenth of them generated (a process's
    clients are one contiguous range, `core.sharded.owner_layout`): a fresh process grows by
    about a tenth of what the whole dataset adds to another (resident pages, /proc/self/statm;
    each in its own process with the system allocator, so no freed pages are reused)."""
    import subprocess

    script = """
import os, sys
import numpy as np
from fedjax_pfl.data import sources
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
part = sys.argv[1] == "part"
before = resident()
ds = sources.load_raw("synthetic", seed=2, synthetic_clients=3000, synthetic_dim=60,
                      materialise=(lambda c: np.arange(c.size) < c.size // 10) if part else None)
print(resident() - before, ds.x.nbytes)
"""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    grew = {}
    for which in ("part", "whole"):
        out = subprocess.run([sys.executable, "-c", script, which], env=env, capture_output=True,
                             text=True, check=True).stdout.split()
        grew[which], nbytes = int(out[0]), int(out[1])
    assert grew["whole"] > 0.8 * nbytes, grew
    assert grew["part"] < 0.3 * nbytes, (grew, nbytes)


def test_split_sizes_are_those_of_the_split():
    """⌈f·n⌉ to test, the rest to train (f·n = 3 exactly for n = 12, f = 0.25: 3, not 4)."""
    from fedjax_pfl.data import partition as P

    counts = np.array([12, 13, 2, 100])
    train, test = P.split_sizes(counts, test_fraction=0.25)
    np.testing.assert_array_equal(test, [3, 4, 1, 25])
    np.testing.assert_array_equal(train, [9, 9, 1, 75])
    parts = [np.arange(n) for n in counts]
    tr, te = P.split_train_test(parts, test_fraction=0.25, seed=3)
    assert [t.size for t in te] == [3, 4, 1, 25] and [t.size for t in tr] == [9, 9, 1, 75]


def test_synthetic_sample_counts_follow_lognormal():
    # n_k - 50 = int(lognormal(4, 2)): its median is e^4 ≈ 54.6, so about half the clients have
    # fewer than 104 samples; the cap truncates those above 1000 (P(lognormal > 950) ≈ 0.07).
    counts = np.bincount(_synthetic(synthetic_clients=2000, synthetic_dim=2).client_ids)
    assert 0.45 < np.mean(counts < 50 + np.exp(4)) < 0.55
    assert 0.04 < np.mean(counts == 1000) < 0.10


def test_synthetic_feature_covariance():
    # α = β = 0: v_k ~ N(0, I), x | k ~ N(v_k, Σ). Within a client, var(x_j) = Σ_jj = j^-1.2;
    # over all clients, the client means have variance 1 per coordinate.
    d = 8
    ds = _synthetic(
        seed=5, synthetic_alpha=0.0, synthetic_beta=0.0, synthetic_clients=400, synthetic_dim=d
    )
    x, k = ds.x.astype(np.float64), ds.client_ids
    means = np.stack([x[k == c].mean(0) for c in range(400)])
    within = np.mean((x - means[k]) ** 2, axis=0)
    sigma = np.arange(1, d + 1) ** -1.2
    np.testing.assert_allclose(within, sigma, rtol=0.05)
    np.testing.assert_allclose(means.var(0), 1.0, atol=0.25)
    # β is a variance: with β = 4 the client-wide shift B_k adds 4 to the covariance of any two
    # coordinates of v_k (not 16, as if β were a standard deviation).
    ds = _synthetic(
        seed=6, synthetic_alpha=0.0, synthetic_beta=4.0, synthetic_clients=400, synthetic_dim=d
    )
    means = np.stack([ds.x[ds.client_ids == c].astype(np.float64).mean(0) for c in range(400)])
    cov = np.cov(means, rowvar=False)
    off_diag = cov[~np.eye(d, dtype=bool)].mean()
    assert 3.0 < off_diag < 5.0


def test_synthetic_alpha_does_not_change_labels():
    # u_k adds u_k·(Σ_j x_j + 1) to every logit of a sample, so the argmax (y) cannot change;
    # with one seed the generator draws the same unit normals for every α.
    a = _synthetic(seed=7, synthetic_alpha=0.0, synthetic_clients=10, synthetic_dim=20)
    b = _synthetic(seed=7, synthetic_alpha=9.0, synthetic_clients=10, synthetic_dim=20)
    np.testing.assert_array_equal(a.x, b.x)
    np.testing.assert_array_equal(a.y, b.y)


def test_synthetic_beta_concentrates_client_labels():
    # A large B_k makes x ≈ B_k·1 + noise, so y ≈ argmax(B_k·W_k 1 + ...) is nearly constant in
    # a client: each client's most frequent label takes a larger share as β grows.
    def top_share(beta):
        ds = _synthetic(
            seed=8,
            synthetic_alpha=0.0,
            synthetic_beta=beta,
            synthetic_clients=200,
            synthetic_dim=20,
        )
        shares = [
            np.bincount(ds.y[ds.client_ids == c]).max() / np.sum(ds.client_ids == c)
            for c in range(200)
        ]
        return np.mean(shares)

    low, high = top_share(0.0), top_share(25.0)
    assert high > low + 0.05 and high > 0.85


def test_synthetic_labels_are_a_linear_argmax_per_client():
    # For one client, y = argmax(W x + b); each class region is convex, so the mean of the samples
    # labelled c (a convex combination of them) must itself be labelled c by the same map. We test
    # this with the exact generator recomputed by hand for a single client.
    rng = np.random.default_rng(9)
    d = 5
    counts = rng.lognormal(4.0, 2.0, size=1).astype(np.int64) + 50
    n = int(min(counts[0], 1000))
    u = np.sqrt(2.0) * rng.standard_normal()
    bm = np.sqrt(3.0) * rng.standard_normal()
    w = u + rng.standard_normal((10, d))
    b = u + rng.standard_normal(10)
    v = bm + rng.standard_normal(d)
    x = v + np.arange(1, d + 1) ** -0.6 * rng.standard_normal((n, d))
    ds = _synthetic(
        seed=9, synthetic_alpha=2.0, synthetic_beta=3.0, synthetic_clients=1, synthetic_dim=d
    )
    np.testing.assert_allclose(ds.x, x.astype(np.float32))
    np.testing.assert_array_equal(ds.y, np.argmax(x @ w.T + b, axis=1))
    for c in np.unique(ds.y):
        centroid = x[ds.y == c].mean(0)
        assert np.argmax(w @ centroid + b) == c


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(synthetic_alpha=-0.5), "^synthetic_alpha must be a finite variance >= 0, got -0.5"),
        (dict(synthetic_beta=-1.0), "^synthetic_beta must be"),
        (dict(synthetic_alpha=float("nan")), "^synthetic_alpha"),
        (dict(synthetic_clients=0), "^synthetic_clients must be an integer >= 1, got 0"),
        (dict(synthetic_clients=2.5), "^synthetic_clients"),
        (dict(synthetic_dim=0), "^synthetic_dim must be an integer >= 1"),
    ],
)
def test_synthetic_validation(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        _synthetic(**kw)


# ---------------------------------------------------------------------------------------------
# Real data, when installed.
# ---------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.slow
def test_real_fashion_mnist_from_debian_package(tmp_path, monkeypatch):
    if not Path(_REAL_DEBIAN_DIR).is_dir():
        pytest.skip(
            f"{_REAL_DEBIAN_DIR} is absent; `apt-get install dataset-fashion-mnist` enables this test"
        )
    monkeypatch.setattr(idx, "_DEBIAN_FASHION_MNIST_DIR", _REAL_DEBIAN_DIR)
    ds = load_raw("fashion_mnist", data_dir=str(tmp_path), tfds_dir=str(tmp_path / "tfds"))
    assert ds.source == _REAL_DEBIAN_DIR
    assert ds.x.shape == (70_000, 28, 28, 1) and ds.x.dtype == np.uint8
    assert ds.num_classes == 10
    np.testing.assert_array_equal(np.bincount(ds.y, minlength=10), np.full(10, 7_000))
    train = load_raw(
        "fashion_mnist", data_dir=str(tmp_path), tfds_dir=str(tmp_path / "tfds"), merge_splits=False
    )
    assert train.x.shape == (60_000, 28, 28, 1)
    np.testing.assert_array_equal(train.x, ds.x[:60_000])  # train first in the merged set
    np.testing.assert_array_equal(np.bincount(train.y, minlength=10), np.full(10, 6_000))
