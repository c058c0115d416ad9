"""TensorFlow Federated's HDF5 files (``examples/<client id>/<feature>``), read lazily with h5py.

TFF ≤ 0.18's ``tff.simulation.datasets.<name>.load_data()`` downloaded these archives from
https://storage.googleapis.com/tff-datasets-public/ into Keras' cache (``~/.keras/datasets``) and
read them with ``HDF5ClientData``: a top-level group ``examples`` with one subgroup per client,
named by the client id, holding one dataset per feature, all of equal length (TFF ≥ 0.19 ships
SQLite instead). Files and features by dataset name:

=================== ================================================ ==========================
name                files (train, test)                              features
=================== ================================================ ==========================
emnist62            fed_emnist_train.h5, fed_emnist_test.h5          pixels f32 [28,28], label
emnist10            fed_emnist_digitsonly_{train,test}.h5            pixels, label
shakespeare         shakespeare_{train,test}.h5                      snippets (bytes)
stackoverflow_nwp   stackoverflow_train.h5, stackoverflow_test.h5    tokens (bytes)
stackoverflow_tp    the same (+ title, tags)                         tokens, title, tags
cifar100_fl         fed_cifar100_{train,test}.h5                     image u8 [32,32,3], label,
                                                                     coarse_label
=================== ================================================ ==========================

Stack Overflow also needs ``stackoverflow.word_count`` (and ``stackoverflow.tag_count`` for tags)
in the same directory (TFF's ``load_word_counts`` / ``load_tag_counts`` archives).

Clients. A client's train samples come from the train file and its held-out samples from the
test file under the same id (EMNIST, Shakespeare: every client is in both; Stack Overflow: the
test file holds the train clients' posts after 2018-01-01, so a client may have no test samples;
``eval_split="held_out"`` takes ``stackoverflow_held_out.h5`` instead, whose users are disjoint
from the train users). A client present in one file only gets zero-length arrays for the other.
CIFAR-100's 100 test clients are not its 500 train clients (TFF's docstring: both are numbered
from 0 and share no samples), so by default (``test_clients="separate"``) they are kept as
test-only clients named ``test/<id>`` ("/" cannot occur in an HDF5 group name, so no clash);
``test_clients="paired"`` joins them by id instead. Clients come in sorted id order.

Images (uint8 NHWC; the model sees x · input_scale + input_shift):

* EMNIST: TFF stores float32 pixels p ∈ [0, 1] with **1.0 = background** and 0.0 = ink (LEAF's
  grey levels / 255). We store u = 255 − round(255 p), so background is 0 and ink is high as in
  MNIST, and the model sees u / 255 = 1 − p, FedJAX's ``x = 1 - pixels``. The mapping is exact and
  invertible on the grid k/255 (|255 p − k| ≤ 1e-3, float32 rounding): p = (255 − u)/255. A pixel
  off the grid goes by the readers' one policy (`natural.Quantiser`): ``quantise="round"``
  (default) stores its nearest level and counts it (`SourceInfo.rounded`), ``quantise="refuse"``
  raises `DataFormatError`; a pixel outside [0, 1] is refused either way.
  input_scale = 1/255, input_shift = 0.
* CIFAR-100: uint8 as stored; the model sees x · 2/255 − 1 ∈ [−1, 1] (this package's image
  convention, `sources.py`). ``coarse=True`` predicts the 20 coarse labels.

Text: `fedjax_pfl.data.text` (FedJAX's ids; the docstrings there say where TFF's differ).

Laziness: `clients()` opens the files once and reads one client's group at a time, so memory
holds one client (Stack Overflow's train file holds 135,818,730 examples of 342,477 users, TFF's
docstring).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from fedjax_pfl.data import text
from fedjax_pfl.data.natural import ClientBlock, DataFormatError, Quantiser, SourceInfo, Task, check_quantise
from fedjax_pfl.data.sources import DatasetNotFoundError

__all__ = ["DATASETS", "TffReader", "DatasetSpec", "dataset_spec", "resolve_options",
           "pair_clients", "check_lengths", "open_tff", "detect", "tff_files"]

DATASETS: tuple[str, ...] = ("emnist62", "emnist10", "shakespeare", "stackoverflow_nwp",
                             "stackoverflow_tp", "cifar100_fl")

_TFF_URL = "https://storage.googleapis.com/tff-datasets-public/"
_WORD_COUNT = "stackoverflow.word_count"
_TAG_COUNT = "stackoverflow.tag_count"

# Options each dataset accepts, with their defaults (every one changes the arrays).
_OPTIONS: dict[str, dict[str, Any]] = {
    "emnist62": {},
    "emnist10": {},
    "shakespeare": {"sequence_length": text.SHAKESPEARE_SEQUENCE_LENGTH, "tokenizer": None},
    "stackoverflow_nwp": {"vocab_size": text.SO_VOCAB_SIZE,
                          "sequence_length": text.SO_SEQUENCE_LENGTH, "eval_split": "test",
                          "tokenizer": None},
    "stackoverflow_tp": {"vocab_size": text.SO_VOCAB_SIZE, "num_tags": text.SO_TAG_VOCAB_SIZE,
                         "max_tokens": text.SO_MAX_TOKENS, "max_tags": text.SO_MAX_TAGS,
                         "eval_split": "test"},
    "cifar100_fl": {"coarse": False, "test_clients": "separate"},
}
# Every dataset takes `quantise` (natural.QUANTISE); these store values through a Quantiser, so
# only their cache key carries it.
_QUANTISED = ("emnist62", "emnist10")

EMNIST_LABELS = tuple("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")


def _one_line(e: BaseException) -> str:
    return re.sub(r"\s+", " ", str(e)).strip()


def _check_name(name: str) -> None:
    if name not in DATASETS:
        raise ValueError(f"unknown natural dataset {name!r}; choose from {', '.join(DATASETS)}")


def resolve_options(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The dataset's options with defaults filled in; unknown names or bad values raise."""
    _check_name(name)
    allowed = _OPTIONS[name]
    unknown = sorted(set(options) - set(allowed) - {"quantise"})
    if unknown:
        raise ValueError(f"{name}: unknown option(s) {unknown}; valid: {sorted([*allowed, 'quantise'])}")
    opts = {**allowed, "quantise": "round", **options}
    check_quantise(opts["quantise"])
    for key in ("sequence_length", "vocab_size", "num_tags", "max_tokens", "max_tags"):
        if key in opts and (not isinstance(opts[key], int) or opts[key] < 1):
            raise ValueError(f"{name}: option {key} must be a positive int, got {opts[key]!r}")
    if opts.get("eval_split", "test") not in ("test", "held_out"):
        raise ValueError(f"{name}: eval_split must be 'test' or 'held_out', got {opts['eval_split']!r}")
    if opts.get("test_clients", "separate") not in ("separate", "paired"):
        raise ValueError(f"{name}: test_clients must be 'separate' or 'paired', "
                         f"got {opts['test_clients']!r}")
    return opts


