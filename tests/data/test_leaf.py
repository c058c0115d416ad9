"""Tests for fedjax_pfl.data.leaf, the LEAF JSON reader.

Every fixture is written here in LEAF's real layout (``leaf/data/<name>/data/{train,test}/`` with
two shard files per split, the keys ``users``/``num_samples``/``user_data``, and the values as
LEAF's preprocessing scripts write them). Expected arrays come from what the test wrote and from
the mappings the module documents, recomputed here independently (the alphabet is spelt out
again, words are tokenised by hand), never from the reader.
"""

from __future__ import annotations

import collections
import json
import string
from pathlib import Path

import numpy as np
import pytest

from fedjax_pfl.data import leaf
from fedjax_pfl.data.natural import DataFormatError
from fedjax_pfl.data.sources import DatasetNotFoundError

# LEAF's language_utils.ALL_LETTERS, rebuilt from its parts: newline, space and punctuation,
# digits, four more marks, A-Z, brackets, a-z, closing brace.
LETTERS = ("\n !\"&'(),-." + string.digits + ":;>?" + string.ascii_uppercase + "[]"
           + string.ascii_lowercase + "}")
assert len(LETTERS) == 80


def char_id(c: str) -> int:
    """The documented mapping: LEAF position + 1, and 0 outside the alphabet."""
    return LETTERS.index(c) + 1 if c in LETTERS else 0


