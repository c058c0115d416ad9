"""TFF HDF5 reader (data/tff.py) on small files written here in TFF's layout
(``examples/<client id>/<feature>``, TFF's dtypes, variable-length byte strings for text)."""

import json
import os
import tracemalloc

import h5py
import numpy as np
import pytest

from fedjax_pfl.data import natural, tff
from fedjax_pfl.data.natural import DataFormatError
from fedjax_pfl.data.sources import DatasetNotFoundError

STR = h5py.string_dtype("utf-8")        # what TFF's files hold for snippets / tokens / tags


def write_h5(path, clients):
    """clients: {id: {feature: array}} → examples/<id>/<feature>."""
    with h5py.File(path, "w") as f:
        g = f.create_group("examples")
        for cid, feats in clients.items():
            cg = g.create_group(cid)
            for name, arr in feats.items():
                if isinstance(arr, list):            # text
                    cg.create_dataset(name, data=np.array(arr, dtype=object), dtype=STR)
                else:
                    cg.create_dataset(name, data=arr)


def emnist_client(rng, n, num_classes=62):
    k = rng.integers(0, 256, size=(n, 28, 28))
    k[:, :4] = 255                                   # background rows: 1.0 in TFF's files
    pixels = (k / 255.0).astype(np.float32)
    return {"pixels": pixels, "label": rng.integers(0, num_classes, n).astype(np.int32)}


@pytest.fixture
def emnist_dir(tmp_path):
    rng = np.random.default_rng(0)
    train = {"f0001_41": emnist_client(rng, 2), "f0000_14": emnist_client(rng, 3),
             "f0002_00": emnist_client(rng, 4)}                 # only in train
    test = {"f0000_14": emnist_client(rng, 2), "f0001_41": emnist_client(rng, 1)}
    write_h5(tmp_path / "fed_emnist_train.h5", train)
    write_h5(tmp_path / "fed_emnist_test.h5", test)
    return tmp_path, train, test


def test_emnist_pixels_labels_ids_and_counts(emnist_dir):
    d, train, test = emnist_dir
    reader = tff.open_tff("emnist62", str(d))
    blocks = list(reader.clients())
    assert [b.client_id for b in blocks] == ["f0000_14", "f0001_41", "f0002_00"]
    assert [len(b.train_y) for b in blocks] == [3, 2, 4]
    assert [len(b.test_y) for b in blocks] == [2, 1, 0]
    for b in blocks:
        for x, y, src in ((b.train_x, b.train_y, train), (b.test_x, b.test_y, test)):
            if b.client_id not in src:
                assert x.shape == (0, 28, 28, 1) and y.shape == (0,)
                continue
            p, lab = src[b.client_id]["pixels"], src[b.client_id]["label"]
            assert x.dtype == np.uint8 and x.shape == (len(p), 28, 28, 1)
            # The documented mapping: u = 255 − 255 p (background 1.0 → 0) ...
            np.testing.assert_array_equal(x[..., 0], 255 - np.rint(p.astype(np.float64) * 255))
            assert (x[:, :4] == 0).all()
            # ... exact and invertible: p = (255 − u)/255 in float32, bit for bit.
            np.testing.assert_array_equal(((255 - x[..., 0].astype(np.float64)) / 255)
                                          .astype(np.float32), p)
            np.testing.assert_array_equal(y, lab)
            assert y.dtype == np.int32
    src = reader.source()
    assert src.format == "tff" and src.input_scale == pytest.approx(1 / 255) and src.input_shift == 0
    assert src.files == (str(d / "fed_emnist_train.h5"), str(d / "fed_emnist_test.h5"))
    assert all(os.path.isabs(f) for f in src.files)
    assert src.labels[10] == "A" and src.labels[36] == "a" and len(src.labels) == 62
    t = reader.task()
    assert (t.kind, t.num_classes, t.inputs, t.default_model) == ("classify", 62, "image", "femnist_cnn")


