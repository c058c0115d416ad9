"""CIFAR's python batches are pickles: they are read by an unpickler that admits only what those
files hold (NumPy arrays and dtypes, builtin containers, bytes), so a crafted `data_batch_1` in
--data-dir is refused with one line naming it, and the code it carries never runs.

The genuine batches are written here as CIFAR's are (Krizhevsky 2009, "Python version"): a dict
{b"batch_label", b"labels": [n ints], b"data": uint8 [n, 3072] (1024 red, 1024 green, 1024 blue
values per image, each plane row-major), b"filenames"}, pickled at protocol 2.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import tarfile

import numpy as np
import pytest

from fedjax_pfl.data import sources

TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
FOLDER = "cifar-10-batches-py"


def _batch(x_hwc: np.ndarray, labels: np.ndarray) -> dict:
    n = len(x_hwc)
    return {b"batch_label": b"training batch", b"labels": [int(v) for v in labels],
            b"data": x_hwc.transpose(0, 3, 1, 2).reshape(n, 3 * 32 * 32),   # CHW planes per row
            b"filenames": [f"img_{i}.png".encode() for i in range(n)]}


def _write_genuine(folder, protocol=2, seed=0):
    """Six genuine batches (five train, one test) of 2 images; returns (x HWC, labels) in order."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    xs, ys = [], []
    for name in (*TRAIN, "test_batch"):
        x = rng.integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
        y = rng.integers(0, 10, 2)
        (folder / name).write_bytes(pickle.dumps(_batch(x, y), protocol=protocol))
        xs.append(x)
        ys.append(y)
    return np.concatenate(xs), np.concatenate(ys)


class _RunsCode:
    """Unpickling this calls `call(*args)`: pickle's REDUCE, the way any crafted pickle runs code."""

    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


class _OwnClass:
    """A class of the test's own: pickled by reference to tests' module, so loading imports it."""

    def __reduce__(self):
        return _OwnClass, ()


def _touch_with_open(path):
    return _RunsCode(open, str(path), "w")               # open (io.open) creates the file


def _touch_with_system(path):
    return _RunsCode(os.system, f"touch {path}")         # posix.system runs a shell


def _touch_with_exec(path):
    # A NumPy function that executes a string: admitting "anything from numpy" would not be safe.
    from numpy.testing._private.utils import runstring
    return _RunsCode(runstring, f"open({str(path)!r}, 'w').close()", {})


@pytest.fixture
def no_tfds(tmp_path, monkeypatch):
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "no_tfds"))


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_genuine_batches_load(tmp_path, no_tfds, protocol):
    x, y = _write_genuine(tmp_path / FOLDER, protocol=protocol)
    ds = sources.load_raw("cifar10", data_dir=str(tmp_path))
    np.testing.assert_array_equal(ds.x, x)               # the HWC images the test drew
    np.testing.assert_array_equal(ds.y, y)


@pytest.mark.parametrize("make", [_touch_with_open, _touch_with_system, _touch_with_exec])
@pytest.mark.parametrize("protocol", [2, 4])
def test_crafted_batch_is_refused_and_its_code_never_runs(tmp_path, no_tfds, make, protocol):
    _write_genuine(tmp_path / FOLDER)
    created = tmp_path / "created_by_the_pickle"
    crafted = _batch(np.zeros((1, 32, 32, 3), np.uint8), np.zeros(1))
    crafted[b"labels"] = make(created)
    (tmp_path / FOLDER / "data_batch_1").write_bytes(pickle.dumps(crafted, protocol=protocol))
    with pytest.raises(sources.UnsafePickleError) as exc:
        sources.load_raw("cifar10", data_dir=str(tmp_path))
    message = str(exc.value)
    assert "\n" not in message and str(tmp_path / FOLDER / "data_batch_1") in message
    assert "refused to unpickle" in message
    assert not created.exists()


def test_class_of_its_own_and_other_codecs_are_refused(tmp_path, no_tfds):
    _write_genuine(tmp_path / FOLDER)
    target = tmp_path / FOLDER / "test_batch"
    target.write_bytes(pickle.dumps({b"data": _OwnClass(), b"labels": []}, protocol=2))
    with pytest.raises(sources.UnsafePickleError, match=r"test_batch: refused to unpickle "
                       r"test_cifar_pickle\._OwnClass"):
        sources.load_raw("cifar10", data_dir=str(tmp_path))
    # bytes at protocol 2 are _codecs.encode(text, "latin1"); any other codec is not admitted.
    stream = pickle.dumps({b"data": _RunsCode(__import__("_codecs").encode, "x", "rot13"),
                           b"labels": []}, protocol=2)
    target.write_bytes(stream)
    with pytest.raises(ValueError, match="test_batch: corrupt or truncated pickle.*only latin1"):
        sources.load_raw("cifar10", data_dir=str(tmp_path))


def test_crafted_member_of_the_archive_is_refused(tmp_path, no_tfds):
    created = tmp_path / "created_by_the_pickle"
    _write_genuine(tmp_path / "src")
    (tmp_path / "src" / "data_batch_1").write_bytes(
        pickle.dumps({b"data": _touch_with_system(created), b"labels": []}, protocol=2))
    with tarfile.open(tmp_path / "cifar-10-python.tar.gz", "w:gz") as tar:
        for name in (*TRAIN, "test_batch"):
            data = (tmp_path / "src" / name).read_bytes()
            info = tarfile.TarInfo(f"{FOLDER}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    os.replace(tmp_path / "cifar-10-python.tar.gz", data_dir / "cifar-10-python.tar.gz")
    with pytest.raises(sources.UnsafePickleError,
                       match=r"cifar-10-python\.tar\.gz:cifar-10-batches-py/data_batch_1: refused"):
        sources.load_raw("cifar10", data_dir=str(data_dir))
    assert not created.exists()


def test_cli_reports_the_crafted_file_in_one_line(tmp_path, no_tfds, capsys, monkeypatch):
    import run as cli  # experiments/run.py

    from fedjax_pfl import runner

    def forbidden(*a, **k):
        raise AssertionError("runner.run was called: the data should have been refused first")
    monkeypatch.setattr(runner, "run", forbidden)
    _write_genuine(tmp_path / FOLDER)
    created = tmp_path / "created_by_the_pickle"
    crafted = tmp_path / FOLDER / "data_batch_1"
    crafted.write_bytes(pickle.dumps({b"data": _touch_with_open(created), b"labels": []}, protocol=2))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        cli.main(["--dataset", "cifar10", "--data-dir", str(tmp_path), "--out", str(out), "--quiet"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("run.py: error: ")
    # builtins.open pickles as io.open (as _io.open from Python 3.12)
    assert re.search(rf"{re.escape(str(crafted))}: refused to unpickle _?io\.open", err)
    assert not created.exists() and not out.exists()