def write_shard(path: Path, users: dict[str, tuple[list, list]], *, num_samples=None,
                hierarchies: bool = False) -> None:
    """One LEAF JSON shard, laid out as LEAF's split_data.py writes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    names = list(users)
    data = {"users": names,
            "num_samples": num_samples or [len(users[u][1]) for u in names],
            "user_data": {u: {"x": users[u][0], "y": users[u][1]} for u in names}}
    if hierarchies:
        data["hierarchies"] = ["SOME_PLAY"] * len(names)
    path.write_text(json.dumps(data))


def shard_path(root: Path, split: str, i: int) -> Path:
    return root / "data" / split / f"all_data_{i}_niid_1_keep_0_{split}_9.json"


def read_all(reader) -> list:
    return list(reader.clients())


# ---------------------------------------------------------------------------------------------
# FEMNIST


# (user, split, shard) -> number of samples. f0003_22 is only in train; shards hold the users in
# an order that is not sorted, and one user's train and test sit in different shard numbers.
FEMNIST_LAYOUT = {
    ("f0003_22", "train", 0): 3, ("f0001_00", "train", 0): 4, ("f0002_11", "train", 1): 2,
    ("f0002_11", "test", 0): 1, ("f0001_00", "test", 1): 2,
}


def write_femnist(root: Path, seed: int = 0) -> dict:
    """Writes a two-shard FEMNIST; returns {(user, split): (grey levels [n, 784] uint8, labels)}."""
    rng = np.random.default_rng(seed)
    shards: dict = collections.defaultdict(dict)
    written = {}
    for (user, split, i), n in FEMNIST_LAYOUT.items():
        grey = rng.integers(0, 256, size=(n, 784)).astype(np.uint8)
        grey[:, :28] = 255                           # a white top row: NIST's background
        labels = rng.integers(0, 62, size=n)
        labels[0] = 61 if split == "train" else 0   # both ends of the label range
        # data_to_json.py: vec = np.asarray(gray).flatten() / 255; vec.tolist()
        shards[(split, i)][user] = ((grey / 255).tolist(), [int(v) for v in labels])
        written[(user, split)] = (grey, labels)
    for (split, i), users in shards.items():
        write_shard(shard_path(root, split, i), users)
    return written


def test_femnist_reads_back_pixels_labels_clients_and_order(tmp_path):
    root = tmp_path / "leaf" / "data" / "femnist"
    written = write_femnist(root)
    reader = leaf.open_leaf("femnist", root)
    task, src = reader.task(), reader.source()
    assert (task.kind, task.num_classes, task.inputs, task.default_model) == (
        "classify", 62, "image", "femnist_cnn")
    assert src.format == "leaf" and src.name == "femnist"
    assert sorted(src.files) == sorted(str(p.resolve()) for p in root.glob("data/*/*.json"))
    assert len(src.files) == 4
    blocks = read_all(reader)
    assert [b.client_id for b in blocks] == ["f0001_00", "f0002_11", "f0003_22"]
    for b in blocks:
        for split, x, y in (("train", b.train_x, b.train_y), ("test", b.test_x, b.test_y)):
            grey, labels = written.get((b.client_id, split), (np.zeros((0, 784), np.uint8), []))
            assert x.dtype == np.uint8 and x.shape == (len(labels), 28, 28, 1)
            assert y.dtype == np.int32
            # Row-major 28×28, as LEAF's CNN reshapes the 784 vector; grey levels not inverted.
            np.testing.assert_array_equal(x, grey.reshape(-1, 28, 28, 1))
            np.testing.assert_array_equal(y, labels)
            # What the model sees equals what LEAF stored (and LEAF's CNN is fed): k / 255.
            seen = x.astype(np.float32) * src.input_scale + src.input_shift
            np.testing.assert_allclose(seen.reshape(-1, 784), grey / 255.0, atol=1e-6)
    f3 = blocks[2]
    assert f3.train_x.shape[0] == 3 and f3.test_x.shape == (0, 28, 28, 1)
    assert f3.test_y.shape == (0,)
    # The background (LEAF's 1.0) is grey level 255 and reaches the model as 1.0.
    assert (blocks[0].train_x[:, 0, :, 0] == 255).all()
    assert src.input_scale * 255 + src.input_shift == pytest.approx(1.0)
    assert src.labels[10] == "A" and src.labels[36] == "a" and src.labels[61] == "z"


def test_layout_nestings_and_detect(tmp_path):
    """DIR may be leaf/data/<name>, its data/ folder, leaf/data or the checkout (with a name)."""
    checkout = tmp_path / "leaf"
    write_femnist(checkout / "data" / "femnist")
    inner = checkout / "data" / "femnist" / "data"
    for d, name in ((inner, None), (inner.parent, None), (checkout / "data", "femnist"),
                    (checkout, "femnist")):
        assert leaf.detect(d, name), d
        ids = [b.client_id for b in leaf.open_leaf("femnist", d).clients()]
        assert ids == ["f0001_00", "f0002_11", "f0003_22"]
    assert not leaf.detect(checkout)                  # without the name the nesting is unknown
    assert not leaf.detect(tmp_path / "nothing")
    for p in (inner / "test").glob("*.json"):         # train without test is not LEAF's output
        p.unlink()
    assert not leaf.detect(inner)


def test_missing_files_one_line_with_the_leaf_command(tmp_path):
    with pytest.raises(DatasetNotFoundError, match=r"train,test\}/\*\.json.*preprocess\.sh -s "
                                                   r"niid --sf 1\.0 -k 0 -t sample") as e:
        leaf.open_leaf("femnist", tmp_path)
    assert "\n" not in str(e.value) and str(tmp_path) in str(e.value)
    with pytest.raises(ValueError, match="max_vocab"):
        leaf.open_leaf("femnist", tmp_path, max_vocab=5)   # an option another dataset has
    with pytest.raises(ValueError, match="one of"):
        leaf.open_leaf("emnist", tmp_path)


# ---------------------------------------------------------------------------------------------
# Bad files: each gives one line naming the file and (where known) the client.


def _rewrite(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _truncate(path: Path) -> None:
    text = path.read_text()
    path.write_text(text[: len(text) // 2])


BAD_FILES = {
    # name: (file (split, shard), how it is spoilt, client named or None, message pattern)
    "truncated": (("train", 0), _truncate, None, "not valid JSON"),
    "missing key": (("test", 1), lambda p: _rewrite(p, lambda d: d.pop("num_samples")), None,
                    "missing key.*num_samples"),
    "num_samples": (("train", 1), lambda p: _rewrite(
        p, lambda d: d.__setitem__("num_samples", [5])), "f0002_11", "num_samples says 5 but x "
                                                                     "has 2"),
    "783 pixels": (("train", 0), lambda p: _rewrite(
        p, lambda d: d["user_data"]["f0001_00"]["x"][1].pop()), "f0001_00", "783 pixel.*784"),
    "label 62": (("test", 0), lambda p: _rewrite(
        p, lambda d: d["user_data"]["f0002_11"]["y"].__setitem__(0, 62)), "f0002_11",
        r"label 62 .*\[0, 62\)"),
    "label string": (("test", 0), lambda p: _rewrite(
        p, lambda d: d["user_data"]["f0002_11"]["y"].__setitem__(0, "7")), "f0002_11",
        "not a number"),
    "pixels 0..255": (("train", 1), lambda p: _rewrite(
        p, lambda d: d["user_data"]["f0002_11"]["x"][0].__setitem__(3, 255)), "f0002_11",
        r"x has 1 value\(s\) outside \[0, 1\] \(e\.g\. 255\.0 at \[0, 3\]\)"),
    "x y lengths": (("train", 1), lambda p: _rewrite(
        p, lambda d: d["user_data"]["f0002_11"]["y"].append(1)), "f0002_11",
        "x has 2 samples but y has 3"),
    "user without data": (("train", 1), lambda p: _rewrite(
        p, lambda d: (d["users"].append("ghost"), d["num_samples"].append(0))), "ghost",
        "absent from user_data"),
    "unlisted user": (("train", 1), lambda p: _rewrite(
        p, lambda d: d["user_data"].__setitem__("stray", {"x": [], "y": []})), "stray",
        "not listed in users"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_one_line_naming_file_and_client(tmp_path, case):
    root = tmp_path / "femnist"
    write_femnist(root)
    (split, i), spoil, client, pattern = BAD_FILES[case]
    path = shard_path(root, split, i)
    spoil(path)
    with pytest.raises(DataFormatError, match=pattern) as e:
        read_all(leaf.open_leaf("femnist", root))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(str(path.resolve()))
    assert e.value.client == client
    if client is not None:
        assert repr(client) in msg


def test_user_in_two_shards_of_one_split_is_refused(tmp_path):
    """Two LEAF runs' outputs left in one folder (LEAF's README asks to delete the old ones)."""
    root = tmp_path / "femnist"
    write_femnist(root)
    grey = np.full((1, 784), 255, np.uint8)
    write_shard(shard_path(root, "train", 2), {"f0002_11": ((grey / 255).tolist(), [4])})
    with pytest.raises(DataFormatError, match=r"all_data_2_.*'f0002_11'.*also in .*all_data_1_"):
        read_all(leaf.open_leaf("femnist", root))


# ---------------------------------------------------------------------------------------------
# Shakespeare


def test_shakespeare_character_ids_and_leaf_test_num_samples(tmp_path):
    root = tmp_path / "shakespeare"
    rng = np.random.default_rng(1)
    pool = LETTERS.replace("\n", "") + "é|\t"         # three characters outside the alphabet

    def windows(n):
        xs = ["".join(rng.choice(list(pool), size=80)) for _ in range(n)]
        return xs, [str(rng.choice(list(pool))) for _ in range(n)]

    layout = {("THE_TEMPEST_ARIEL", "train", 0): 3, ("HAMLET_HAMLET", "train", 1): 4,
              ("HAMLET_HAMLET", "test", 0): 2, ("THE_TEMPEST_ARIEL", "test", 1): 1,
              ("KING_LEAR_FOOL", "train", 1): 2}
    shards, written = collections.defaultdict(dict), {}
    for (user, split, i), n in layout.items():
        shards[(split, i)][user] = written[(user, split)] = windows(n)
    written[("HAMLET_HAMLET", "train")][0][0] = LETTERS[:80]   # every letter once, in order
    written[("HAMLET_HAMLET", "train")][1][0] = "é"            # an unknown next character
    for (split, i), users in shards.items():
        # split_data.py counts the 79 windows it leaves out in each test num_samples.
        extra = 79 if split == "test" else 0
        write_shard(shard_path(root, split, i), users, hierarchies=True,
                    num_samples=[len(users[u][1]) + extra for u in users])
    reader = leaf.open_leaf("shakespeare", root)
    task = reader.task()
    assert (task.num_classes, task.vocab_size, task.inputs, task.default_model) == (
        81, 81, "tokens", "char_lstm")
    assert reader.source().vocab[1:] == tuple(LETTERS)
    blocks = read_all(reader)
    assert [b.client_id for b in blocks] == ["HAMLET_HAMLET", "KING_LEAR_FOOL",
                                             "THE_TEMPEST_ARIEL"]
    for b in blocks:
        for split, x, y in (("train", b.train_x, b.train_y), ("test", b.test_x, b.test_y)):
            xs, ys = written.get((b.client_id, split), ([], []))
            assert x.dtype == np.int32 and x.shape == (len(xs), 80) and y.dtype == np.int32
            np.testing.assert_array_equal(x, np.array([[char_id(c) for c in s] for s in xs],
                                                      np.int32).reshape(-1, 80))
            np.testing.assert_array_equal(y, [char_id(c) for c in ys])
    hamlet = blocks[0]
    np.testing.assert_array_equal(hamlet.train_x[0], np.arange(1, 81))
    assert hamlet.train_y[0] == 0
    assert blocks[1].test_x.shape == (0, 80)
    # The test num_samples may be LEAF's (kept + 79) or exact; anything else is an error.
    _rewrite(shard_path(root, "test", 0), lambda d: d.__setitem__("num_samples", [2]))
    assert len(read_all(leaf.open_leaf("shakespeare", root))) == 3
    _rewrite(shard_path(root, "test", 0), lambda d: d.__setitem__("num_samples", [7]))
    with pytest.raises(DataFormatError, match="'HAMLET_HAMLET'.*num_samples says 7"):
        read_all(leaf.open_leaf("shakespeare", root))


def test_shakespeare_bad_window_names_file_and_client(tmp_path):
    root = tmp_path / "shakespeare"
    write_shard(shard_path(root, "train", 0), {"A_B": (["x" * 80, "y" * 79], ["a", "b"])})
    write_shard(shard_path(root, "test", 0), {"A_B": (["z" * 80], ["c"])})
    with pytest.raises(DataFormatError, match=r"train_9\.json, client 'A_B': x\[1\] is 79 "):
        read_all(leaf.open_leaf("shakespeare", root))
    write_shard(shard_path(root, "train", 0), {"A_B": (["x" * 80], ["ab"])})
    with pytest.raises(DataFormatError, match=r"client 'A_B': y\[0\] is 'ab'"):
        read_all(leaf.open_leaf("shakespeare", root))


# ---------------------------------------------------------------------------------------------
# Sent140


def record(text: str, user: str, i: int) -> list:
    """LEAF's x for one tweet: the CSV row after the polarity, text at field 4."""
    return [str(1000 + i), "Sat May 16 23:58:44 UTC 2009", "NO_QUERY", user, text, "training"]


