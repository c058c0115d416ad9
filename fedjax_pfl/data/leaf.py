"""LEAF JSON reader: FEMNIST, Shakespeare, Sent140 and CelebA as natural clients.

LEAF (Caldas et al. 2018, github.com/TalwalkarLab/leaf) preprocesses each dataset with
``leaf/data/<name>/preprocess.sh``; its last step, ``data/utils/split_data.py``, writes

    leaf/data/<name>/data/train/*.json      several shard files
    leaf/data/<name>/data/test/*.json       one test shard per train shard with ``-t sample``

Each shard is one JSON object ``{"users": [id, ...], "num_samples": [n, ...],
"user_data": {id: {"x": [...], "y": [...]}}}``; files that went through LEAF's non-i.i.d.
sampling also carry ``"hierarchies"`` (Shakespeare's play per user), which we do not need and
ignore. ``-t sample`` (what LEAF's reference models require) splits each user's samples, so a
user appears in a train shard and a test shard; ``-t user`` puts each user in one split only.
LEAF's own loader (``models/utils/model_utils.py``, ``read_dir``) merges the shards of a split
and sorts the user ids; we do the same.

Where the files are (`find_leaf_root`): DIR itself holding ``train/`` and ``test/``, or
``DIR/data/`` (DIR = ``leaf/data/<name>``), or, when the dataset name is known,
``DIR/<name>/data/`` and ``DIR/data/<name>/data/`` (DIR = ``leaf/data`` or the LEAF checkout).

How each dataset becomes arrays (the conventions of `fedjax_pfl.data.natural`):

* ``femnist``: LEAF's ``data/femnist/preprocess/data_to_json.py`` opens each 128×128 NIST PNG,
  converts it to 8-bit grey ("L"), shrinks it to 28×28 (``thumbnail``) and writes the 784
  values divided by 255, so every stored value is k/255 for an integer k in [0, 255]. NIST
  forms are black ink on white paper: the BACKGROUND IS 1.0 and ink is near 0.0. We store
  ``x = rint(255·v)`` as uint8 [n, 28, 28, 1] (row-major, as LEAF's model reshapes the 784
  vector): exact and invertible for LEAF's files. We do not invert the grey levels, and give
  ``input_scale = 1/255, input_shift = 0``, so the model sees what LEAF's CNN sees
  (``models/femnist/cnn.py`` feeds the stored values unchanged): background 1.0, ink 0.0. A
  value that is not a multiple of 1/255 goes by the readers' one policy (`natural.Quantiser`):
  ``quantise="round"`` (default) stores its nearest level, error ≤ 1/510, and counts it in
  `SourceInfo.rounded`; ``quantise="refuse"`` raises `DataFormatError`; a value outside
  [0, 1] is refused either way. Labels 0..61 as LEAF's ``relabel_class`` numbers them: digits 0–9,
  upper-case A–Z 10–35, lower-case a–z 36–61. ``default_model = "femnist_cnn"``.
* ``shakespeare``: x is an 80-character window of one speaking role's lines, y the character
  that follows (``data/shakespeare/preprocess/shake_utils.py``); LEAF's ``split_data.py`` keeps
  the 79 windows between a role's train and test part out of both, and writes test
  ``num_samples`` 79 larger than the windows it keeps (LEAF's bookkeeping, accepted here).
  Characters map through LEAF's 80-letter alphabet ``ALL_LETTERS``
  (``models/utils/language_utils.py``, ``word_to_indices``/``letter_to_vec``) SHIFTED BY ONE:
  id = position in ``ALL_LETTERS`` + 1, so the letters are 1..80 and id 0 is both padding (the
  natural.py token convention; LEAF windows are never padded) and "not in the alphabet".
  ``ALL_LETTERS.find`` gives −1 for such a character, which LEAF then feeds to its embedding
  unchecked (and its one-hot labels put at the last letter, '}'); we map it to 0 instead. The
  labels use the same ids, so ``vocab_size = num_classes = 81``; the output width is LEAF's 80
  plus the unknown class 0. ``default_model = "char_lstm"``.
* ``sent140``: x is LEAF's record of one tweet, ``[id, date, query, user, text, ...]``
  (``data/sent140/preprocess/data_to_json.py`` keeps the CSV row after the polarity), the text
  being field 4 as LEAF's model reads it (``models/sent140/stacked_lstm.py``, ``process_x``);
  a bare string is taken as the text itself. y is 1 for positive (polarity "4"), 0 otherwise.
  Words are LEAF's ``split_line``: the regular expression ``[\\w']+|[.,!?;]`` (runs of word
  characters and apostrophes, and the punctuation marks . , ! ? ; as words of their own), case
  kept. LEAF looks words up in GloVe; we build our own vocabulary from the TRAINING split only:
  the ``max_vocab`` (default 10,000) most frequent words seen at least ``min_count`` (default 1)
  times (every word of every training tweet counts, not only the first ``seq_len``), ties
  broken by the word's string order, numbered 1..V by falling count. Id 0 is padding, id
  ``max_vocab + 1`` is out-of-vocabulary (every word not kept, test-only words included),
  ``vocab_size = max_vocab + 2`` whatever V turns out to be (ids V+1..max_vocab are unused
  when fewer words qualify; the Task is then known without reading the data). Each
  tweet becomes its first ``seq_len`` (default 25, LEAF's ``line_to_indices``) word ids, padded
  AT THE END with 0 (LEAF pads at the end too, with its unknown id), so a model reading the
  last position must mask padding. ``num_classes = 2``, ``default_model = "sent_lstm"``.
* ``celeba``: x are image file names under ``raw/img_align_celeba/`` next to ``train/`` and
  ``test/`` (``data/celeba/preprocess/metadata_to_json.py``), y whether the person smiles,
  written by LEAF as the float 0.0 or 1.0. Each image is read with Pillow as LEAF's
  ``models/celeba/cnn.py`` does (``resize((84, 84))`` with Pillow's default filter, bicubic
  since Pillow 7, then ``convert("RGB")``) into uint8 [n, 84, 84, 3]. LEAF feeds 0..255 to a
  CNN that batch-normalises after every convolution (so the input scale hardly matters there);
  our default ``cnn`` does not, so we give the project's image convention [−1, 1]
  (``input_scale = 2/255, input_shift = −1``). Without the image folder, opening ``celeba``
  fails with one line saying so; images are read client by client, not kept in memory.

Reading: shard files are read one at a time (``json.load``); each user's samples are
converted at once to compact arrays (uint8 pixels and characters, int32 word ids, celeba's
file names) and the JSON objects are dropped, so peak memory is about one shard's JSON plus the
dataset in its compact form. Clients are then yielded in sorted user-id order (string order),
each with its own train and test samples; a user present in only one split gets zero-length
arrays in the other.

Errors: missing files raise `DatasetNotFoundError` naming the paths looked for and LEAF's
command that writes them. A corrupt or truncated file, a missing key, ``num_samples`` that
disagrees with the data, a sample of the wrong size or a label out of range raise
`natural.DataFormatError`, one line naming the file and (where known) the client.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from fedjax_pfl.data.natural import ClientBlock, DataFormatError, Quantiser, SourceInfo, Task
from fedjax_pfl.data.sources import DatasetNotFoundError
from fedjax_pfl.errors import OptionError, arg

__all__ = [
    "LEAF_DATASETS", "ALL_LETTERS", "DEFAULT_MAX_VOCAB", "DEFAULT_MIN_COUNT", "DEFAULT_SEQ_LEN",
    "LeafReader", "open_leaf", "detect", "find_leaf_root", "split_line",
]

LEAF_DATASETS: tuple[str, ...] = ("femnist", "shakespeare", "sent140", "celeba")

# LEAF's character alphabet, models/utils/language_utils.py `ALL_LETTERS` (80 characters). It
# must be exactly LEAF's, character for character, or the ids mean something else.
ALL_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"

DEFAULT_MAX_VOCAB = 10_000
DEFAULT_MIN_COUNT = 1
DEFAULT_SEQ_LEN = 25            # LEAF's line_to_indices(max_words=25)

SHAKESPEARE_WINDOW = 80         # shake_utils.py __txt_to_data(seq_length=80)
FEMNIST_SIDE = 28
CELEBA_SIDE = 84                # models/celeba/cnn.py IMAGE_SIZE

# Bumped whenever a mapping below changes, so a cache built by an older reader is rebuilt.
_MAPPING_VERSION = "1"

# The command in leaf/data/<name>/ that writes train/ and test/ (each dataset's README).
_PREPROCESS = {
    "femnist": "./preprocess.sh -s niid --sf 1.0 -k 0 -t sample",
    "shakespeare": "./preprocess.sh -s niid --sf 1.0 -k 0 -t sample --tf 0.8",
    "sent140": "./preprocess.sh -s niid --sf 1.0 -k 0 -t sample",
    "celeba": "./preprocess.sh -s niid --sf 1.0 -k 5 -t sample",
}

_OPTIONS = {   # reader options per dataset, with defaults (each dataset also takes `quantise`)
    "femnist": {},
    "shakespeare": {},
    "sent140": {"max_vocab": DEFAULT_MAX_VOCAB, "min_count": DEFAULT_MIN_COUNT,
                "seq_len": DEFAULT_SEQ_LEN},
    "celeba": {},
}
# The datasets whose values go through a `Quantiser` (their cache key carries the policy).
_QUANTISED = ("femnist",)

# LEAF's split_line (language_utils.py): words of word characters and apostrophes, and five
# punctuation marks as words of their own.
_WORD_RE = re.compile(r"[\w']+|[.,!?;]")

# Character code -> shifted id (1..80), 0 for every code outside ALL_LETTERS (all are ASCII).
_CHAR_IDS = np.zeros(128, np.uint8)
for _i, _c in enumerate(ALL_LETTERS):
    _CHAR_IDS[ord(_c)] = _i + 1
del _i, _c

# FEMNIST label names by id, in relabel_class's order.
_FEMNIST_LABELS = tuple("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")


def split_line(text: str) -> list[str]:
    """The words of one tweet as LEAF's ``language_utils.split_line`` finds them."""
    return _WORD_RE.findall(text)


