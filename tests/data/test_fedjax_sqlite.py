"""FedJAX SQLite reader (data/fedjax_sqlite.py) on small files written here in FedJAX's schema
(``federated_data(client_id BLOB PRIMARY KEY, data BLOB, num_examples INTEGER)``, data =
zlib(msgpack(examples)) with FedJAX's msgpack extension types, as
fedjax/core/sqlite_federated_data.py and fedjax/core/serialization.py write them)."""

import json
import sqlite3
import zlib

import h5py
import msgpack
import numpy as np
import pytest

from fedjax_pfl.data import fedjax_sqlite, tff
from fedjax_pfl.data.natural import DataFormatError
from fedjax_pfl.data.sources import DatasetNotFoundError


def _pack_ext(x):
    """FedJAX's encoder: ext 4 for arrays of bytes, ext 1 (shape, dtype name, bytes) otherwise."""
    if isinstance(x, np.ndarray) and x.dtype.hasobject:
        return msgpack.ExtType(4, msgpack.packb((x.shape, list(x.flatten())), use_bin_type=True))
    if isinstance(x, np.ndarray):
        return msgpack.ExtType(1, msgpack.packb((x.shape, x.dtype.name, x.tobytes("C")),
                                                use_bin_type=True))
    if isinstance(x, np.generic):
        return msgpack.ExtType(3, msgpack.packb(((), x.dtype.name, x.tobytes()), use_bin_type=True))
    raise TypeError(type(x))


def blob(examples):
    return zlib.compress(msgpack.packb(examples, default=_pack_ext, strict_types=True))


def write_sqlite(path, clients, num_examples=None):
    """clients: {id: {feature: array}} (text as lists of bytes) → FedJAX's table."""
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE federated_data (client_id BLOB NOT NULL PRIMARY KEY, "
                 "data BLOB NOT NULL, num_examples INTEGER NOT NULL);")
    rows = []
    for cid, feats in clients.items():
        ex = {k: (np.array(v, dtype=object) if isinstance(v, list) else v) for k, v in feats.items()}
        n = len(next(iter(ex.values())))
        data = feats if isinstance(feats, bytes) else blob(ex)
        rows.append((cid.encode(), data, n if num_examples is None else num_examples))
    conn.executemany("INSERT INTO federated_data VALUES (?, ?, ?);", rows)
    conn.commit()
    conn.close()


def emnist_client(rng, n):
    k = rng.integers(0, 256, size=(n, 28, 28))
    return {"pixels": (k / 255.0).astype(np.float32),
            "label": rng.integers(0, 62, n).astype(np.int32)}


@pytest.fixture
def emnist_dir(tmp_path):
    rng = np.random.default_rng(0)
    # FedJAX's EMNIST ids: "[16-byte hex hash]:f[4 digits]_[2 digits]".
    a, b, c = "0123456789abcdef:f0000_14", "00aa11bb22cc33dd:f0001_41", "ffee000000000000:f2100_00"
    train = {b: emnist_client(rng, 2), a: emnist_client(rng, 3), c: emnist_client(rng, 1)}
    test = {a: emnist_client(rng, 1), b: emnist_client(rng, 2)}
    write_sqlite(tmp_path / "federated_emnist_train.sqlite", train)
    write_sqlite(tmp_path / "federated_emnist_test.sqlite", test)
    return tmp_path, train, test


def test_decode_examples_round_trip():
    ex = {"pixels": np.arange(6, dtype=np.float32).reshape(1, 2, 3),
          "label": np.array([7], np.int64), "snippets": np.array([b"ab", b"c"], dtype=object),
          "score": np.int64(5)}
    out = fedjax_sqlite.decode_examples(blob(ex))
    assert set(out) == set(ex)
    np.testing.assert_array_equal(out["pixels"], ex["pixels"])
    assert out["pixels"].dtype == np.float32 and out["label"].dtype == np.int64
    assert list(out["snippets"]) == [b"ab", b"c"] and out["score"] == 5
    with pytest.raises(ValueError, match="not zlib-compressed FedJAX msgpack"):
        fedjax_sqlite.decode_examples(b"garbage")
    evil = zlib.compress(msgpack.packb({"x": msgpack.ExtType(1, msgpack.packb(
        ((1,), "object", b"\0" * 8), use_bin_type=True))}))
    with pytest.raises(ValueError, match="unsupported array dtype object"):
        fedjax_sqlite.decode_examples(evil)


def test_emnist_ids_pixels_labels_counts(emnist_dir):
    d, train, test = emnist_dir
    reader = fedjax_sqlite.open_fedjax("emnist62", str(d))
    blocks = list(reader.clients())
    assert [b.client_id for b in blocks] == sorted(set(train) | set(test))
    for b in blocks:
        for x, y, src in ((b.train_x, b.train_y, train), (b.test_x, b.test_y, test)):
            if b.client_id not in src:
                assert x.shape == (0, 28, 28, 1) and y.shape == (0,)
                continue
            p = src[b.client_id]["pixels"]
            np.testing.assert_array_equal(x[..., 0], 255 - np.rint(p.astype(np.float64) * 255))
            np.testing.assert_array_equal(y, src[b.client_id]["label"])
    assert [(len(b.train_y), len(b.test_y)) for b in blocks] == [(2, 2), (3, 1), (1, 0)]
    src = reader.source()
    assert src.format == "fedjax" and src.files[0] == str(d / "federated_emnist_train.sqlite")