# (user, split, shard) -> [(text, label, LEAF's split_line words written out by hand)]
LONG = " ".join(f"w{i}" for i in range(30))
SENT140 = {
    ("bob", "train", 0): [("I hate it.", 0, ["I", "hate", "it", "."]),
                          ("so sad ; really #fail", 0, ["so", "sad", ";", "really", "fail"])],
    ("alice", "train", 0): [("I love it!!", 1, ["I", "love", "it", "!", "!"]),
                            ("love love you", 1, ["love", "love", "you"])],
    ("carol", "train", 1): [("can't-stop @bob café", 1, ["can't", "stop", "bob", "café"]),
                            (LONG, 0, [f"w{i}" for i in range(30)])],
    ("alice", "test", 1): [("you love THIS THIS THIS", 1, ["you", "love", "THIS", "THIS",
                                                           "THIS"])],
    ("bob", "test", 0): [("hate hate hate it", 0, ["hate", "hate", "hate", "it"])],
}


def write_sent140(root: Path) -> None:
    shards = collections.defaultdict(dict)
    for (user, split, i), tweets in SENT140.items():
        xs = [record(t, user, j) for j, (t, _, _) in enumerate(tweets)]
        shards[(split, i)][user] = (xs, [lab for _, lab, _ in tweets])
    for (split, i), users in shards.items():
        write_shard(shard_path(root, split, i), users)


