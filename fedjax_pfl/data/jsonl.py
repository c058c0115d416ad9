"""JSON Lines text clients for fine-tuning: ``--dataset jsonl --data-dir FILE_OR_DIR``.

The files: one ``.jsonl`` file, or every ``*.jsonl`` directly in a folder (sorted by name), one
JSON object a line; blank lines are skipped. Each record names its client (``client_field``,
default ``"client"``; a string or an integer, used as its string) and carries either

* text mode (the default): the text field (``text_field``, default ``"text"``), the whole of
  which is scored: ``{"client": "alice", "text": "To be, or not to be"}``; or
* instruction mode (``instruction_field`` and ``response_field`` given): the prompt is
  ``prompt_template`` filled with the record (``{instruction}`` is the instruction field, any
  other ``{name}`` the record's field of that name), then the response; only the response's
  tokens (and the end of sequence after it) are scored, the prompt's targets are 0.
  `DEFAULT_PROMPT_TEMPLATE` is Alpaca's layout without its preamble::

      ### Instruction:
      {instruction}

      ### Response:

Tokens (`data/tokenizer.py`, the contract shared with the pretrained models): x are the token
ids of ``text + eos`` (or ``prompt``, then ``response + eos``, each tokenised on its own so the
prompt/response boundary is exact: the prompt with the tokenizer's post-processor, e.g. BOS,
the response without), truncated to their first ``max_length + 1`` tokens (default 128 inputs)
and padded with the tokenizer's pad id; y the next token's id + 1 where scored, else 0. An
example with nothing scored left (a prompt filling ``max_length``) is left out and counted in
`JsonlReader.dropped`.

Clients and splits: a client's examples keep their order in the files (files in name order).
Each client's LAST ⌈f·n⌉ examples (f = ``test_fraction``, default 0.25, as ``--test-fraction``)
are its held-out split and the rest its training split, in order, as LEAF splits a Shakespeare
role's lines by time (``split_data.py``, ``-t sample``): deterministic, so the cache stays
valid. A client keeps at least one training example (a client of one example has no test
split, as a LEAF user present in one split only); ``--min-samples`` leaves out clients with
few training examples as for every natural dataset. Clients come in sorted id order.

Errors, one line each (`natural.DataFormatError` names ``file:line``; `DatasetNotFoundError` and
`OptionError` name the data option): no such file or folder, a folder without ``*.jsonl``, a
line that is not JSON or not an object, a record lacking a field (named, with its option),
a field of the wrong type, a template naming a field the record lacks, no example at all.
"""

from __future__ import annotations

import glob
import json
import os
import string
from collections.abc import Iterator
from typing import Any

import numpy as np

from fedjax_pfl.data import tokenizer as tokenizer_lib
from fedjax_pfl.data.natural import ClientBlock, DataFormatError, SourceInfo, Task, check_quantise
from fedjax_pfl.data.partition import test_size
from fedjax_pfl.data.sources import DatasetNotFoundError
from fedjax_pfl.errors import OptionError, arg

__all__ = ["DATASETS", "DEFAULT_PROMPT_TEMPLATE", "DEFAULT_MAX_LENGTH", "DEFAULT_TEST_FRACTION", "OPTIONS",
           "JsonlReader", "jsonl_files", "open_jsonl"]

DATASETS: tuple[str, ...] = ("jsonl",)
DEFAULT_PROMPT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"
DEFAULT_MAX_LENGTH = 128
DEFAULT_TEST_FRACTION = 0.25            # run.py's --test-fraction default
# The reader's options and their defaults (every one changes the arrays: all are in the cache key).
OPTIONS: dict[str, Any] = {
    "tokenizer": None, "client_field": "client", "text_field": "text",
    "instruction_field": None, "response_field": None, "prompt_template": None,
    "max_length": DEFAULT_MAX_LENGTH, "test_fraction": DEFAULT_TEST_FRACTION,
}
# Bumped whenever the mapping from records to arrays changes, so older caches are rebuilt.
_MAPPING_VERSION = "1"


def _d(name: str) -> str:
    return arg(name, "data")


def jsonl_files(data_dir: str | os.PathLike) -> tuple[str, ...]:
    """`data_dir` itself (a file), or every ``*.jsonl`` directly in it (a folder), sorted;
    DatasetNotFoundError naming ``data_dir`` when there is none."""
    p = os.path.abspath(os.path.expanduser(os.fspath(data_dir)))
    if os.path.isfile(p):
        return (p,)
    if not os.path.isdir(p):
        raise DatasetNotFoundError(f"{_d('data_dir')} {data_dir}: no such JSON Lines file or "
                                   "folder")
    files = tuple(sorted(glob.glob(os.path.join(glob.escape(p), "*.jsonl"))))
    if not files:
        raise DatasetNotFoundError(f"{_d('data_dir')} {p} holds no *.jsonl file")
    return files


