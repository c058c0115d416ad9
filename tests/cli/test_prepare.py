"""experiments/prepare.py: format detection, the statistics it prints and writes, and its one-line
errors with exit status 2. The readers are a fake module written by the test (the real ones have
their own tests), put in place of the format's module."""

import json
import os
import subprocess
import sys
import textwrap

import prepare
import pytest

from fedjax_pfl.data.sources import DatasetNotFoundError

FAKE_MODULE = textwrap.dedent('''
    import json, os
    import numpy as np
    from fedjax_pfl.data.natural import ClientBlock, DataFormatError, SourceInfo, Task
    from fedjax_pfl.data.sources import DatasetNotFoundError

    class Reader:
        def __init__(self, name, data_dir):
            self.name, self.path = name, os.path.join(data_dir, "train", "all.json")
            if name == "absent":
                raise DatasetNotFoundError("absent: looked for train/*.json; see LEAF's preprocess.sh")
            self.counts = json.load(open(self.path))
        def task(self):
            return Task(kind="classify", num_classes=3, inputs="image")
        def source(self):
            return SourceInfo(name=self.name, format="leaf", files=(self.path,), labels=("x", "y", "z"))
        def clients(self):
            for i, (n, m) in enumerate(self.counts):
                if self.name == "broken" and i == 2:
                    raise DataFormatError(self.path, "user_data has no 'y'", f"u{i}")
                yield ClientBlock(f"u{i}", np.full((n, 2, 2, 1), i, np.uint8), np.arange(n, dtype=np.int32) % 3,
                                  np.full((m, 2, 2, 1), i, np.uint8), np.zeros(m, np.int32))

    def open_fake(name, data_dir, **options):
        return Reader(name, data_dir)
''')

COUNTS = [[5, 1], [1, 1], [3, 0], [4, 2]]


@pytest.fixture
def leaf_dir(tmp_path, monkeypatch):
    """A directory in LEAF's layout whose "leaf" reader is the fake module above."""
    mod_dir = tmp_path / "mods"
    mod_dir.mkdir()
    (mod_dir / "fake_reader_for_prepare.py").write_text(FAKE_MODULE)
    (mod_dir / "reader_needing_a_package.py").write_text("import no_such_package_xyz\n")
    monkeypatch.syspath_prepend(str(mod_dir))
    monkeypatch.setitem(prepare.READERS, "leaf", ("fake_reader_for_prepare", "open_fake"))
    data = tmp_path / "data"
    for split in ("train", "test"):
        (data / split).mkdir(parents=True)
    (data / "train" / "all.json").write_text(json.dumps(COUNTS))
    (data / "test" / "all.json").write_text("{}")
    return data


def test_detect_format(tmp_path):
    (tmp_path / "leaf" / "train").mkdir(parents=True)
    (tmp_path / "leaf" / "test").mkdir()
    (tmp_path / "leaf" / "train" / "a.json").write_text("{}")
    (tmp_path / "leaf" / "test" / "a.json").write_text("{}")
    assert prepare.detect_format(str(tmp_path / "leaf")) == "leaf"
    (tmp_path / "tff").mkdir()
    (tmp_path / "tff" / "shakespeare_test.h5").write_text("")
    assert prepare.detect_format(str(tmp_path / "tff")) == "tff"
    (tmp_path / "fj").mkdir()
    (tmp_path / "fj" / "shakespeare_train.sqlite").write_text("")
    assert prepare.detect_format(str(tmp_path / "fj")) == "fedjax"
    (tmp_path / "fj" / "emnist_train.h5").write_text("")
    with pytest.raises(prepare.UsageError, match="several formats.*choose one with fmt$") as exc:
        prepare.detect_format(str(tmp_path / "fj"))
    assert prepare.message(exc.value).endswith("choose one with --format")   # its flag
    (tmp_path / "half" / "train").mkdir(parents=True)                 # LEAF needs test/ too
    (tmp_path / "half" / "train" / "a.json").write_text("{}")
    with pytest.raises(DatasetNotFoundError, match=r"train/\*.json and test/\*.json.*_train.h5.*sqlite"):
        prepare.detect_format(str(tmp_path / "half"))


def test_detect_format_asks_the_readers_detect(leaf_dir, tmp_path, monkeypatch):
    """A reader module's `detect(data_dir, name)` decides for its format (LEAF's nested layouts)."""
    (tmp_path / "mods" / "reader_with_detect.py").write_text(
        "def detect(data_dir, name):\n    return name == 'special'\n")
    monkeypatch.setitem(prepare.READERS, "fedjax", ("reader_with_detect", "open_x"))
    (tmp_path / "bare").mkdir()
    assert prepare.detect_format(str(tmp_path / "bare"), "special") == "fedjax"
    with pytest.raises(DatasetNotFoundError):
        prepare.detect_format(str(tmp_path / "bare"), "other")