def expected_vocab(max_vocab: int, min_count: int) -> dict[str, int]:
    """The documented rule on the hand-split TRAINING words: by count, then string order."""
    counts = collections.Counter(w for (_, split, _), tw in SENT140.items() if split == "train"
                                 for _, _, words in tw for w in words)
    kept = sorted((w for w in counts if counts[w] >= min_count),
                  key=lambda w: (-counts[w], w))[:max_vocab]
    return {w: i + 1 for i, w in enumerate(kept)}


@pytest.mark.parametrize("max_vocab,min_count", [(10_000, 1), (4, 1), (10, 2)])
def test_sent140_vocabulary_ids_padding_and_labels(tmp_path, max_vocab, min_count):
    root = tmp_path / "sent140"
    write_sent140(root)
    reader = leaf.open_leaf("sent140", root, max_vocab=max_vocab, min_count=min_count)
    task = reader.task()
    assert (task.num_classes, task.vocab_size, task.inputs, task.default_model) == (
        2, max_vocab + 2, "tokens", "sent_lstm")
    vocab = expected_vocab(max_vocab, min_count)
    blocks = read_all(reader)
    assert [b.client_id for b in blocks] == ["alice", "bob", "carol"]
    for b in blocks:
        for split, x, y in (("train", b.train_x, b.train_y), ("test", b.test_x, b.test_y)):
            tweets = [t for (u, s, _), tw in SENT140.items() if (u, s) == (b.client_id, split)
                      for t in tw]
            want = np.zeros((len(tweets), 25), np.int32)          # 0 = padding, at the end
            for r, (_, _, words) in enumerate(tweets):
                want[r, :min(25, len(words))] = [vocab.get(w, max_vocab + 1)
                                                 for w in words[:25]]
            np.testing.assert_array_equal(x, want)
            np.testing.assert_array_equal(y, [lab for _, lab, _ in tweets])
    src = reader.source()
    assert len(src.vocab) == max_vocab + 2 and src.vocab[0] == "<pad>"
    assert src.vocab[-1] == "<oov>"
    assert {w: i for i, w in enumerate(src.vocab) if i in vocab.values()} == vocab
    assert ("max_vocab", str(max_vocab)) in src.options
    assert ("min_count", str(min_count)) in src.options