def _check_options(o: dict[str, Any]) -> None:
    """OptionError naming the data option at fault."""
    if not o["tokenizer"]:
        raise OptionError(f"{arg('dataset')} jsonl needs {_d('tokenizer')} PATH (a "
                          f"{tokenizer_lib.TOKENIZER_FILE} or the folder holding one)")
    for key in ("client_field", "text_field"):
        if not isinstance(o[key], str) or not o[key]:
            raise OptionError(f"{_d(key)} must be a field name, got {o[key]!r}")
    ins, res = o["instruction_field"], o["response_field"]
    if (ins is None) != (res is None):
        raise OptionError(f"{_d('instruction_field')} and {_d('response_field')} turn on "
                          f"instruction mode together: give both, got {_d('instruction_field')} "
                          f"{ins!r} and {_d('response_field')} {res!r}")
    if o["prompt_template"] is not None and ins is None:
        raise OptionError(f"{_d('prompt_template')} applies to instruction mode only (give "
                          f"{_d('instruction_field')} and {_d('response_field')})")
    m = o["max_length"]
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
        raise OptionError(f"{_d('max_length')} must be an integer >= 1, got {m!r}")
    f = o["test_fraction"]
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f < 1.0:
        raise OptionError(f"{_d('test_fraction')} must be in [0, 1), got {f!r}")
    if o["prompt_template"] is not None:
        try:
            fields = [name for _, name, _, _ in string.Formatter().parse(o["prompt_template"])
                      if name is not None]
        except ValueError as e:
            raise OptionError(f"{_d('prompt_template')} is not a str.format template ({e})") from None
        if any(not name or not name.isidentifier() for name in fields):
            raise OptionError(f"{_d('prompt_template')} may name record fields only, as "
                              f"{{instruction}} or {{input}}; got {o['prompt_template']!r}")