def test_emnist10_file_names_and_classes(tmp_path):
    rng = np.random.default_rng(1)
    write_h5(tmp_path / "fed_emnist_digitsonly_train.h5", {"a": emnist_client(rng, 2, 10)})
    write_h5(tmp_path / "fed_emnist_digitsonly_test.h5", {"a": emnist_client(rng, 1, 10)})
    assert tff.detect(str(tmp_path), "emnist10") and not tff.detect(str(tmp_path), "emnist62")
    reader = tff.open_tff("emnist10", str(tmp_path))
    assert reader.task().num_classes == 10
    bad = emnist_client(rng, 2, 62)
    bad["label"][:] = [3, 12]                               # a letter in the digits-only set
    write_h5(tmp_path / "fed_emnist_digitsonly_test.h5", {"a": bad})
    with pytest.raises(DataFormatError, match=r"fed_emnist_digitsonly_test\.h5, client 'a': "
                                              r"'label' outside \[0, 10\)"):
        list(tff.open_tff("emnist10", str(tmp_path)).clients())


def test_shakespeare_snippets_become_fedjax_windows(tmp_path):
    train = {"THE_TEMPEST_MIRANDA": ["hello", "hi there"], "ALL_S_WELL_KING": ["ab"]}
    test = {"THE_TEMPEST_MIRANDA": ["o"], "ALL_S_WELL_KING": ["x", "yz"]}
    write_h5(tmp_path / "shakespeare_train.h5", {c: {"snippets": s} for c, s in train.items()})
    write_h5(tmp_path / "shakespeare_test.h5", {c: {"snippets": s} for c, s in test.items()})
    reader = tff.open_tff("shakespeare", str(tmp_path), sequence_length=10)
    blocks = {b.client_id: b for b in reader.clients()}
    assert list(blocks) == ["ALL_S_WELL_KING", "THE_TEMPEST_MIRANDA"]
    m = blocks["THE_TEMPEST_MIRANDA"]
    # fedjax/datasets/shakespeare_test.py's golden values for the same snippets and length.
    np.testing.assert_array_equal(m.train_x, [[1, 4, 67, 5, 5, 26, 2, 1, 4, 68],
                                              [16, 7, 4, 67, 48, 67, 0, 0, 0, 0]])
    np.testing.assert_array_equal(m.train_y, [[4, 67, 5, 5, 26, 2, 1, 4, 68, 16],
                                              [7, 4, 67, 48, 67, 2, 0, 0, 0, 0]])
    o = 3 + "dhlptx@DHLPTX $(,048cgkoswCGKOSW".index("o")
    np.testing.assert_array_equal(m.test_x, [[1, o] + [0] * 8])
    np.testing.assert_array_equal(m.test_y, [[o, 2] + [0] * 8])
    k = blocks["ALL_S_WELL_KING"]
    assert k.train_x.shape == (1, 10) and k.test_x.shape == (1, 10)     # 3 + 5 tokens - 1 < 10
    assert reader.task().default_model == "char_lstm" and reader.source().vocab[89] == "<oov>"


@pytest.fixture
def so_dir(tmp_path):
    (tmp_path / "stackoverflow.word_count").write_text("the 50\ni 40\nto 30\nhow 20\nrare 1\n")
    (tmp_path / "stackoverflow.tag_count").write_text(json.dumps({"java": 3, "python": 7, "go": 1}))
    post = lambda toks, title, tags: (toks, title, tags)   # noqa: E731
    train = {"00012": [post("how to the", "i", "python|java"), post("i rare", "", "")],
             "00004": [post("zebra the", "to", "go|java")]}
    test = {"00012": [post("to", "the", "python")],
            "99999": [post("i", "", "java")]}                # a test-only user
    for split, clients in (("train", train), ("test", test)):
        write_h5(tmp_path / f"stackoverflow_{split}.h5", {
            c: {"tokens": [p[0] for p in ps], "title": [p[1] for p in ps],
                "tags": [p[2] for p in ps], "score": np.zeros(len(ps), np.int64),
                "type": ["question"] * len(ps)} for c, ps in clients.items()})
    return tmp_path