def test_sent140_hand_case(tmp_path):
    """Default options, shown arithmetic: training counts love 3, I 2, it 2, hate 1, ..."""
    root = tmp_path / "sent140"
    write_sent140(root)
    alice, bob, carol = read_all(leaf.open_leaf("sent140", root))
    # love=1; then the count-2 words in string order: '!' 2, 'I' 3, 'it' 4; then the 42
    # count-1 words in string order: '.' 5, ';' 6, bob 7, café 8, can't 9, fail 10, hate 11,
    # really 12, sad 13, so 14, stop 15, w0 w1 w10..w19 w2 w20..w29 w3..w9 16-45, you 46.
    np.testing.assert_array_equal(alice.train_x[0, :6], [3, 1, 4, 2, 2, 0])
    np.testing.assert_array_equal(alice.train_x[1, :4], [1, 1, 46, 0])
    np.testing.assert_array_equal(bob.train_x[0, :5], [3, 11, 4, 5, 0])
    np.testing.assert_array_equal(carol.train_x[0, :5], [9, 15, 7, 8, 0])
    np.testing.assert_array_equal(carol.train_x[1, :3], [16, 17, 28])   # w0 w1 w2
    # THIS appears only in the test split: out of vocabulary although it is frequent there.
    assert list(alice.test_x[0, 2:5]) == [10_001] * 3
    # The 30-word tweet keeps its first 25 words and no padding.
    assert (carol.train_x[1] != 0).all() and carol.train_x[1].shape == (25,)
    assert carol.test_x.shape == (0, 25)