def _candidate_roots(data_dir: str | os.PathLike, name: str | None) -> list[Path]:
    d = Path(data_dir)
    roots = [d, d / "data"]
    if name is not None:
        roots += [d / name / "data", d / "data" / name / "data"]
    return roots


def _shards(root: Path, split: str) -> list[str]:
    return sorted(glob.glob(os.path.join(glob.escape(str(root / split)), "*.json")))


def find_leaf_root(data_dir: str | os.PathLike, name: str | None = None) -> Path | None:
    """The folder holding LEAF's ``train/*.json`` and ``test/*.json`` (module docstring), or
    None."""
    for root in _candidate_roots(data_dir, name):
        if _shards(root, "train") and _shards(root, "test"):
            return root
    return None


def detect(data_dir: str | os.PathLike, name: str | None = None) -> bool:
    """True when DIR (or DIR/data, or with `name` DIR/<name>/data, DIR/data/<name>/data) has
    LEAF's ``train/*.json`` and ``test/*.json``."""
    return find_leaf_root(data_dir, name) is not None


def _not_found(name: str, data_dir: str | os.PathLike) -> DatasetNotFoundError:
    looked = ", ".join(f"{r}/{{train,test}}/*.json" for r in _candidate_roots(data_dir, name))
    return DatasetNotFoundError(
        f"LEAF {name}: no train and test JSON shards found (looked for {looked}); LEAF writes "
        f"them with `{_PREPROCESS[name]}` run in leaf/data/{name} of "
        f"github.com/TalwalkarLab/leaf (then pass {arg('data_dir', 'data')} leaf/data/{name})")


