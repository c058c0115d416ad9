"""The client-sorted cache (data/cache.py): round trip, staleness, no partial cache, subsets.

Everything runs against a fake in-test reader (task(), source(), clients()) whose blocks the test
knows, so each check compares the cache with what was written, not with the cache's own code.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from fedjax_pfl.data import cache
from fedjax_pfl.data.natural import ClientBlock, DataFormatError, NaturalClients, SourceInfo, Task

TASK = Task(kind="classify", num_classes=5, inputs="image", default_model="cnn")


def make_blocks(counts, seed=0, shape=(3, 2, 1)):
    """One ClientBlock per (n_train, n_test) in `counts`, with distinct random contents."""
    rng = np.random.default_rng(seed)
    return [ClientBlock(f"client_{i:03d}",
                        rng.integers(0, 256, (n, *shape), dtype=np.uint8), rng.integers(0, 5, n).astype(np.int32),
                        rng.integers(0, 256, (m, *shape), dtype=np.uint8), rng.integers(0, 5, m).astype(np.int32))
            for i, (n, m) in enumerate(counts)]


class FakeReader:
    """A NaturalReader over in-memory blocks; `files` are real files in a temporary directory
    (the staleness check stats them). `fail_after` raises `error` after that many blocks."""

    def __init__(self, data_dir, blocks, *, files=("a.json", "b.json"), options=(("seq_len", "80"),),
                 task=TASK, fail_after=None, error=None, name="fake"):
        self.blocks, self.task_, self.fail_after, self.error = blocks, task, fail_after, error
        self.paths = []
        for f in files:
            path = os.path.join(data_dir, f)
            if not os.path.exists(path):
                with open(path, "w") as fh:
                    fh.write("x" * 10)
            self.paths.append(path)
        self.info = SourceInfo(name=name, format="leaf", files=tuple(self.paths), input_scale=1 / 255,
                               input_shift=-0.5, vocab=(), labels=("a", "b", "c", "d", "e"), options=options)
        self.calls = 0

    def task(self):
        return self.task_

    def source(self):
        return self.info

    def clients(self):
        self.calls += 1
        for i, b in enumerate(self.blocks):
            if self.fail_after is not None and i == self.fail_after:
                raise self.error
            yield b


def load(reader, root):
    msgs = []
    nc = cache.load(reader, str(root), log=msgs.append)
    return nc, msgs


def assert_matches(nc: NaturalClients, blocks, reader):
    """The cache holds exactly the blocks: per-client slices, offsets from the counts, ids, task
    and source."""
    assert nc.num_clients == len(blocks)
    assert list(nc.client_ids) == [b.client_id for b in blocks]
    train_n = [len(b.train_y) for b in blocks]
    test_n = [len(b.test_y) for b in blocks]
    assert nc.train_offsets.tolist() == [sum(train_n[:i]) for i in range(len(blocks) + 1)]
    assert nc.test_offsets.tolist() == [sum(test_n[:i]) for i in range(len(blocks) + 1)]
    for i, b in enumerate(blocks):
        s, e = nc.train_offsets[i], nc.train_offsets[i + 1]
        np.testing.assert_array_equal(nc.train_x[s:e], b.train_x)
        np.testing.assert_array_equal(nc.train_y[s:e], b.train_y)
        s, e = nc.test_offsets[i], nc.test_offsets[i + 1]
        np.testing.assert_array_equal(nc.test_x[s:e], b.test_x)
        np.testing.assert_array_equal(nc.test_y[s:e], b.test_y)
    np.testing.assert_array_equal(nc.train_x, np.concatenate([b.train_x for b in blocks]))
    np.testing.assert_array_equal(nc.test_y, np.concatenate([b.test_y for b in blocks]))
    assert nc.train_x.dtype == np.uint8 and nc.train_y.dtype == np.int32
    assert nc.task == reader.task()
    assert nc.source == reader.source()


COUNTS = [(4, 1), (1, 0), (7, 3), (2, 2), (5, 1)]


def test_round_trip_memmapped_and_meta(tmp_path):
    blocks = make_blocks(COUNTS)
    reader = FakeReader(str(tmp_path), blocks)
    nc, msgs = load(reader, tmp_path / "cache")
    assert reader.calls == 1 and len(msgs) == 2 and "converting" in msgs[0]
    assert_matches(nc, blocks, reader)
    for name in cache.ARRAYS:
        arr = getattr(nc, name)
        assert isinstance(arr, np.memmap) and not arr.flags.writeable
    cache_dir = tmp_path / "cache" / cache.cache_key(reader.source())
    meta = json.loads((cache_dir / "meta.json").read_text())
    assert meta["format_version"] == cache.FORMAT_VERSION
    assert meta["num_clients"] == 5 and meta["num_train"] == 19 and meta["num_test"] == 7
    assert meta["task"]["default_model"] == "cnn" and meta["conversion_seconds"] >= 0
    for entry, path in zip(meta["source"]["files"], reader.paths):
        st = os.stat(path)
        assert entry == {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    assert meta["arrays"]["train_x"] == {"dtype": "|u1", "shape": [3, 2, 1], "rows": 19}
    # One file per array, training rows then held-out rows: FederatedData's layout, mapped whole.
    assert os.path.getsize(cache_dir / "x.bin") == (19 + 7) * 6
    assert sorted(f for f in os.listdir(cache_dir) if f.endswith(".bin")) == [
        "test_offsets.bin", "train_offsets.bin", "x.bin", "y.bin"]
    want_x = np.concatenate([b.train_x for b in blocks] + [b.test_x for b in blocks])
    want_y = np.concatenate([b.train_y for b in blocks] + [b.test_y for b in blocks])
    for whole, want in ((nc.all_x, want_x), (nc.all_y, want_y)):
        assert isinstance(whole, np.memmap) and not whole.flags.writeable
        np.testing.assert_array_equal(whole, want)
    # Host placement takes the mapped file as the dataset: no copy in memory.
    from fedjax_pfl.data import formats
    data = formats.to_federated(nc, device=False)
    assert isinstance(data.x, np.memmap) and np.shares_memory(data.x, nc.all_x)
    np.testing.assert_array_equal(data.x, want_x)
    # Second load: opens the cache, reads no source and says nothing.
    nc2, msgs = load(reader, tmp_path / "cache")
    assert reader.calls == 1 and msgs == []
    assert_matches(nc2, blocks, reader)
    # The cache directory's name: dataset, format and a hash; other options make another one.
    assert cache_dir.name.startswith("fake-leaf-")
    other = FakeReader(str(tmp_path), blocks, options=(("seq_len", "20"),))
    assert cache.cache_key(other.source()) != cache_dir.name


def test_default_cache_root_is_beside_the_sources(tmp_path):
    reader = FakeReader(str(tmp_path), make_blocks(COUNTS))
    nc = cache.load(reader, None, log=None)
    assert os.path.isdir(tmp_path / ".fedjax_pfl_cache" / cache.cache_key(reader.source()))
    assert cache.default_cache_root(str(tmp_path)) == str(tmp_path / ".fedjax_pfl_cache")
    assert nc.num_clients == 5


def _cache_dir(tmp_path, reader):
    return tmp_path / "cache" / cache.cache_key(reader.source())


def _touch(path):
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


@pytest.mark.parametrize("change, expect", [
    ("touch", "b.json was modified"),
    ("grow", "b.json changed size"),
    ("version", "format version 0"),
    ("delete_bin", "y.bin is missing"),
    ("truncate_bin", "x.bin has 100 bytes, expected 156"),
    ("delete_offsets", "train_offsets.bin is missing"),
    ("delete_meta", "meta.json is missing"),
    ("add_file", "c.json was added"),
    ("remove_file", "b.json was removed"),
    ("task", "task changed"),
])
def test_stale_cache_is_rebuilt_with_one_message(tmp_path, change, expect):
    blocks = make_blocks(COUNTS)
    reader = FakeReader(str(tmp_path), blocks)
    load(reader, tmp_path / "cache")
    d = _cache_dir(tmp_path, reader)
    if change == "touch":
        _touch(reader.paths[1])
    elif change == "grow":
        st = os.stat(reader.paths[1])
        with open(reader.paths[1], "a") as f:
            f.write("y")
        os.utime(reader.paths[1], ns=(st.st_atime_ns, st.st_mtime_ns))   # same time, other size
    elif change == "version":
        meta = json.loads((d / "meta.json").read_text())
        meta["format_version"] = 0
        (d / "meta.json").write_text(json.dumps(meta))
    elif change == "delete_bin":
        os.remove(d / "y.bin")
    elif change == "truncate_bin":
        os.truncate(d / "x.bin", 100)
    elif change == "delete_offsets":
        os.remove(d / "train_offsets.bin")
    elif change == "delete_meta":
        os.remove(d / "meta.json")
    elif change == "add_file":
        reader = FakeReader(str(tmp_path), blocks, files=("a.json", "b.json", "c.json"))
    elif change == "remove_file":
        reader = FakeReader(str(tmp_path), blocks, files=("a.json",))
    elif change == "task":
        reader = FakeReader(str(tmp_path), blocks, task=Task(kind="classify", num_classes=6, inputs="image"))
    calls = reader.calls
    nc, msgs = load(reader, tmp_path / "cache")
    assert reader.calls == calls + 1                                # the source was read again
    assert len(msgs) == 2, msgs
    assert "rebuilding" in msgs[0] and expect in msgs[0], msgs[0]
    assert_matches(nc, blocks, reader)
    # ... and the rebuilt cache is current.
    _, msgs = load(reader, tmp_path / "cache")
    assert msgs == []


def test_open_refuses_a_truncated_cache(tmp_path):
    reader = FakeReader(str(tmp_path), make_blocks(COUNTS))
    load(reader, tmp_path / "cache")
    d = _cache_dir(tmp_path, reader)
    with open(d / "x.bin", "ab") as f:
        f.write(b"\0")
    with pytest.raises(cache.StaleCacheError, match="x.bin has 157 bytes, expected 156"):
        cache.open(str(d))


def _left_in(root):
    return sorted(p for p in os.listdir(root) if not p.endswith(".lock"))


@pytest.mark.parametrize("error", [DataFormatError("/data/b.json", "truncated JSON", "client_002"),
                                   RuntimeError("disk on fire")])
def test_no_partial_cache_after_a_failure(tmp_path, error):
    reader = FakeReader(str(tmp_path), make_blocks(COUNTS), fail_after=3, error=error)
    with pytest.raises(type(error), match=str(error).split(":")[-1].strip()):
        load(reader, tmp_path / "cache")
    assert _left_in(tmp_path / "cache") == []
    # A failed rebuild leaves the previous cache in place, still found stale next time.
    good = FakeReader(str(tmp_path), make_blocks(COUNTS))
    load(good, tmp_path / "cache")
    _touch(good.paths[0])
    reader.fail_after = 3
    with pytest.raises(type(error)):
        load(reader, tmp_path / "cache")
    assert _left_in(tmp_path / "cache") == [cache.cache_key(good.source())]
    _, msgs = load(good, tmp_path / "cache")
    assert "a.json was modified" in msgs[0]


def _bad(blocks, i, **changes):
    blocks = list(blocks)
    blocks[i] = blocks[i]._replace(**changes)
    return blocks


@pytest.mark.parametrize("mutate, expect", [
    (lambda b: _bad(b, 2, train_x=b[2].train_x[..., 0]), "client 'client_002': train_x is uint8[3, 2] per sample"),
    (lambda b: _bad(b, 3, test_x=b[3].test_x.astype(np.float32)), "client 'client_003': test_x is float32"),
    (lambda b: _bad(b, 4, train_y=b[4].train_y.astype(np.int64)), "client 'client_004': train_y is int64"),
    (lambda b: _bad(b, 1, train_y=b[1].train_y[:0]), "client 'client_001': train_x has 1 samples but train_y has 0"),
    (lambda b: _bad(b, 3, client_id="client_000"), "client 'client_000': client id appears twice"),
    (lambda b: _bad(b, 2, train_x=np.array([object()] * 7)), "client 'client_002': train_x has dtype object"),
])
def test_inconsistent_blocks_name_the_client(tmp_path, mutate, expect):
    reader = FakeReader(str(tmp_path), mutate(make_blocks(COUNTS)))
    with pytest.raises(DataFormatError) as e:
        load(reader, tmp_path / "cache")
    msg = str(e.value)
    assert expect in msg and "\n" not in msg and msg.startswith(str(tmp_path)), msg
    assert _left_in(tmp_path / "cache") == []


def test_empty_blocks_are_accepted(tmp_path):
    """A client without test data may yield arrays of any shape with 0 rows."""
    blocks = make_blocks([(3, 0), (2, 2)])
    blocks[0] = blocks[0]._replace(test_x=np.zeros((0,), np.float64), test_y=np.zeros((0,), np.int64))
    nc, _ = load(FakeReader(str(tmp_path), blocks), tmp_path / "cache")
    assert nc.test_offsets.tolist() == [0, 0, 2] and nc.test_x.dtype == np.uint8
    np.testing.assert_array_equal(nc.test_x, blocks[1].test_x)


def test_vocabulary_completed_while_reading_is_recorded(tmp_path):
    """A reader may know its vocabulary only after reading (LEAF's sent140): the cache keeps the
    SourceInfo as it is after the last block."""
    import dataclasses

    class LateVocab(FakeReader):
        def clients(self):
            yield from super().clients()
            self.info = dataclasses.replace(self.info, vocab=("<pad>", "w", "<oov>"))

    reader = LateVocab(str(tmp_path), make_blocks(COUNTS))
    assert reader.source().vocab == ()
    nc, _ = load(reader, tmp_path / "cache")
    assert nc.source.vocab == ("<pad>", "w", "<oov>")
    nc, msgs = load(reader, tmp_path / "cache")                   # and the cache is current
    assert msgs == [] and nc.source.vocab == ("<pad>", "w", "<oov>")


def test_big_endian_blocks_are_stored_little_endian(tmp_path):
    blocks = make_blocks([(3, 1), (2, 2)])
    blocks[1] = blocks[1]._replace(train_y=blocks[1].train_y.astype(">i4"))
    nc, _ = load(FakeReader(str(tmp_path), blocks), tmp_path / "cache")
    assert nc.train_y.dtype == np.dtype("<i4")
    np.testing.assert_array_equal(nc.train_y[3:], blocks[1].train_y.astype(np.int64))


def test_dead_builders_temporaries_are_removed(tmp_path):
    reader = FakeReader(str(tmp_path), make_blocks(COUNTS))
    root = tmp_path / "cache"
    os.makedirs(root)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    key = cache.cache_key(reader.source())
    stale = root / f".{key}.tmp-{dead.pid}-abc"
    live = root / f".{key}.tmp-{os.getpid()}-abc"
    os.makedirs(stale)
    os.makedirs(live)
    load(reader, root)
    assert not stale.exists() and live.exists()


# ---------------------------------------------------------------------------------------------
# select / subset


def brute_force_eligible(train_counts, min_samples):
    return [i for i, n in enumerate(train_counts) if n >= min_samples]


def test_select_min_samples_counts_training_samples_only(tmp_path):
    counts = [(0, 9), (5, 0), (3, 3), (9, 1), (4, 4), (1, 7), (6, 2)]
    nc, _ = load(FakeReader(str(tmp_path), make_blocks(counts)), tmp_path / "cache")
    train = [n for n, _ in counts]
    for s in range(0, 11):
        if not brute_force_eligible(train, s):
            with pytest.raises(ValueError, match="^min_samples"):
                cache.select(nc, max_clients=None, min_samples=s, seed=0)
            continue
        for k in (None, 100, len(brute_force_eligible(train, s))):
            assert cache.select(nc, max_clients=k, min_samples=s, seed=0).tolist() == brute_force_eligible(train, s)


def test_select_draws_k_uniformly_in_original_order(tmp_path):
    counts = [(n, 1) for n in (5, 1, 7, 8, 2, 9, 3, 6, 10, 4, 12, 11)]
    nc, _ = load(FakeReader(str(tmp_path), make_blocks(counts)), tmp_path / "cache")
    eligible = brute_force_eligible([n for n, _ in counts], 4)      # 9 clients
    k, seeds = 3, 3000
    hits = np.zeros(len(counts))
    for seed in range(seeds):
        idx = cache.select(nc, max_clients=k, min_samples=4, seed=seed)
        assert len(idx) == k and set(idx.tolist()) <= set(eligible)
        assert idx.tolist() == sorted(set(idx.tolist()))            # distinct, original order
        hits[idx] += 1
    np.testing.assert_array_equal(np.flatnonzero(hits), eligible)
    # Each eligible client is kept with probability k / 9; binomial sd ≈ 0.0086 at 3000 draws.
    np.testing.assert_allclose(hits[eligible] / seeds, k / len(eligible), atol=0.04)
    same = cache.select(nc, max_clients=k, min_samples=4, seed=7)
    assert same.tolist() == cache.select(nc, max_clients=k, min_samples=4, seed=7).tolist()


@pytest.mark.parametrize("kw, name", [(dict(max_clients=0), "max_clients"),
                                      (dict(max_clients=-3), "max_clients"),
                                      (dict(min_samples=-1), "min_samples"),
                                      (dict(min_samples=1000), "min_samples")])
def test_select_errors_name_the_argument(tmp_path, kw, name):
    """The argument, a data option of a run (`errors.arg(name, "data")`), which the command
    lines say as their flag (--max-clients, --min-samples)."""
    nc, _ = load(FakeReader(str(tmp_path), make_blocks(COUNTS)), tmp_path / "cache")
    with pytest.raises(ValueError, match=f"^{name}") as exc:
        cache.select(nc, **{"max_clients": None, "min_samples": 0, "seed": 0, **kw})
    assert exc.value.arguments[0] == (name, "data")


def test_subset_holds_the_selected_clients(tmp_path):
    blocks = make_blocks(COUNTS + [(3, 2), (8, 0)])
    reader = FakeReader(str(tmp_path), blocks)
    nc, _ = load(reader, tmp_path / "cache")
    idx = np.array([1, 2, 4, 6])
    sub = cache.subset(nc, idx)
    assert_matches(sub, [blocks[i] for i in idx], reader)
    assert sub.all_x is None and sub.all_y is None     # the whole file is not these clients'
    assert cache.subset(nc, np.arange(nc.num_clients)) is nc       # all clients: still the memory map
    with pytest.raises(ValueError):
        cache.subset(nc, np.array([0, 7]))


def test_a_cache_from_before_a_new_task_field_is_still_current(tmp_path):
    """A Task field added later at its default (label_offset) does not make older caches stale;
    another value of it does."""
    import dataclasses

    reader = FakeReader(str(tmp_path), make_blocks([(3, 1), (2, 2)]))
    load(reader, tmp_path / "cache")
    meta_path = _cache_dir(tmp_path, reader) / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["task"]["label_offset"]                  # as a cache written before the field
    meta_path.write_text(json.dumps(meta))
    _, msgs = load(reader, tmp_path / "cache")
    assert msgs == [] and reader.calls == 1           # opened, not converted again
    shifted = FakeReader(str(tmp_path), reader.blocks,
                         task=dataclasses.replace(TASK, kind="sequence", label_offset=1))
    cache.check(str(_cache_dir(tmp_path, reader)), reader.task(), reader.source())
    with pytest.raises(cache.StaleCacheError, match="the reader's task changed"):
        cache.check(str(_cache_dir(tmp_path, reader)), shifted.task(), shifted.source())