def test_sent140_bare_text_and_bad_record(tmp_path):
    root = tmp_path / "sent140"
    write_shard(shard_path(root, "train", 0), {"u1": (["good day", record("bad day", "u1", 0)],
                                                      [1, 0])})
    write_shard(shard_path(root, "test", 0), {"u1": ([["too", "short"]], [1])})
    with pytest.raises(DataFormatError, match=r"test_9\.json, client 'u1': x\[0\] is not LEAF"):
        read_all(leaf.open_leaf("sent140", root))
    write_shard(shard_path(root, "test", 0), {"u1": (["day"], [1])})
    (u1,) = read_all(leaf.open_leaf("sent140", root))
    # day 2, bad 1, good 1 -> day=1, bad=2, good=3.
    np.testing.assert_array_equal(u1.train_x[:, :3], [[3, 1, 0], [2, 1, 0]])
    np.testing.assert_array_equal(u1.test_x[0, :2], [1, 0])


# ---------------------------------------------------------------------------------------------
# CelebA


def test_celeba_images_resized_and_missing_folder(tmp_path):
    from PIL import Image

    root = tmp_path / "celeba"
    layout = {("7", "train", 0): 2, ("12", "train", 1): 1, ("12", "test", 0): 1,
              ("7", "test", 1): 1}
    shards, colours, k = collections.defaultdict(dict), {}, 0
    for (user, split, i), n in layout.items():
        names = [f"{k + j:06d}.jpg" for j in range(n)]
        k += n
        # metadata_to_json.py writes the smile label as (int + 1) / 2, a float.
        shards[(split, i)][user] = (names, [float(j % 2) for j in range(n)])
        colours[(user, split)] = names
    for (split, i), users in shards.items():
        write_shard(shard_path(root, split, i), users)
    with pytest.raises(DatasetNotFoundError, match="img_align_celeba.*does not exist"):
        leaf.open_leaf("celeba", root)
    img_dir = root / "data" / "raw" / "img_align_celeba"
    img_dir.mkdir(parents=True)
    rgb = {}
    for names in colours.values():
        for j, name in enumerate(names):
            c = (int(name[:6]) * 40 % 256, 17, 200)
            mode_grey = int(name[:6]) == 3           # one grey image: converted to RGB
            img = Image.new("L", (100, 90), 77) if mode_grey else Image.new("RGB", (100, 90), c)
            img.save(img_dir / name, format="PNG")   # PNG content, LEAF's .jpg name
            rgb[name] = (77, 77, 77) if mode_grey else c
    reader = leaf.open_leaf("celeba", root)
    assert reader.task().default_model == "cnn" and reader.task().num_classes == 2
    blocks = read_all(reader)
    assert [b.client_id for b in blocks] == ["12", "7"]
    for b in blocks:
        for split, x, y in (("train", b.train_x, b.train_y), ("test", b.test_x, b.test_y)):
            names = colours[(b.client_id, split)]
            assert x.shape == (len(names), 84, 84, 3) and x.dtype == np.uint8
            for img, name in zip(x, names):          # a uniform image stays uniform
                np.testing.assert_array_equal(img, np.broadcast_to(rgb[name], (84, 84, 3)))
            np.testing.assert_array_equal(y, [j % 2 for j in range(len(names))])
    (img_dir / "000000.jpg").unlink()
    with pytest.raises(DataFormatError, match=r"client '7': image '000000\.jpg' is not in"):
        read_all(leaf.open_leaf("celeba", root))