def test_prepare_prints_and_writes_statistics(leaf_dir, tmp_path, capsys):
    out = tmp_path / "plots"
    assert prepare.main(["--dataset", "toy", "--data-dir", str(leaf_dir), "--plots", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "converting" in printed and "4 clients" in printed and "train samples / client" in printed
    s = json.loads((out / "stats.json").read_text())
    assert s["clients"] == 4 and s["train_per_client"]["total"] == 13 and s["clients_without_test"] == 1
    # arange(n) % 3 for n = 5, 1, 3, 4: [2, 2, 1] + [1, 0, 0] + [1, 1, 1] + [2, 1, 1]
    assert s["train"]["label_counts"] == [6, 4, 3]
    for png in ("client_sizes.png", "labels.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.path.isdir(leaf_dir / ".fedjax_pfl_cache")
    # Second run: the cache is opened, nothing converted; a subset is taken and reported.
    assert prepare.main(["--dataset", "toy", "--data-dir", str(leaf_dir), "--max-clients", "2",
                         "--min-samples", "3", "--seed", "1"]) == 0
    printed = capsys.readouterr().out
    assert "converting" not in printed and "selected 2 of 4 clients" in printed
    assert "toy (leaf): 2 clients" in printed


def _fails(argv, capsys, *expect):
    assert prepare.main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("prepare.py: error: "), err
    assert "Traceback" not in captured.err + captured.out
    for e in expect:
        assert e in err, err
    return err


def test_errors_are_one_line_with_exit_status_2(leaf_dir, tmp_path, capsys):
    d = ["--data-dir", str(leaf_dir)]
    _fails(["--dataset", "toy", "--data-dir", str(tmp_path / "nope")], capsys, "nope", "is not a directory")
    (tmp_path / "empty").mkdir()
    _fails(["--dataset", "toy", "--data-dir", str(tmp_path / "empty")], capsys, "train/*.json", "*_train.h5")
    _fails(["--dataset", "absent", *d], capsys, "preprocess.sh")
    _fails(["--dataset", "broken", *d], capsys, "all.json, client 'u2': user_data has no 'y'")
    assert not [p for p in os.listdir(leaf_dir / ".fedjax_pfl_cache") if "broken" in p and not p.endswith(".lock")]
    _fails(["--dataset", "toy", *d, "--max-clients", "0"], capsys, "--max-clients")
    _fails(["--dataset", "toy", *d, "--min-samples", "-2"], capsys, "--min-samples")
    _fails(["--dataset", "toy", *d, "--min-samples", "99"], capsys, "--min-samples 99")
    _fails(["--dataset", "toy", *d, "--format", "csv"], capsys, "--format")
    _fails(["--dataset", "toy", *d, "--bogus"], capsys, "--bogus")
    _fails(["--dataset", "toy", *d, "--format", "tff"], capsys)       # no TFF files: the TFF reader says so
    prepare.READERS["leaf"] = ("no_such_reader_module_xyz", "open_x")
    _fails(["--dataset", "toy", *d], capsys, "leaf reader", "not available")
    prepare.READERS["leaf"] = ("reader_needing_a_package", "open_x")
    _fails(["--dataset", "toy", *d], capsys, "pip install no_such_package_xyz")


@pytest.mark.slow
def test_command_line_exit_status(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(prepare.__file__), "prepare.py"),
                           "--dataset", "femnist", "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    # No format detected: femnist's reader (LEAF) names the files it looked for and LEAF's script.
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("prepare.py: error: LEAF femnist:") and str(tmp_path) in line
    assert "preprocess.sh" in line


def _leaf_femnist_off_grid(root) -> int:
    """A LEAF FEMNIST in its real layout (data/{train,test}/*.json) whose pixels are k/255 but
    for three of them off the grid; returns that count."""
    grid = [[1.0] * 784, [k / 255 for k in range(256)] * 3 + [0.0] * 16]
    train = [list(grid[0]), list(grid[1])]
    train[0][0] = 0.998 * 200 / 255                   # 199.6 levels: rounded to 200
    train[1][1] = 1.4 / 255                           # rounded to 1
    test = [list(grid[0])]
    test[0][7] = 0.3                                  # 76.5 levels (off the grid)
    for split, x in (("train", train), ("test", test)):
        (root / "data" / split).mkdir(parents=True)
        (root / "data" / split / f"all_data_0_{split}.json").write_text(json.dumps(
            {"users": ["f0000_00"], "num_samples": [len(x)],
             "user_data": {"f0000_00": {"x": x, "y": [3] * len(x)}}}))
    return 3


def test_prepare_reports_rounded_pixels_in_the_summary_and_refuse_stops(tmp_path, capsys):
    root = tmp_path / "femnist"
    moved = _leaf_femnist_off_grid(root)
    out = tmp_path / "plots"
    assert prepare.main(["--dataset", "femnist", "--data-dir", str(root), "--plots", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"values rounded to the nearest level the cache stores (uint8): {moved}" in printed
    assert json.loads((out / "stats.json").read_text())["rounded_values"] == moved
    # The count is the cache's: a second run opens it and reports the same.
    assert prepare.main(["--dataset", "femnist", "--data-dir", str(root)]) == 0
    printed = capsys.readouterr().out
    assert "converting" not in printed and f"cache stores (uint8): {moved}" in printed
    err = _fails(["--dataset", "femnist", "--data-dir", str(root), "--quantise", "refuse"], capsys,
                 "client 'f0000_00': x has 2 value(s) off the k/255 grid", "(--quantise refuse;")
    assert "all_data_0_train.json" in err
    _fails(["--dataset", "femnist", "--data-dir", str(root), "--quantise", "floor"], capsys,
           "--quantise")