def test_stackoverflow_nwp(so_dir):
    reader = tff.open_tff("stackoverflow_nwp", str(so_dir), vocab_size=4, sequence_length=3)
    blocks = {b.client_id: b for b in reader.clients()}
    assert list(blocks) == ["00004", "00012", "99999"]
    # Ids: the 3, i 4, to 5, how 6 ("rare" is the 5th word, outside vocab_size=4), OOV 7.
    np.testing.assert_array_equal(blocks["00012"].train_x, [[1, 6, 5], [1, 4, 7]])
    np.testing.assert_array_equal(blocks["00012"].train_y, [[6, 5, 3], [4, 7, 2]])
    np.testing.assert_array_equal(blocks["00004"].train_x, [[1, 7, 3]])
    np.testing.assert_array_equal(blocks["00004"].train_y, [[7, 3, 2]])
    assert blocks["00004"].test_x.shape == (0, 3) and blocks["99999"].train_x.shape == (0, 3)
    np.testing.assert_array_equal(blocks["99999"].test_y, [[4, 2, 0]])
    t = reader.task()
    assert (t.num_classes, t.vocab_size, t.default_model) == (8, 8, "word_lstm")
    assert reader.source().files[2] == str(so_dir / "stackoverflow.word_count")
    assert ("vocab_size", "4") in reader.source().options


def test_stackoverflow_tp(so_dir):
    reader = tff.open_tff("stackoverflow_tp", str(so_dir), vocab_size=4, num_tags=2, max_tokens=3)
    blocks = {b.client_id: b for b in reader.clients()}
    # Bag ids: the 1, i 2, to 3, how 4; tags by count: python 0, java 1 (go is the 3rd).
    # Out-of-vocabulary words ("rare", "zebra") → V + 1 = 5: no feature, but in the bag's mean.
    np.testing.assert_array_equal(blocks["00012"].train_x, [[4, 3, 1], [2, 5, 0]])
    np.testing.assert_array_equal(blocks["00012"].train_y,
                                  [[0, 1, -1, -1, -1], [-1, -1, -1, -1, -1]])
    np.testing.assert_array_equal(blocks["00004"].train_x, [[5, 1, 3]])
    np.testing.assert_array_equal(blocks["00004"].train_y, [[1, -1, -1, -1, -1]])
    np.testing.assert_array_equal(blocks["00012"].test_x, [[3, 1, 0]])
    t = reader.task()
    assert (t.kind, t.num_classes, t.vocab_size, t.topk) == ("multilabel", 2, 5, 5)
    assert reader.source().labels == ("python", "java")


def cifar_client(rng, n):
    return {"image": rng.integers(0, 256, (n, 32, 32, 3)).astype(np.uint8),
            "label": rng.integers(0, 100, n).astype(np.int64),
            "coarse_label": rng.integers(0, 20, n).astype(np.int64)}