# ---------------------------------------------------------------------------------------------
# Values off LEAF's k/255 grid: the readers' one quantisation policy (natural.Quantiser)


def write_off_grid_femnist(root: Path) -> tuple[np.ndarray, int]:
    """One user whose pixels are k/255 but for a few written off the grid; returns the grey
    levels the nearest-level rule gives (worked out by hand below) and how many moved."""
    k = np.full((2, 784), 255, np.int64)
    values = (k / 255).tolist()
    expected = k.copy()
    # (sample, pixel, value written, nearest level): 0.998·200/255 is 199.6 levels, nearest
    # 200 (truncation would give 199); 0.998·10/255 is 9.98 → 10; (37 + 0.4)/255 → 37;
    # (37 + 0.6)/255 → 38; the ties 3.5 and 4.5 levels (exact in float64) → 4 and 4, to even.
    moved = [(0, 0, 0.998 * 200 / 255, 200), (0, 1, 0.998 * 10 / 255, 10),
             (1, 5, 37.4 / 255, 37), (1, 6, 37.6 / 255, 38), (1, 7, 3.5 / 255, 4),
             (1, 8, 4.5 / 255, 4)]
    for i, j, v, level in moved:
        values[i][j] = v
        expected[i, j] = level
    values[1][9], expected[1, 9] = 0.0, 0                  # on the grid: not counted
    write_shard(shard_path(root, "train", 0), {"f0000_00": (values, [3, 4])})
    write_shard(shard_path(root, "test", 0), {"f0000_00": ((k[:1] / 255).tolist(), [5])})
    return expected.astype(np.uint8).reshape(2, 28, 28, 1), len(moved)


def test_femnist_off_grid_pixels_round_to_nearest_and_are_counted(tmp_path):
    root = tmp_path / "femnist"
    expected, moved = write_off_grid_femnist(root)
    reader = leaf.open_leaf("femnist", root)
    assert reader.source().rounded == 0                       # nothing read yet
    [block] = read_all(reader)
    np.testing.assert_array_equal(block.train_x, expected)
    assert block.train_x[0, 0, 0, 0] == 200                    # round to nearest, not truncation
    assert reader.source().rounded == moved
    assert ("quantise", "round") in reader.source().options   # the cache key knows the policy
    read_all(reader)                                           # a second pass counts afresh
    assert reader.source().rounded == moved


def test_femnist_off_grid_pixels_refused_naming_count_file_client_and_option(tmp_path):
    root = tmp_path / "femnist"
    _, moved = write_off_grid_femnist(root)
    with pytest.raises(DataFormatError) as e:
        read_all(leaf.open_leaf("femnist", root, quantise="refuse"))
    msg = str(e.value)
    assert msg.startswith(str(shard_path(root, "train", 0).resolve()) + ", client 'f0000_00': ")
    assert f"x has {moved} value(s) off the k/255 grid" in msg
    assert "quantise refuse" in msg and "\n" not in msg
    assert e.value.arguments == [("quantise", "data")]


def test_quantise_policy_must_be_round_or_refuse(tmp_path):
    root = tmp_path / "femnist"
    write_off_grid_femnist(root)
    with pytest.raises(ValueError, match=r"^quantise must be one of \['round', 'refuse'\], "
                                         r"got 'truncate'$"):
        leaf.open_leaf("femnist", root, quantise="truncate")
