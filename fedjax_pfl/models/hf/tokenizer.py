"""A thin wrapper over the `tokenizers` library's `Tokenizer` of a Hugging Face folder.

The vocabulary and rules come from `tokenizer.json` as it is (HF's fast tokenizer format: the
model, normaliser, pre-tokeniser, post-processor and added tokens); `encode` adds what its
post-processor adds (Llama's BOS, for instance), as `transformers`' fast tokenizers do. The
special tokens' ids come from `tokenizer_config.json` (`bos_token`, `eos_token`, `pad_token`:
a string or an `{"content": ...}` object), else `special_tokens_map.json`, else config.json's
`bos_token_id` / `eos_token_id` / `pad_token_id` (the first of a list); None where none says.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Sequence

from fedjax_pfl.models.hf.config import PretrainedError, PretrainedNotFoundError, where

__all__ = ["Tokenizer", "TOKENIZER_FILE", "read_tokenizer_file", "special_token_ids"]

TOKENIZER_FILE = "tokenizer.json"


def _json(path: str, file: str) -> dict:
    full = os.path.join(path, file)
    if not os.path.isfile(full):
        return {}
    try:
        with open(full, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise PretrainedError(f"{where(path, file)} is not readable JSON ({type(e).__name__})") from None
    return data if isinstance(data, dict) else {}


def _content(token) -> str | None:
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def read_tokenizer_file(file: str) -> Any:
    """The `tokenizers` library's Tokenizer of `file`; ValueError (its first line) when the library
    cannot read it. Callers name the file in their own terms (the model folder, a data flag)."""
    from tokenizers import Tokenizer as _Tokenizer

    try:
        return _Tokenizer.from_file(file)
    except Exception as e:            # tokenizers raises a bare Exception on a bad file
        raise ValueError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None


def special_token_ids(path: str, token_to_id: Callable[[str], int | None]) -> dict[str, int | None]:
    """{"bos", "eos", "pad"} → the id the folder `path` names for each (module docstring: its
    tokenizer_config.json, else special_tokens_map.json, else config.json's `<kind>_token_id`),
    or None where none says. A named token missing from the vocabulary (`token_to_id` gives
    None) is a PretrainedError naming the file."""
    tok_config = _json(path, "tokenizer_config.json")
    special_map = _json(path, "special_tokens_map.json")
    config = _json(path, "config.json")
    return {kind: _special(path, kind, token_to_id, tok_config, special_map, config)
            for kind in ("bos", "eos", "pad")}


def _special(path: str, kind: str, token_to_id: Callable[[str], int | None], tok_config: dict,
             special_map: dict, config: dict) -> int | None:
    for source, file in ((tok_config, "tokenizer_config.json"),
                         (special_map, "special_tokens_map.json")):
        token = _content(source.get(f"{kind}_token"))
        if token is not None:
            found = token_to_id(token)
            if found is None:
                raise PretrainedError(f"{where(path, file)}: {kind}_token {token!r} is not "
                                      f"in {TOKENIZER_FILE}")
            return int(found)
    value = config.get(f"{kind}_token_id")
    if isinstance(value, list):
        value = value[0] if value else None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


class Tokenizer:
    """Text ↔ token ids of a pretrained folder.

    Attributes:
      bos_id, eos_id, pad_id: special token ids (int), or None where the folder names none.
      vocab_size: the tokenizer's vocabulary, added tokens included (≤ the model's vocab_size,
        which may be padded).
    """

    def __init__(self, path: str):
        self.path = path
        file = os.path.join(path, TOKENIZER_FILE)
        if not os.path.isfile(file):
            if not os.path.isdir(path):
                raise PretrainedNotFoundError(f"{where(path)}: no such folder")
            raise PretrainedNotFoundError(f"{where(path, TOKENIZER_FILE)} is missing")
        try:
            self._tok = read_tokenizer_file(file)
        except ValueError as e:
            raise PretrainedError(f"{where(path, TOKENIZER_FILE)} is not a readable tokenizer "
                                  f"({e})") from None
        ids = special_token_ids(path, self._tok.token_to_id)
        self.bos_id, self.eos_id, self.pad_id = ids["bos"], ids["eos"], ids["pad"]

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of `text`."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """The token ids of each text (the library's parallel batch encoder)."""
        return [list(e.ids) for e in self._tok.encode_batch(list(texts),
                                                            add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of token ids."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def __repr__(self) -> str:
        return (f"Tokenizer({self.path!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_id={self.eos_id}, pad_id={self.pad_id})")