def test_cifar100_separate_and_paired_test_clients(tmp_path):
    rng = np.random.default_rng(2)
    train = {"0": cifar_client(rng, 3), "1": cifar_client(rng, 2)}
    test = {"0": cifar_client(rng, 2)}
    write_h5(tmp_path / "fed_cifar100_train.h5", train)
    write_h5(tmp_path / "fed_cifar100_test.h5", test)
    blocks = list(tff.open_tff("cifar100_fl", str(tmp_path)).clients())
    assert [(b.client_id, len(b.train_y), len(b.test_y)) for b in blocks] == [
        ("0", 3, 0), ("1", 2, 0), ("test/0", 0, 2)]
    np.testing.assert_array_equal(blocks[0].train_x, train["0"]["image"])
    np.testing.assert_array_equal(blocks[0].train_y, train["0"]["label"])
    np.testing.assert_array_equal(blocks[2].test_x, test["0"]["image"])
    paired = list(tff.open_tff("cifar100_fl", str(tmp_path), test_clients="paired",
                               coarse=True).clients())
    assert [(b.client_id, len(b.train_y), len(b.test_y)) for b in paired] == [("0", 3, 2), ("1", 2, 0)]
    np.testing.assert_array_equal(paired[0].test_y, test["0"]["coarse_label"])
    reader = tff.open_tff("cifar100_fl", str(tmp_path), coarse=True)
    assert reader.task().num_classes == 20 and reader.task().default_model == "resnet18"
    assert (reader.source().input_scale, reader.source().input_shift) == pytest.approx((2 / 255, -1))


# --- Errors ------------------------------------------------------------------------------------