# ---------------------------------------------------------------------------------------------
# Reading one shard.


def _load_shard(path: str) -> list[tuple[str, int, list, list]]:
    """The (user, num_samples, x, y) of one LEAF JSON file, checked for LEAF's layout."""
    try:
        with open(path, "rb") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise DataFormatError(path, f"not valid JSON, truncated or corrupt ({e.msg} at line "
                                    f"{e.lineno}, column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise DataFormatError(path, f"not UTF-8 JSON text ({e.reason} at byte {e.start})") from None
    if not isinstance(data, dict):
        raise DataFormatError(path, f"the top level is a JSON {type(data).__name__}, not LEAF's "
                                    "object with users, num_samples and user_data")
    missing = [k for k in ("users", "num_samples", "user_data") if k not in data]
    if missing:
        raise DataFormatError(path, f"missing key(s) {', '.join(missing)} (LEAF writes users, "
                                    "num_samples and user_data)")
    users, counts, user_data = data["users"], data["num_samples"], data["user_data"]
    if not isinstance(users, list) or not isinstance(counts, list) or len(users) != len(counts):
        raise DataFormatError(path, "users and num_samples must be lists of the same length")
    if not isinstance(user_data, dict):
        raise DataFormatError(path, "user_data must be an object keyed by user id")
    out, seen = [], set()
    for user, count in zip(users, counts):
        if not isinstance(user, str):
            raise DataFormatError(path, f"user id {user!r} is not a string")
        if user in seen:
            raise DataFormatError(path, "listed twice in users", user)
        seen.add(user)
        entry = user_data.get(user)
        if entry is None:
            raise DataFormatError(path, "listed in users but absent from user_data", user)
        if not isinstance(entry, dict) or "x" not in entry or "y" not in entry:
            raise DataFormatError(path, "user_data entry lacks x or y", user)
        x, y = entry["x"], entry["y"]
        if not isinstance(x, list) or not isinstance(y, list):
            raise DataFormatError(path, "x and y must be lists", user)
        if len(x) != len(y):
            raise DataFormatError(path, f"x has {len(x)} samples but y has {len(y)}", user)
        if not isinstance(count, int) or isinstance(count, bool):
            raise DataFormatError(path, f"num_samples entry {count!r} is not an integer", user)
        out.append((user, count, x, y))
    extra = sorted(set(user_data) - seen)
    if extra:
        raise DataFormatError(path, "in user_data but not listed in users", extra[0])
    return out


def _int_labels(y: list, num_classes: int, path: str, user: str) -> np.ndarray:
    """Labels as int32, refusing non-numbers, non-integers and values outside [0, num_classes)."""
    for v in y:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise DataFormatError(path, f"label {v!r} is not a number", user)
    arr = np.asarray(y, dtype=np.float64).reshape(-1)
    bad = ~np.isfinite(arr) | (arr != np.round(arr)) | (arr < 0) | (arr >= num_classes)
    if bad.any():
        raise DataFormatError(path, f"label {y[int(np.argmax(bad))]!r} is not an integer in "
                                    f"[0, {num_classes})", user)
    return arr.astype(np.int32)


class _Stored:
    """One user's samples in one split, compact, and the file they came from."""

    __slots__ = ("x", "y", "path")

    def __init__(self, x, y: np.ndarray, path: str):
        self.x, self.y, self.path = x, y, path


# ---------------------------------------------------------------------------------------------
# The reader.


class LeafReader:
    """One LEAF dataset in one directory, as a `natural.NaturalReader`.

    Construct through `open_leaf`. `task()` and `source()` read no data; `clients()` reads
    every shard once. For ``sent140``, `source().vocab` is the vocabulary once `clients()` has
    run to the end (it is built from the training shards), and empty before. `source().files`
    lists the JSON shards (celeba's images are not part of the staleness check); its
    `options` carry the reader's options and a mapping version, so a cache written under
    other options or an older mapping is stale.
    """

    def __init__(self, name: str, data_dir: str | os.PathLike, quantise: str = "round",
                 **options):
        if name not in LEAF_DATASETS:
            raise ValueError(f"LEAF dataset must be one of {LEAF_DATASETS}, got {name!r}")
        allowed = _OPTIONS[name]
        if "tokenizer" in options:
            raise OptionError(f"{arg('tokenizer', 'data')}: LEAF's {name} files hold fixed windows "
                              "and their ids, not a client's running text to re-tokenise; read "
                              f"TFF's or FedJAX's files ({arg('fmt', 'data')} tff or fedjax)")
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} for LEAF {name}; valid: "
                             f"{sorted([*allowed, 'quantise'])}")
        self.name = name
        self.quantiser = Quantiser(quantise)
        self.options = {**allowed, **options}
        for key, value in self.options.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LEAF {name} option {key} must be an integer >= 1, "
                                 f"got {value!r}")
        root = find_leaf_root(data_dir, name)
        if root is None:
            raise _not_found(name, data_dir)
        self.root = root.resolve()
        self.train_files = tuple(_shards(self.root, "train"))
        self.test_files = tuple(_shards(self.root, "test"))
        self.image_dir: Path | None = None
        if name == "celeba":
            self.image_dir = self.root / "raw" / "img_align_celeba"
            if not self.image_dir.is_dir():
                raise DatasetNotFoundError(
                    f"LEAF celeba: the JSON shards name images in {self.image_dir}, which does "
                    "not exist; put CelebA's img_align_celeba/ folder there (LEAF "
                    "data/celeba/README.md: mmlab.ie.cuhk.edu.hk/projects/CelebA.html)")
            try:
                import PIL.Image  # noqa: F401
            except ImportError as e:
                raise ImportError("LEAF celeba reads its images with Pillow: pip install "
                                  "pillow") from e
        self._vocab: tuple[str, ...] = ()

    # -- NaturalReader ------------------------------------------------------------------------

    def task(self) -> Task:
        if self.name == "femnist":
            return Task("classify", num_classes=62, inputs="image", default_model="femnist_cnn")
        if self.name == "shakespeare":
            n = len(ALL_LETTERS) + 1
            return Task("classify", num_classes=n, inputs="tokens", vocab_size=n,
                        default_model="char_lstm")
        if self.name == "sent140":
            return Task("classify", num_classes=2, inputs="tokens",
                        vocab_size=self.options["max_vocab"] + 2, default_model="sent_lstm")
        return Task("classify", num_classes=2, inputs="image", default_model="cnn")

    def source(self) -> SourceInfo:
        opts = (("leaf_mapping", _MAPPING_VERSION),) + tuple(
            (k, str(v)) for k, v in sorted(self.options.items()))
        if self.name in _QUANTISED:
            opts += (("quantise", self.quantiser.quantise),)
        files = self.train_files + self.test_files
        common = dict(name=self.name, format="leaf", files=files, options=opts,
                      rounded=self.quantiser.rounded)
        if self.name == "femnist":
            return SourceInfo(**common, input_scale=1.0 / 255.0, input_shift=0.0,
                              labels=_FEMNIST_LABELS)
        if self.name == "shakespeare":
            chars = ("<pad/unknown>",) + tuple(ALL_LETTERS)
            return SourceInfo(**common, vocab=chars, labels=chars)
        if self.name == "sent140":
            return SourceInfo(**common, vocab=self._vocab, labels=("negative", "positive"))
        return SourceInfo(**common, input_scale=2.0 / 255.0, input_shift=-1.0,
                          labels=("not smiling", "smiling"))

    def clients(self) -> Iterator[ClientBlock]:
        """Every user once, in sorted id order, with its LEAF train and test samples."""
        convert = {"femnist": self._femnist, "shakespeare": self._shakespeare,
                   "sent140": self._sent140, "celeba": self._celeba}[self.name]
        # sent140 state: words get provisional ids in order of first sight (train and test);
        # only training occurrences are counted.
        self._words: dict[str, int] = {}
        self._word_counts: list[int] = [0]
        self.quantiser.reset()
        splits = {}
        for split, files in (("train", self.train_files), ("test", self.test_files)):
            stored: dict[str, _Stored] = {}
            for path in files:
                for user, count, x, y in _load_shard(path):
                    if user in stored:
                        raise DataFormatError(
                            path, f"also in {stored[user].path} of the same split (outputs of "
                                  "two LEAF runs in one folder?)", user)
                    kept = len(y)
                    # split_data.py (by sample) leaves 79 windows between a Shakespeare role's
                    # train and test windows and counts them in the test num_samples.
                    gap = SHAKESPEARE_WINDOW - 1 if (self.name, split) == ("shakespeare",
                                                                           "test") else 0
                    if count != kept and count != kept + gap:
                        raise DataFormatError(path, f"num_samples says {count} but x has {kept} "
                                                    "samples", user)
                    sx, sy = convert(x, y, path, user, split)
                    stored[user] = _Stored(sx, sy, path)
            splits[split] = stored
        lookup = self._finish_vocab() if self.name == "sent140" else None
        for user in sorted(splits["train"].keys() | splits["test"].keys()):
            arrays = []
            for split in ("train", "test"):
                s = splits[split].get(user)
                arrays += [self._final_x(s, lookup, user), s.y if s is not None else
                           np.zeros((0,), np.int32)]
            yield ClientBlock(user, *arrays)

    # -- per-dataset conversion ---------------------------------------------------------------

    def _femnist(self, x: list, y: list, path: str, user: str, split: str):
        side2 = FEMNIST_SIDE * FEMNIST_SIDE
        for i, row in enumerate(x):
            if not isinstance(row, list) or len(row) != side2:
                size = len(row) if isinstance(row, list) else type(row).__name__
                raise DataFormatError(path, f"sample {i} has {size} pixel values, not {side2}",
                                      user)
        try:
            v = np.asarray(x, dtype=np.float64).reshape(len(x), side2)
        except (TypeError, ValueError):
            raise DataFormatError(path, "pixel values are not all numbers", user) from None
        # [sample, pixel] positions in the messages; LEAF's grey level / 255.
        pixels = self.quantiser.levels_of(v, "x", path, user).reshape(
            len(x), FEMNIST_SIDE, FEMNIST_SIDE, 1)
        return pixels, _int_labels(y, 62, path, user)

    def _shakespeare(self, x: list, y: list, path: str, user: str, split: str):
        for i, s in enumerate(x):
            if not isinstance(s, str) or len(s) != SHAKESPEARE_WINDOW:
                what = f"{len(s)} characters" if isinstance(s, str) else type(s).__name__
                raise DataFormatError(path, f"x[{i}] is {what}, not a string of "
                                            f"{SHAKESPEARE_WINDOW} characters", user)
        for i, c in enumerate(y):
            if not isinstance(c, str) or len(c) != 1:
                raise DataFormatError(path, f"y[{i}] is {c!r}, not one character", user)
        ids = _char_ids("".join(x)).reshape(len(x), SHAKESPEARE_WINDOW)
        return ids, _char_ids("".join(y)).astype(np.int32)

    def _sent140(self, x: list, y: list, path: str, user: str, split: str):
        seq_len = self.options["seq_len"]
        ids = np.zeros((len(x), seq_len), np.int32)      # provisional word ids, 0 = padding
        words, counts, train = self._words, self._word_counts, split == "train"
        for i, rec in enumerate(x):
            if isinstance(rec, str):
                text = rec
            elif isinstance(rec, list) and len(rec) > 4 and isinstance(rec[4], str):
                text = rec[4]
            else:
                raise DataFormatError(path, f"x[{i}] is not LEAF's tweet record [id, date, "
                                            "query, user, text, ...] with the text at field 4",
                                      user)
            for j, w in enumerate(split_line(text)):
                k = words.get(w)
                if k is None:
                    k = words[w] = len(counts)
                    counts.append(0)
                if train:
                    counts[k] += 1
                if j < seq_len:
                    ids[i, j] = k
        return ids, _int_labels(y, 2, path, user)

    def _celeba(self, x: list, y: list, path: str, user: str, split: str):
        for i, f in enumerate(x):
            if not isinstance(f, str) or not f or os.path.basename(f) != f:
                raise DataFormatError(path, f"x[{i}] is {f!r}, not an image file name", user)
        return list(x), _int_labels(y, 2, path, user)

    def _finish_vocab(self) -> np.ndarray:
        """Picks the vocabulary from the training counts; returns provisional id -> final id."""
        max_vocab, min_count = self.options["max_vocab"], self.options["min_count"]
        by_id = [""] * len(self._word_counts)
        for w, k in self._words.items():
            by_id[k] = w
        ranked = sorted((k for k in range(1, len(by_id)) if self._word_counts[k] >= min_count),
                        key=lambda k: (-self._word_counts[k], by_id[k]))[:max_vocab]
        oov = max_vocab + 1
        lookup = np.full(len(by_id), oov, np.int32)
        lookup[0] = 0
        lookup[np.asarray(ranked, np.int64)] = np.arange(1, len(ranked) + 1, dtype=np.int32)
        kept = tuple(by_id[k] for k in ranked)
        self._vocab = (("<pad>",) + kept + ("<unused>",) * (max_vocab - len(kept)) + ("<oov>",))
        del self._words, self._word_counts
        return lookup

    def _final_x(self, s: _Stored | None, lookup: np.ndarray | None, user: str) -> np.ndarray:
        """One user's x in the Task's conventions (zero samples where `s` is None)."""
        if s is None or len(s.y) == 0:
            shape, dtype = {"femnist": ((FEMNIST_SIDE, FEMNIST_SIDE, 1), np.uint8),
                            "shakespeare": ((SHAKESPEARE_WINDOW,), np.int32),
                            "sent140": ((self.options.get("seq_len", 0),), np.int32),
                            "celeba": ((CELEBA_SIDE, CELEBA_SIDE, 3), np.uint8)}[self.name]
            return np.zeros((0, *shape), dtype)
        if self.name == "femnist":
            return s.x
        if self.name == "shakespeare":
            return s.x.astype(np.int32)
        if self.name == "sent140":
            return lookup[s.x]
        return np.stack([self._celeba_image(f, s.path, user) for f in s.x])

    def _celeba_image(self, file_name: str, path: str, user: str) -> np.ndarray:
        from PIL import Image, UnidentifiedImageError

        image_path = self.image_dir / file_name
        try:
            with Image.open(image_path) as img:
                # models/celeba/cnn.py _load_image: resize first, then convert to RGB.
                arr = np.asarray(img.resize((CELEBA_SIDE, CELEBA_SIDE)).convert("RGB"), np.uint8)
        except FileNotFoundError:
            raise DataFormatError(path, f"image {file_name!r} is not in {self.image_dir}",
                                  user) from None
        except (UnidentifiedImageError, OSError) as e:
            raise DataFormatError(path, f"image {image_path} cannot be read "
                                        f"({type(e).__name__})", user) from None
        return arr


