"""Pretrained tokenizers (Hugging Face ``tokenizer.json``) and the token-task contract they feed.

A pretrained model's vocabulary uses every id from 0, so the natural-data convention "label 0 is
padding" (`data/natural.py`) needs a shift. The contract the JSON Lines reader (`data/jsonl.py`)
and the pretrained readers of Shakespeare and Stack Overflow (`data/tff.py`, `--tokenizer`) write,
and the pretrained models read (`Task.label_offset` = 1, `models/tasks.py`):

* x [T] int32: the example's token ids s₀ … s_{T−1}, padded at the end with the tokenizer's pad
  id (else its end-of-sequence id, else 0). Padding is never scored, so its id only has to be a
  valid embedding row.
* y [T] int32: y_t = s_{t+1} + 1 where the next token s_{t+1} is scored, else 0 (`PAD`): padding,
  and in an instruction example the prompt's tokens. A loss reads class y − 1 where y > 0.

So an example of J tokens s₀ … s_{J−1} gives n = min(J − 1, T) input/target pairs; TRUNCATION
keeps its first T + 1 tokens (T inputs, each with its next token as target) and drops the rest,
the end of a long text (what Hugging Face's ``truncation=True`` with right-side truncation keeps
too). An example with no scored target left (J = 1, or a prompt that fills the T + 1 tokens) is
left out by the readers: it would count nothing.

Tokenisation is the `tokenizers` library's own: ``Tokenizer.from_file(path).encode(text)`` with
the tokenizer's post-processor (``add_special_tokens=True``: Llama's tokenizers put BOS first,
GPT-2's add nothing), then the end-of-sequence token appended unless the post-processor already
ended the sequence with it. Special tokens come from ``tokenizer_config.json`` (or
``special_tokens_map.json``) beside ``tokenizer.json`` (fields ``eos_token``, ``pad_token``, a
string or ``{"content": …}``), else ``config.json``'s ``eos_token_id`` / ``pad_token_id``, as the
pretrained models read them (`models.hf.tokenizer.special_token_ids`), else from the first of
the usual names present in the vocabulary (`EOS_NAMES`, `PAD_NAMES`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Sequence

import numpy as np

from fedjax_pfl.data.natural import PAD, Task
from fedjax_pfl.data.sources import DatasetNotFoundError
from fedjax_pfl.errors import OptionError, arg
from fedjax_pfl.models.hf import tokenizer as hf_tokenizer
from fedjax_pfl.models.hf.config import PretrainedError
from fedjax_pfl.models.hf.task import LABEL_OFFSET

__all__ = ["TOKENIZER_FILE", "EOS_NAMES", "PAD_NAMES", "LABEL_OFFSET", "PretrainedTokenizer",
           "find_tokenizer_file", "load_tokenizer", "pack_example", "text_rows", "stream_windows",
           "pretrained_task"]

TOKENIZER_FILE = hf_tokenizer.TOKENIZER_FILE
# Used where no tokenizer_config.json names them, tried in this order.
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<|im_end|>", "<eos>", "[SEP]")
PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")


@dataclasses.dataclass(frozen=True)
class PretrainedTokenizer:
    """A loaded ``tokenizer.json`` and the ids the contract needs (module docstring)."""

    path: str                        # the tokenizer.json read (absolute)
    tokenizer: object                # tokenizers.Tokenizer
    vocab_size: int                  # get_vocab_size(with_added_tokens=True)
    eos_id: int | None               # end of sequence, appended to every example (None: none)
    pad_id: int                      # x padding: pad, else eos, else 0
    digest: str                      # sha256 of the file (a changed tokenizer changes the cache)

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """The ids of `text` (`special`: with the tokenizer's post-processor, e.g. Llama's BOS)."""
        return list(self.tokenizer.encode(text, add_special_tokens=special).ids)  # type: ignore[attr-defined]

    def with_eos(self, ids: list[int]) -> list[int]:
        """`ids` ending with the end-of-sequence id (appended unless already last)."""
        if self.eos_id is None or (ids and ids[-1] == self.eos_id):
            return ids
        return ids + [self.eos_id]

    def options(self) -> tuple[tuple[str, str], ...]:
        """What a cache key needs to know about this tokenizer."""
        return (("tokenizer_sha256", self.digest), ("eos_id", str(self.eos_id)),
                ("pad_id", str(self.pad_id)))


def find_tokenizer_file(path: str | os.PathLike, flag: str = "tokenizer") -> str:
    """`path` if it is a file, else `path`/tokenizer.json; DatasetNotFoundError naming the data
    option `flag` when neither exists."""
    p = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if os.path.isdir(p):
        p = os.path.join(p, TOKENIZER_FILE)
    if not os.path.isfile(p):
        raise DatasetNotFoundError(f"{arg(flag, 'data')} {path}: no tokenizer file {p} (give a "
                                   f"{TOKENIZER_FILE} or the folder holding one)")
    return p


def load_tokenizer(path: str | os.PathLike, flag: str = "tokenizer") -> PretrainedTokenizer:
    """The tokenizer at `path` (a tokenizer.json, or a folder holding one) with its eos and pad
    ids (module docstring). The file and the ids are read by the pretrained models' own reader
    (`models.hf.tokenizer`: tokenizer_config.json, special_tokens_map.json, config.json), with
    the usual names (`EOS_NAMES`, `PAD_NAMES`) where no file names a token. Errors (one line,
    naming the data option `flag`): no such file (DatasetNotFoundError), a file `tokenizers`
    cannot read, a named special token not in it, the package missing (OptionError)."""
    file = find_tokenizer_file(path, flag)
    try:
        import tokenizers  # noqa: F401 (only whether it is installed)
    except ImportError:
        raise OptionError(f"{arg(flag, 'data')} needs the tokenizers package: pip install "
                          "tokenizers") from None
    try:
        tok = hf_tokenizer.read_tokenizer_file(file)
    except ValueError as e:
        text = " ".join(str(e).split())
        raise OptionError(f"{arg(flag, 'data')} {file} is not a tokenizer.json the tokenizers "
                          f"library reads ({text})") from None
    folder = os.path.dirname(file)
    try:
        ids = hf_tokenizer.special_token_ids(folder, tok.token_to_id)
    except PretrainedError as e:
        # The same message, naming the data option rather than the model folder.
        raise OptionError(e.message.replace(arg("path", "model"), arg(flag, "data"))) from None
    vocab = tok.get_vocab(with_added_tokens=True)

    def named(names: Sequence[str]) -> int | None:
        return next((int(vocab[n]) for n in names if n in vocab), None)

    eos = ids["eos"] if ids["eos"] is not None else named(EOS_NAMES)
    pad = ids["pad"] if ids["pad"] is not None else named(PAD_NAMES)
    with open(file, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return PretrainedTokenizer(path=file, tokenizer=tok,
                               vocab_size=int(tok.get_vocab_size(with_added_tokens=True)),
                               eos_id=eos, pad_id=pad if pad is not None else (eos or 0),
                               digest=digest)


def pack_example(ids: Sequence[int], scored_from: int, max_length: int,
                 pad_id: int) -> tuple[np.ndarray, np.ndarray] | None:
    """One example's token ids s₀ … s_{J−1} as (x [T], y [T]) under the contract (module
    docstring), T = `max_length`: x_t = s_t for t < n, `pad_id` after; y_t = s_{t+1} + 1 when
    t + 1 ≥ `scored_from` (the first scored token: 0 or 1 for plain text, the prompt's length in
    an instruction example), else 0; n = min(J − 1, T). None when no target is scored."""
    T = int(max_length)
    s = np.asarray(ids[:T + 1], np.int64)
    n = max(s.shape[0] - 1, 0)
    x = np.full(T, pad_id, np.int32)
    y = np.zeros(T, np.int32)
    x[:n] = s[:n]
    target = s[1:n + 1] + LABEL_OFFSET
    positions = np.arange(1, n + 1)                   # index of each target token in s
    y[:n] = np.where(positions >= scored_from, target, PAD)
    if not np.any(y):
        return None
    return x, y


def _text(s: bytes | str) -> str:
    return s.decode("utf-8", "replace") if isinstance(s, bytes) else str(s)


def text_rows(texts: Sequence[bytes | str], tok: PretrainedTokenizer,
              max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """One row per text (Stack Overflow's sentences under ``tokenizer``): the ids of
    ``text + eos``, every target scored, cut and padded by `pack_example`; a text with nothing
    to predict (one token) is left out. Returns (x, y), both [n ≤ len(texts), T] int32."""
    rows = [pack_example(tok.with_eos(tok.encode(_text(t))), 0, max_length, tok.pad_id)
            for t in texts]
    kept = [r for r in rows if r is not None]
    if not kept:
        return np.zeros((0, max_length), np.int32), np.zeros((0, max_length), np.int32)
    return np.stack([r[0] for r in kept]), np.stack([r[1] for r in kept])


def stream_windows(texts: Sequence[bytes | str], tok: PretrainedTokenizer,
                   max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """A client's texts as one token stream cut into windows (Shakespeare's snippets under
    ``tokenizer``), as `text.shakespeare_sequences` cuts its character ids: s = the ids of each
    ``text + eos`` one after another (with the tokenizer's post-processor per text, e.g. a BOS
    each), J tokens; row r is x = s[rT : rT + T], y = s[rT + 1 : rT + T + 1] + 1, the last row
    padded (x with the pad id, y with 0). Nothing is cut: consecutive windows overlap by one
    token. Returns (x, y), both [⌈(J − 1)/T⌉, T] int32."""
    T = int(max_length)
    s: list[int] = []
    for t in texts:
        s += tok.with_eos(tok.encode(_text(t)))
    n = max(len(s) - 1, 0)
    rows = -(-n // T)
    x = np.full(rows * T, tok.pad_id, np.int32)
    y = np.zeros(rows * T, np.int32)
    arr = np.asarray(s, np.int64)
    x[:n], y[:n] = arr[:n], arr[1:n + 1] + LABEL_OFFSET
    return x.reshape(rows, T), y.reshape(rows, T)


def pretrained_task(tok: PretrainedTokenizer, default_model: str = "transformer") -> Task:
    """The next-token task of `tok`'s vocabulary: per-token, labels shifted by one
    (`Task.label_offset`), output width and input vocabulary the tokenizer's size."""
    return Task(kind="sequence", num_classes=tok.vocab_size, inputs="tokens",
                vocab_size=tok.vocab_size, default_model=default_model,
                label_offset=LABEL_OFFSET)