class JsonlReader:
    """JSON Lines text clients (module docstring), a `natural.NaturalReader`. Construct through
    `open_jsonl`. `task()` and `source()` read only the tokenizer; `clients()` reads every file
    once and tokenises client by client."""

    def __init__(self, data_dir: str | os.PathLike, quantise: str = "round", **options: Any):
        check_quantise(quantise)                      # (every reader takes it; no value here is)
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise OptionError(f"jsonl: unknown option(s) {unknown}; valid: {sorted(OPTIONS)}")
        o = {**OPTIONS, **{k: v for k, v in options.items() if v is not None}}
        _check_options(o)
        self.options = o
        self.instruction = o["instruction_field"] is not None
        self.template = (o["prompt_template"] if o["prompt_template"] is not None
                         else DEFAULT_PROMPT_TEMPLATE)
        self.files = jsonl_files(data_dir)
        self.tok = tokenizer_lib.load_tokenizer(o["tokenizer"])
        self.dropped = 0                              # examples with nothing scored (docstring)

    # -- NaturalReader ------------------------------------------------------------------------

    def task(self) -> Task:
        return tokenizer_lib.pretrained_task(self.tok)

    def source(self) -> SourceInfo:
        o = self.options
        opts = [("jsonl_mapping", _MAPPING_VERSION), ("client_field", o["client_field"]),
                ("max_length", str(int(o["max_length"]))),
                ("test_fraction", repr(float(o["test_fraction"])))]
        if self.instruction:
            opts += [("instruction_field", o["instruction_field"]),
                     ("response_field", o["response_field"]), ("prompt_template", self.template)]
        else:
            opts += [("text_field", o["text_field"])]
        return SourceInfo(name="jsonl", format="jsonl", files=self.files,
                          options=tuple(opts) + self.tok.options())

    def clients(self) -> Iterator[ClientBlock]:
        """Every client once, in sorted id order, its examples split (module docstring)."""
        self.dropped = 0
        records: dict[str, list[tuple[str, int, dict]]] = {}
        cf = self.options["client_field"]
        for path in self.files:
            for lineno, rec in _records(path):
                if cf not in rec:
                    raise DataFormatError(f"{path}:{lineno}", f"the record has no field {cf!r} "
                                                              f"({_d('client_field')})")
                cid = rec[cf]
                if isinstance(cid, bool) or not isinstance(cid, (str, int)):
                    raise DataFormatError(f"{path}:{lineno}", f"field {cf!r} "
                                          f"({_d('client_field')}) is {type(cid).__name__} "
                                          f"{cid!r}, not a string or an integer")
                records.setdefault(str(cid), []).append((path, lineno, rec))
        if not records:
            raise DatasetNotFoundError(f"{_d('data_dir')}: no record in "
                                       f"{', '.join(self.files)} (empty dataset)")
        T = int(self.options["max_length"])
        empty = (np.zeros((0, T), np.int32), np.zeros((0, T), np.int32))
        total = 0
        for cid in sorted(records):
            rows = [r for r in (self._example(*item, cid) for item in records[cid])
                    if r is not None]
            total += len(rows)
            n = len(rows)
            n_test = min(test_size(n, float(self.options["test_fraction"])), max(n - 1, 0))
            x = np.stack([r[0] for r in rows]) if rows else empty[0]
            y = np.stack([r[1] for r in rows]) if rows else empty[1]
            k = n - n_test
            yield ClientBlock(cid, x[:k], y[:k], x[k:], y[k:])
        if total == 0:
            raise DatasetNotFoundError(
                f"{_d('data_dir')}: none of the {self.dropped} examples in "
                f"{', '.join(self.files)} has a token left to score within {_d('max_length')} "
                f"{T} (empty dataset)")

    # -- one record ---------------------------------------------------------------------------

    def _field(self, rec: dict, option: str, path: str, lineno: int, cid: str) -> str:
        name = self.options[option]
        if name not in rec:
            raise DataFormatError(f"{path}:{lineno}", f"the record has no field {name!r} "
                                                      f"({_d(option)})", cid)
        value = rec[name]
        if not isinstance(value, str):
            raise DataFormatError(f"{path}:{lineno}", f"field {name!r} ({_d(option)}) is "
                                                      f"{type(value).__name__}, not a string", cid)
        return value

    def _example(self, path: str, lineno: int, rec: dict, cid: str
                 ) -> tuple[np.ndarray, np.ndarray] | None:
        tok, T = self.tok, int(self.options["max_length"])
        if not self.instruction:
            ids = tok.with_eos(tok.encode(self._field(rec, "text_field", path, lineno, cid)))
            scored_from = 0
        else:
            instruction = self._field(rec, "instruction_field", path, lineno, cid)
            response = self._field(rec, "response_field", path, lineno, cid)
            values = {k: v for k, v in rec.items() if isinstance(k, str)}
            values["instruction"] = instruction
            try:
                prompt = self.template.format_map(values)
            except KeyError as e:
                raise DataFormatError(f"{path}:{lineno}", f"{_d('prompt_template')} names "
                                                          f"{{{e.args[0]}}}, a field the record "
                                                          "lacks", cid) from None
            head = tok.encode(prompt)
            ids = head + tok.with_eos(tok.encode(response, special=False))
            scored_from = len(head)
        packed = tokenizer_lib.pack_example(ids, scored_from, T, tok.pad_id)
        if packed is None:
            self.dropped += 1
        return packed


def _records(path: str) -> Iterator[tuple[int, dict]]:
    """(line number, record) of every non-blank line of `path`."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise DatasetNotFoundError(f"{_d('data_dir')} {path}: cannot be read ({e.strerror})") from None
    with f:
        lineno = 0
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataFormatError(f"{path}:{lineno}", f"not JSON ({e.msg} at column "
                                                              f"{e.colno})") from None
                if not isinstance(rec, dict):
                    raise DataFormatError(f"{path}:{lineno}", f"a JSON {type(rec).__name__}, "
                                                              "not an object (one record a line)")
                yield lineno, rec
        except UnicodeDecodeError as e:
            raise DataFormatError(f"{path}:{lineno + 1}", f"not UTF-8 text ({e.reason})") from None


def open_jsonl(name: str, data_dir: str | os.PathLike, **options: Any) -> JsonlReader:
    """Opens JSON Lines text clients (module docstring) at `data_dir` (a file or a folder).

    Args:
      name: "jsonl" (the `formats.READERS` signature).
      data_dir: a ``.jsonl`` file or a folder of them.
      **options: `OPTIONS`: ``tokenizer`` (required: a tokenizer.json or its folder),
        ``client_field``, ``text_field``, ``instruction_field`` and ``response_field``
        (together: instruction mode), ``prompt_template``, ``max_length``, ``test_fraction``.
    Raises:
      DatasetNotFoundError: no such file or folder, no ``*.jsonl``, no tokenizer file.
      OptionError: a bad option (named).
    """
    if name not in DATASETS:
        raise ValueError(f"the JSON Lines reader reads dataset 'jsonl', not {name!r}")
    return JsonlReader(data_dir, **options)