def _char_ids(text: str) -> np.ndarray:
    """Shifted ALL_LETTERS ids (1..80) of every character of `text`; 0 outside the alphabet."""
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    return np.where(codes < 128, _CHAR_IDS[np.minimum(codes, 127)], 0).astype(np.uint8)


def open_leaf(name: str, data_dir: str | os.PathLike, quantise: str = "round",
              **options) -> LeafReader:
    """Opens LEAF's preprocessed ``name`` under ``data_dir`` (module docstring for the layout).

    Args:
      name: one of `LEAF_DATASETS`: "femnist", "shakespeare", "sent140", "celeba".
      data_dir: ``leaf/data/<name>``, its ``data/`` folder, or (with the name nesting)
        ``leaf/data`` or the LEAF checkout.
      quantise: "round" (default) or "refuse": pixels off LEAF's k/255 grid (femnist) are
        stored at their nearest level and counted, or refused (`natural.Quantiser`).
      **options: sent140 only: ``max_vocab`` (default 10,000), ``min_count`` (default 1),
        ``seq_len`` (default 25). Any other option is refused.
    Returns:
      A `LeafReader` (a `natural.NaturalReader`).
    Raises:
      DatasetNotFoundError: no train/test shards (or, for celeba, no image folder).
      ValueError: an unknown dataset or option.
    """
    return LeafReader(name, data_dir, quantise=quantise, **options)