def test_absent_files_one_line(tmp_path):
    with pytest.raises(DatasetNotFoundError) as e:
        tff.open_tff("emnist62", str(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg
    assert "fed_emnist_train.h5, fed_emnist_test.h5" in msg and str(tmp_path) in msg
    assert "tff.simulation.datasets.emnist.load_data(only_digits=False)" in msg
    assert "~/.keras/datasets" in msg
    assert "https://storage.googleapis.com/tff-datasets-public/fed_emnist.tar.bz2" in msg
    write_h5(tmp_path / "stackoverflow_train.h5", {})
    write_h5(tmp_path / "stackoverflow_test.h5", {})
    with pytest.raises(DatasetNotFoundError, match=r"stackoverflow\.word_count, "
                                                   r"stackoverflow\.tag_count not found"):
        tff.open_tff("stackoverflow_tp", str(tmp_path))


def test_truncated_file(emnist_dir):
    d, _, _ = emnist_dir
    path = d / "fed_emnist_test.h5"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    with pytest.raises(DataFormatError, match=r"fed_emnist_test\.h5: not a readable HDF5 file") as e:
        tff.open_tff("emnist62", str(d))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("feats, what", [
    ({"label": np.zeros(2, np.int32)}, r"feature\(s\) \['pixels'\] missing"),
    ({"pixels": np.ones((2, 28, 27), np.float32), "label": np.zeros(2, np.int32)},
     r"'pixels' must be float \[n, 28, 28\]"),
    ({"pixels": np.ones((2, 28, 28), np.float32), "label": np.array([0, 62], np.int32)},
     r"'label' outside \[0, 62\)"),
    ({"pixels": np.full((2, 28, 28), 2.0, np.float32), "label": np.zeros(2, np.int32)},
     r"'pixels' has 1568 value\(s\) outside \[0, 1\]"),
    ({"pixels": np.ones((3, 28, 28), np.float32), "label": np.zeros(2, np.int32)},
     r"features differ in length"),
    ({"pixels": np.ones((2, 28, 28), np.float32), "label": np.zeros(2, np.float32)},
     r"'label' must be \[n\] integers"),
])
def test_bad_client_names_file_and_client(emnist_dir, feats, what):
    d, train, _ = emnist_dir
    write_h5(d / "fed_emnist_train.h5", {**train, "f0001_41": feats})
    with pytest.raises(DataFormatError, match=r"fed_emnist_train\.h5, client 'f0001_41': " + what) as e:
        list(tff.open_tff("emnist62", str(d)).clients())
    assert "\n" not in str(e.value) and e.value.client == "f0001_41"


def test_no_examples_group(emnist_dir):
    d, _, _ = emnist_dir
    with h5py.File(d / "fed_emnist_test.h5", "w") as f:
        f.create_group("data")
    with pytest.raises(DataFormatError, match=r"fed_emnist_test\.h5: no top-level group 'examples'"):
        tff.open_tff("emnist62", str(d))


def test_unknown_option():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['sequence_length'\]"):
        tff.open_tff("emnist62", "/nonexistent", sequence_length=3)


# --- Laziness ----------------------------------------------------------------------------------

def test_clients_are_read_one_at_a_time(emnist_dir):
    # A bad second client is only found when the generator reaches it: the first client is
    # yielded before the second client's group is read.
    d, train, _ = emnist_dir
    write_h5(d / "fed_emnist_train.h5", {**train, "f0001_41": {"label": np.zeros(2, np.int32)}})
    it = tff.open_tff("emnist62", str(d)).clients()
    first = next(it)
    assert first.client_id == "f0000_14" and len(first.train_y) == 3
    with pytest.raises(DataFormatError, match="client 'f0001_41'"):
        next(it)


def test_memory_holds_one_client(tmp_path):
    # 16 clients of 200 images (0.63 MB of float32 pixels each, 10 MB in all): taking the first
    # client allocates a few copies of one client (read, convert), not the file.
    rng = np.random.default_rng(3)
    clients = {f"c{i:02d}": emnist_client(rng, 200) for i in range(16)}
    write_h5(tmp_path / "fed_emnist_train.h5", clients)
    write_h5(tmp_path / "fed_emnist_test.h5", {"c00": emnist_client(rng, 1)})
    reader = tff.open_tff("emnist62", str(tmp_path))
    one_client = clients["c00"]["pixels"].nbytes
    tracemalloc.start()
    try:
        it = reader.clients()
        block = next(it)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert block.client_id == "c00"
    assert peak < 5 * one_client, (peak, one_client)
    assert len(list(it)) == 15


def test_reader_satisfies_protocol(emnist_dir):
    reader = tff.open_tff("emnist62", str(emnist_dir[0]))
    assert isinstance(reader.task(), natural.Task)
    assert isinstance(reader.source(), natural.SourceInfo)
    assert all(isinstance(b, natural.ClientBlock) for b in reader.clients())


def test_emnist_off_grid_pixels_round_to_nearest_counted_or_refused(tmp_path):
    """TFF's float32 pixels off the k/255 grid follow the readers' one policy: stored at the
    nearest level (255 − k after the background inversion) and counted, or refused."""
    k = np.full((1, 28, 28), 255, np.int64)
    pixels = (k / 255.0).astype(np.float32)
    # 0.998·200/255 is 199.6 levels: nearest 200 (stored 55); truncation would give 199 (56).
    pixels[0, 0, 0], k[0, 0, 0] = 0.998 * 200 / 255, 200
    pixels[0, 0, 1], k[0, 0, 1] = 37.6 / 255, 38
    pixels[0, 0, 2], k[0, 0, 2] = 0.0, 0                     # on the grid
    label = np.zeros(1, np.int32)
    write_h5(tmp_path / "fed_emnist_train.h5", {"f0000_00": {"pixels": pixels, "label": label}})
    write_h5(tmp_path / "fed_emnist_test.h5", {"f0000_00": {"pixels": pixels, "label": label}})
    reader = tff.open_tff("emnist62", str(tmp_path))
    [block] = list(reader.clients())
    np.testing.assert_array_equal(block.train_x[..., 0], 255 - k)
    assert block.train_x[0, 0, 0, 0] == 55
    assert reader.source().rounded == 4                      # 2 per split
    assert ("quantise", "round") in reader.source().options
    with pytest.raises(DataFormatError) as e:
        list(tff.open_tff("emnist62", str(tmp_path), quantise="refuse").clients())
    msg = str(e.value)
    assert msg.startswith(str(tmp_path / "fed_emnist_train.h5") + ", client 'f0000_00': ")
    assert "'pixels' has 2 value(s) off the k/255 grid" in msg and "quantise refuse" in msg
    with pytest.raises(ValueError, match=r"quantise must be one of \['round', 'refuse'\]"):
        tff.open_tff("emnist62", str(tmp_path), quantise="floor")