def test_same_blocks_as_the_tff_reader(tmp_path):
    # The same Shakespeare and Stack Overflow data in both formats read back identically.
    train = {"A_KING": [b"to be", b"or not"], "B_QUEEN": [b"hi"]}
    test = {"A_KING": [b"x"], "C_FOOL": [b"fa la"]}
    for split, clients in (("train", train), ("test", test)):
        write_sqlite(tmp_path / f"shakespeare_{split}.sqlite",
                     {c: {"snippets": s} for c, s in clients.items()})
        with h5py.File(tmp_path / f"shakespeare_{split}.h5", "w") as f:
            for c, s in clients.items():
                f.create_dataset(f"examples/{c}/snippets", data=np.array(s, dtype=object),
                                 dtype=h5py.string_dtype())
    (tmp_path / "stackoverflow.word_count").write_text("the 9\nto 8\nbe 7\n")
    (tmp_path / "stackoverflow.tag_count").write_text(json.dumps({"py": 2, "c": 1}))
    so = {"1": {"tokens": [b"to be the", b"or"], "title": [b"be", b""], "tags": [b"py|c", b""]}}
    for split in ("train", "test"):
        write_sqlite(tmp_path / f"stackoverflow_{split}.sqlite", so)
        with h5py.File(tmp_path / f"stackoverflow_{split}.h5", "w") as f:
            for k, v in so["1"].items():
                f.create_dataset(f"examples/1/{k}", data=np.array(v, dtype=object),
                                 dtype=h5py.string_dtype())
    for name, opts in (("shakespeare", {"sequence_length": 4}),
                       ("stackoverflow_nwp", {"sequence_length": 5}),
                       ("stackoverflow_tp", {"max_tokens": 4})):
        a = list(fedjax_sqlite.open_fedjax(name, str(tmp_path), **opts).clients())
        b = list(tff.open_tff(name, str(tmp_path), **opts).clients())
        assert [x.client_id for x in a] == [x.client_id for x in b]
        for x, y in zip(a, b):
            for u, v in zip(x[1:], y[1:]):
                np.testing.assert_array_equal(u, v)
    first = list(fedjax_sqlite.open_fedjax("shakespeare", str(tmp_path),
                                           sequence_length=4).clients())
    assert [(b.client_id, len(b.train_x), len(b.test_x)) for b in first] == [
        ("A_KING", 4, 1), ("B_QUEEN", 1, 0), ("C_FOOL", 0, 2)]   # (J − 1)/4 rows, rounded up


def test_cifar100_test_clients_are_separate(tmp_path):
    rng = np.random.default_rng(1)
    mk = lambda n: {"image": rng.integers(0, 256, (n, 32, 32, 3)).astype(np.uint8),  # noqa: E731
                    "label": rng.integers(0, 100, n), "coarse_label": rng.integers(0, 20, n)}
    train, test = {"0": mk(2), "1": mk(1)}, {"0": mk(3)}
    write_sqlite(tmp_path / "federated_cifar100_train.sqlite", train)
    write_sqlite(tmp_path / "federated_cifar100_test.sqlite", test)
    blocks = list(fedjax_sqlite.open_fedjax("cifar100_fl", str(tmp_path)).clients())
    assert [(b.client_id, len(b.train_y), len(b.test_y)) for b in blocks] == [
        ("0", 2, 0), ("1", 1, 0), ("test/0", 0, 3)]
    np.testing.assert_array_equal(blocks[2].test_x, test["0"]["image"])
    np.testing.assert_array_equal(blocks[2].test_y, test["0"]["label"])


# --- Errors ------------------------------------------------------------------------------------