# --- What a dataset is, whatever the file format ----------------------------------------------

Features = Mapping[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """One dataset's task and the conversion of one client's raw features to (x, y).

    `convert(features, path, client)` raises `DataFormatError` naming the file and the client.
    """

    name: str
    task: Task
    features: tuple[str, ...]            # raw features the conversion needs
    convert: Callable[[Features, str, str], tuple[np.ndarray, np.ndarray]]
    empty: tuple[np.ndarray, np.ndarray]  # zero-length (x, y) of the right trailing shapes
    input_scale: float = 1.0
    input_shift: float = 0.0
    vocab: tuple[str, ...] = ()
    labels: tuple[str, ...] = ()
    extra_files: tuple[str, ...] = ()     # count files read (absolute paths)
    options: tuple[tuple[str, str], ...] = ()
    # How `convert` stores values it cannot store exactly, and its count of the values it moved:
    # a reader resets it when its clients() starts and reports `quantiser.rounded`.
    quantiser: Quantiser = dataclasses.field(default_factory=Quantiser)


def _labels(raw: np.ndarray, num_classes: int, feature: str, path: str, client: str) -> np.ndarray:
    """[n] or [n, 1] integer labels in [0, num_classes) → [n] int32."""
    lab = np.asarray(raw)
    if lab.ndim == 2 and lab.shape[1] == 1:
        lab = lab[:, 0]
    if lab.ndim != 1 or lab.dtype.kind not in "iu":
        raise DataFormatError(path, f"{feature!r} must be [n] integers, got {lab.dtype} "
                                    f"{list(lab.shape)}", client)
    if lab.size and (lab.min() < 0 or lab.max() >= num_classes):
        raise DataFormatError(path, f"{feature!r} outside [0, {num_classes}): "
                                    f"min {lab.min()}, max {lab.max()}", client)
    return lab.astype(np.int32)


def _emnist_pixels(raw: np.ndarray, quantiser: Quantiser, path: str, client: str) -> np.ndarray:
    """float [n, 28, 28] grey levels p ∈ [0, 1] (1 = background) → uint8 [n, 28, 28, 1] 255 − k,
    k = round(255 p) by `quantiser`'s policy."""
    px = np.asarray(raw)
    if px.ndim != 3 or px.shape[1:] != (28, 28) or px.dtype.kind != "f":
        raise DataFormatError(path, f"'pixels' must be float [n, 28, 28], got {px.dtype} "
                                    f"{list(px.shape)}", client)
    # float32 is what TFF stores; wider floats are read in float32 too (their grid test has the
    # same 1e-3 margin).
    k = quantiser.levels_of(px.astype(np.float32, copy=False), "'pixels'", path, client)
    return np.subtract(np.uint8(255), k, out=k)[..., None]


def _strings(raw: np.ndarray, feature: str, path: str, client: str) -> Sequence[bytes | str]:
    arr = np.asarray(raw)
    if arr.ndim != 1 or not (arr.dtype.kind in "SU" or (arr.dtype.kind == "O" and all(
            isinstance(s, (bytes, str)) for s in arr))):
        raise DataFormatError(path, f"{feature!r} must be [n] strings, got {arr.dtype} "
                                    f"{list(arr.shape)}", client)
    return list(arr)


def _find(data_dir: str, filename: str) -> str:
    return os.path.abspath(os.path.join(data_dir, filename))


def dataset_spec(name: str, data_dir: str, options: Mapping[str, Any]) -> DatasetSpec:
    """The `DatasetSpec` of `name`; Stack Overflow reads its count files from `data_dir` (absent:
    `DatasetNotFoundError`, naming them and where they come from)."""
    opts = resolve_options(name, options)
    quantiser = Quantiser(opts.pop("quantise"))
    tokenizer = opts.pop("tokenizer", None)
    opt_items = tuple(sorted((k, str(v)) for k, v in opts.items()))
    if tokenizer is not None:      # a pretrained tokenizer's ids (data/tokenizer.py's contract)
        return _pretrained_spec(name, data_dir, opts, tokenizer, opt_items)
    if name in _QUANTISED:
        opt_items = tuple(sorted(opt_items + (("quantise", quantiser.quantise),)))

    if name in ("emnist62", "emnist10"):
        num_classes = 62 if name == "emnist62" else 10

        def convert(f: Features, path: str, client: str):
            return _emnist_pixels(f["pixels"], quantiser, path, client), _labels(
                f["label"], num_classes, "label", path, client)

        task = Task(kind="classify", num_classes=num_classes, inputs="image",
                    default_model="femnist_cnn")
        return DatasetSpec(name, task, ("pixels", "label"), convert,
                           (np.zeros((0, 28, 28, 1), np.uint8), np.zeros(0, np.int32)),
                           input_scale=1 / 255, input_shift=0.0,
                           labels=EMNIST_LABELS[:num_classes], options=opt_items,
                           quantiser=quantiser)

    if name == "cifar100_fl":
        feature, num_classes = ("coarse_label", 20) if opts["coarse"] else ("label", 100)

        def convert(f: Features, path: str, client: str):
            img = np.asarray(f["image"])
            if img.ndim != 4 or img.shape[1:] != (32, 32, 3) or img.dtype.kind not in "iu" or (
                    img.size and (img.min() < 0 or img.max() > 255)):
                raise DataFormatError(path, f"'image' must be [n, 32, 32, 3] integers in "
                                            f"[0, 255], got {img.dtype} {list(img.shape)}", client)
            return img.astype(np.uint8), _labels(f[feature], num_classes, feature, path, client)

        task = Task(kind="classify", num_classes=num_classes, inputs="image",
                    default_model="resnet18")  # TFF/FedJAX: ResNet-18 with GroupNorm
        return DatasetSpec(name, task, ("image", feature), convert,
                           (np.zeros((0, 32, 32, 3), np.uint8), np.zeros(0, np.int32)),
                           input_scale=2 / 255, input_shift=-1.0, options=opt_items)

    if name == "shakespeare":
        L = opts["sequence_length"]

        def convert(f: Features, path: str, client: str):
            return text.shakespeare_sequences(_strings(f["snippets"], "snippets", path, client), L)

        vocab = text.shakespeare_vocab()
        return DatasetSpec(name, text.shakespeare_task(), ("snippets",), convert,
                           (np.zeros((0, L), np.int32), np.zeros((0, L), np.int32)),
                           vocab=vocab, labels=vocab, options=opt_items)

    # Stack Overflow: the vocabularies come from TFF's count files.
    word_path = _find(data_dir, _WORD_COUNT)
    tag_path = _find(data_dir, _TAG_COUNT)
    needed = [word_path] + ([tag_path] if name == "stackoverflow_tp" else [])
    missing = [os.path.basename(p) for p in needed if not os.path.isfile(p)]
    if missing:
        raise DatasetNotFoundError(
            f"{name}: {', '.join(missing)} not found in {os.path.abspath(data_dir)}; TFF's "
            f"tff.simulation.datasets.stackoverflow.load_word_counts() / load_tag_counts() cache "
            f"them under ~/.keras/datasets, or download and extract "
            + " and ".join(f"{_TFF_URL}{m}.tar.bz2" for m in missing) + " into that directory")
    vocab = text.WordVocab(text.read_word_counts(word_path, opts["vocab_size"]))

    if name == "stackoverflow_nwp":
        L = opts["sequence_length"]

        def convert(f: Features, path: str, client: str):
            return text.stackoverflow_nwp_sequences(
                _strings(f["tokens"], "tokens", path, client), vocab, L)

        strings = vocab.strings()
        return DatasetSpec(name, text.stackoverflow_nwp_task(len(vocab.words)), ("tokens",),
                           convert, (np.zeros((0, L), np.int32), np.zeros((0, L), np.int32)),
                           vocab=strings, labels=strings, extra_files=(word_path,),
                           options=opt_items)

    tags = text.read_tag_counts(tag_path, opts["num_tags"])
    L, K = opts["max_tokens"], opts["max_tags"]

    def convert(f: Features, path: str, client: str):  # type: ignore[no-redef]
        return text.stackoverflow_tp_examples(
            _strings(f["tokens"], "tokens", path, client), _strings(f["title"], "title", path, client),
            _strings(f["tags"], "tags", path, client), vocab, tags, L, K)

    return DatasetSpec(name, text.stackoverflow_tp_task(len(vocab.words), len(tags)),
                       ("tokens", "title", "tags"), convert,
                       (np.zeros((0, L), np.int32), np.zeros((0, K), np.int32)),
                       vocab=("<pad>", *vocab.words, "<oov>"), labels=tuple(tags),
                       extra_files=(word_path, tag_path), options=opt_items)


def _pretrained_spec(name: str, data_dir: str, opts: Mapping[str, Any], tokenizer: str,
                     opt_items: tuple[tuple[str, str], ...]) -> DatasetSpec:
    """Shakespeare or Stack Overflow next word re-tokenised from their raw text with a pretrained
    tokenizer (`data/tokenizer.py`): Shakespeare's snippets as one stream per client cut into
    windows of ``sequence_length`` tokens (`tokenizer.stream_windows`, FedJAX's windowing),
    Stack Overflow's sentences one row each, cut at ``sequence_length`` tokens
    (`tokenizer.text_rows`; the word-count file and ``vocab_size`` are not used). Labels are
    shifted by one (`Task.label_offset`)."""
    from fedjax_pfl.data import tokenizer as tokenizer_lib

    tok = tokenizer_lib.load_tokenizer(tokenizer)
    L = opts["sequence_length"]
    feature = "snippets" if name == "shakespeare" else "tokens"
    to_rows = tokenizer_lib.stream_windows if name == "shakespeare" else tokenizer_lib.text_rows
    items = tuple(sorted([kv for kv in opt_items if kv[0] != "vocab_size"] + list(tok.options())))

    def convert(f: Features, path: str, client: str):
        return to_rows(_strings(f[feature], feature, path, client), tok, L)

    return DatasetSpec(name, tokenizer_lib.pretrained_task(tok, default_model="transformer"),
                       (feature,), convert, (np.zeros((0, L), np.int32), np.zeros((0, L), np.int32)),
                       options=items)


def pair_clients(train_ids: Sequence[str], test_ids: Sequence[str], separate: bool = False
                 ) -> list[tuple[str, str | None, str | None]]:
    """(client id, its key in the train file or None, its key in the test file or None), sorted by
    client id. Paired: one client per distinct id. Separate: test clients become ``test/<id>``."""
    if separate:
        rows = [(c, c, None) for c in train_ids] + [(f"test/{c}", None, c) for c in test_ids]
    else:
        train, test = set(train_ids), set(test_ids)
        rows = [(c, c if c in train else None, c if c in test else None) for c in train | test]
    return sorted(rows, key=lambda r: r[0])


def check_lengths(features: Features, path: str, client: str) -> None:
    """Every feature of one client has the same number of examples (TFF zips them)."""
    lengths = {k: (np.shape(v)[0] if np.ndim(v) else None) for k, v in features.items()}
    if len(set(lengths.values())) > 1 or None in lengths.values():
        raise DataFormatError(path, f"features differ in length: {lengths}", client)


# --- The HDF5 reader ---------------------------------------------------------------------------

def tff_files(name: str, eval_split: str = "test") -> tuple[str, str, str, str]:
    """(train file, test file, archive, loader call) of TFF's HDF5 release of `name`."""
    _check_name(name)
    prefix, archive, loader = {
        "emnist62": ("fed_emnist", "fed_emnist", "emnist.load_data(only_digits=False)"),
        "emnist10": ("fed_emnist_digitsonly", "fed_emnist_digitsonly",
                     "emnist.load_data(only_digits=True)"),
        "shakespeare": ("shakespeare", "shakespeare", "shakespeare.load_data()"),
        "stackoverflow_nwp": ("stackoverflow", "stackoverflow", "stackoverflow.load_data()"),
        "stackoverflow_tp": ("stackoverflow", "stackoverflow", "stackoverflow.load_data()"),
        "cifar100_fl": ("fed_cifar100", "fed_cifar100", "cifar100.load_data()"),
    }[name]
    return f"{prefix}_train.h5", f"{prefix}_{eval_split}.h5", f"{archive}.tar.bz2", loader


class TffReader:
    """`natural.NaturalReader` over one dataset's TFF HDF5 files (module docstring)."""

    def __init__(self, spec: DatasetSpec, train_path: str, test_path: str, separate_test: bool):
        self._spec, self._train, self._test = spec, train_path, test_path
        self._separate = separate_test
        for path in (train_path, test_path):        # fail early on an unreadable file
            with _open_h5(path) as f:
                _examples(f, path)

    def task(self) -> Task:
        return self._spec.task

    def source(self) -> SourceInfo:
        s = self._spec
        return SourceInfo(name=s.name, format="tff", files=(self._train, self._test, *s.extra_files),
                          input_scale=s.input_scale, input_shift=s.input_shift, vocab=s.vocab,
                          labels=s.labels, options=s.options, rounded=s.quantiser.rounded)

    def clients(self) -> Iterator[ClientBlock]:
        """Every client once, sorted by id; one client's groups are read per step."""
        self._spec.quantiser.reset()
        with _open_h5(self._train) as ftrain, _open_h5(self._test) as ftest:
            gtrain, gtest = _examples(ftrain, self._train), _examples(ftest, self._test)
            for client, ktrain, ktest in pair_clients(list(gtrain.keys()), list(gtest.keys()),
                                                      self._separate):
                train = self._read(gtrain, self._train, ktrain, client)
                test = self._read(gtest, self._test, ktest, client)
                yield ClientBlock(client, *train, *test)

    def _read(self, group, path: str, key: str | None, client: str):
        if key is None:
            return self._spec.empty
        try:
            sub = group[key]
            if not hasattr(sub, "keys"):
                raise DataFormatError(path, f"examples/{key} is not a group", client)
            missing = [f for f in self._spec.features if f not in sub]
            if missing:
                raise DataFormatError(path, f"feature(s) {missing} missing (has {sorted(sub.keys())})",
                                      client)
            features = {f: sub[f][()] for f in self._spec.features}
        except (OSError, KeyError, RuntimeError) as e:      # h5py: corrupt or truncated data
            raise DataFormatError(path, f"cannot read: {_one_line(e)}", client) from None
        check_lengths(features, path, client)
        return self._spec.convert(features, path, client)


def _open_h5(path: str):
    import h5py

    try:
        return h5py.File(path, "r")
    except OSError as e:
        raise DataFormatError(path, f"not a readable HDF5 file ({_one_line(e)})") from None


def _examples(f, path: str):
    try:
        group = f["examples"]
    except (KeyError, OSError) as e:
        raise DataFormatError(path, f"no top-level group 'examples' ({_one_line(e)})") from None
    if not hasattr(group, "keys"):
        raise DataFormatError(path, "'examples' is not a group")
    return group


def _paths(name: str, data_dir: str, eval_split: str) -> tuple[str, str, str, str]:
    train, test, archive, loader = tff_files(name, eval_split)
    return _find(data_dir, train), _find(data_dir, test), archive, loader


def detect(data_dir: str, name: str) -> bool:
    """Whether `data_dir` holds TFF's train HDF5 file of `name` (the format's signature)."""
    return os.path.isfile(_paths(name, data_dir, "test")[0])


def open_tff(name: str, data_dir: str, **options: Any) -> TffReader:
    """The reader of `name` in TFF's HDF5 files under `data_dir`.

    Options (defaults): shakespeare: sequence_length=80; stackoverflow_nwp: vocab_size=10000,
    sequence_length=20, eval_split="test" | "held_out"; both: tokenizer=None (a pretrained
    tokenizer.json or its folder: its ids instead of FedJAX's, `_pretrained_spec`); stackoverflow_tp: vocab_size=10000,
    num_tags=500, max_tokens=64, max_tags=5, eval_split; cifar100_fl: coarse=False,
    test_clients="separate" | "paired"; every dataset: quantise="round" | "refuse" (EMNIST
    pixels off the k/255 grid stored at their nearest level and counted, or refused:
    `natural.Quantiser`).

    Raises:
      DatasetNotFoundError: a file is absent (one line: the files and where they come from).
      DataFormatError: a file is not readable HDF5 or has no ``examples`` group.
      ValueError: unknown dataset or option.
    """
    opts = resolve_options(name, options)
    train, test, archive, loader = _paths(name, data_dir, opts.get("eval_split", "test"))
    missing = [os.path.basename(p) for p in (train, test) if not os.path.isfile(p)]
    if missing:
        raise DatasetNotFoundError(
            f"{name}: TFF HDF5 file(s) {', '.join(missing)} not found in "
            f"{os.path.abspath(data_dir)}; tff.simulation.datasets.{loader} of TFF <= 0.18 "
            f"caches them under ~/.keras/datasets, or download and extract {_TFF_URL}{archive} "
            f"into that directory")
    spec = dataset_spec(name, data_dir, opts)
    return TffReader(spec, train, test, separate_test=(name == "cifar100_fl"
                                                       and opts["test_clients"] == "separate"))