def test_absent_files_one_line(tmp_path):
    with pytest.raises(DatasetNotFoundError) as e:
        fedjax_sqlite.open_fedjax("shakespeare", str(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg
    assert "shakespeare_train.sqlite, shakespeare_test.sqlite" in msg
    assert "fedjax.datasets.shakespeare.load_data()" in msg and "~/.cache/fedjax" in msg
    assert "https://storage.googleapis.com/gresearch/fedjax/shakespeare/" in msg
    assert fedjax_sqlite.detect(str(tmp_path), "shakespeare") is False


def test_not_a_database(emnist_dir):
    d, _, _ = emnist_dir
    (d / "federated_emnist_test.sqlite").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(DataFormatError, match=r"federated_emnist_test\.sqlite: not a FedJAX SQLite"):
        fedjax_sqlite.open_fedjax("emnist62", str(d))


def test_wrong_table(emnist_dir):
    d, _, _ = emnist_dir
    path = d / "federated_emnist_test.sqlite"
    path.unlink()
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE examples (split_name TEXT, client_id TEXT, "
                 "serialized_example_proto BLOB)")     # TFF's SQLite layout, not FedJAX's
    conn.close()
    with pytest.raises(DataFormatError, match=r"federated_emnist_test\.sqlite: .*federated_data"):
        fedjax_sqlite.open_fedjax("emnist62", str(d))


@pytest.mark.parametrize("row, num_examples, what", [
    (b"\x00garbage", None, r"not zlib-compressed FedJAX msgpack"),
    ({"label": np.zeros(2, np.int32)}, None, r"feature\(s\) \['pixels'\] missing"),
    ({"pixels": np.ones((2, 28, 28), np.float32), "label": np.array([0, 99], np.int32)}, None,
     r"'label' outside \[0, 62\)"),
    ({"pixels": np.ones((2, 28, 28), np.float32), "label": np.zeros(2, np.int32)}, 5,
     r"num_examples is 5 but the data hold 2"),
])
def test_bad_client_names_file_and_client(emnist_dir, row, num_examples, what):
    d, train, _ = emnist_dir
    cid = "00aa11bb22cc33dd:f0001_41"
    path = d / "federated_emnist_train.sqlite"
    path.unlink()
    write_sqlite(path, {k: v for k, v in train.items() if k != cid})
    conn = sqlite3.connect(path)
    data = row if isinstance(row, bytes) else blob(row)
    conn.execute("INSERT INTO federated_data VALUES (?, ?, ?)",
                 (cid.encode(), data, num_examples if num_examples is not None else 2))
    conn.commit()
    conn.close()
    it = fedjax_sqlite.open_fedjax("emnist62", str(d)).clients()
    # Lazy: the clients before the bad one come out first (cid sorts first here).
    with pytest.raises(DataFormatError, match=rf"federated_emnist_train\.sqlite, client '{cid}': "
                                              + what) as e:
        list(it)
    assert "\n" not in str(e.value) and e.value.client == cid


def test_a_client_id_that_repeats_after_decoding_is_refused_naming_file_and_client(emnist_dir):
    """FedJAX stores ids as BLOBs; a file that also holds the same id as TEXT has two distinct
    keys (SQLite's PRIMARY KEY tells a BLOB from a TEXT) that decode to one client id. Merging
    them would drop a client's data: refused, in one line naming the file and the client."""
    d, train, _ = emnist_dir
    cid = "00aa11bb22cc33dd:f0001_41"
    path = d / "federated_emnist_train.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("INSERT INTO federated_data VALUES (?, ?, ?)",
                 (cid, blob(emnist_client(np.random.default_rng(1), 2)), 2))
    conn.commit()
    stored = conn.execute("SELECT COUNT(*), COUNT(DISTINCT client_id) FROM federated_data").fetchone()
    conn.close()
    assert stored == (len(train) + 1, len(train) + 1)      # distinct as stored
    with pytest.raises(DataFormatError, match=rf"federated_emnist_train\.sqlite, client '{cid}': "
                                              r"client id repeats after UTF-8 decoding") as e:
        list(fedjax_sqlite.open_fedjax("emnist62", str(d)).clients())
    assert "\n" not in str(e.value) and e.value.client == cid
    assert e.value.path == str(path)


def test_clients_are_read_one_at_a_time(emnist_dir):
    d, train, _ = emnist_dir
    path = d / "federated_emnist_train.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("UPDATE federated_data SET data = ? WHERE client_id = ?",
                 (b"broken", "0123456789abcdef:f0000_14".encode()))   # the second client
    conn.commit()
    conn.close()
    it = fedjax_sqlite.open_fedjax("emnist62", str(d)).clients()
    first = next(it)
    assert first.client_id == "00aa11bb22cc33dd:f0001_41" and len(first.train_y) == 2
    with pytest.raises(DataFormatError, match="client '0123456789abcdef:f0000_14'"):
        next(it)


def test_emnist_off_grid_pixels_round_to_nearest_counted_or_refused(tmp_path):
    """FedJAX's EMNIST pixels take the TFF reader's policy: nearest level, counted, or refused."""
    pixels = np.ones((2, 28, 28), np.float32)
    pixels[1, 3, 4] = 0.998 * 200 / 255                    # 199.6 levels: nearest 200, stored 55
    ex = {"pixels": pixels, "label": np.zeros(2, np.int32)}
    write_sqlite(tmp_path / "federated_emnist_train.sqlite", {"a": ex})
    write_sqlite(tmp_path / "federated_emnist_test.sqlite", {"a": ex})
    reader = fedjax_sqlite.open_fedjax("emnist62", str(tmp_path))
    [block] = list(reader.clients())
    assert block.train_x[1, 3, 4, 0] == 55 and block.test_x[1, 3, 4, 0] == 55
    assert reader.source().rounded == 2
    with pytest.raises(DataFormatError, match=r"client 'a': 'pixels' has 1 value\(s\) off the k/255 grid"):
        list(fedjax_sqlite.open_fedjax("emnist62", str(tmp_path), quantise="refuse").clients())
