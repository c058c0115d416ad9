"""Tests for the natural readers' pretrained tokenisation (`tokenizer=`, data/tokenizer.py):
TFF's Shakespeare and Stack Overflow next-word files re-tokenised from their raw text, LEAF's
refused. Fixtures are written here (TFF's HDF5 layout, a WordLevel tokenizer.json built with the
`tokenizers` library); expected rows are spelt out by hand from the vocabulary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedjax_pfl.data import leaf, tff
from fedjax_pfl.errors import OptionError

h5py = pytest.importorskip("h5py")
tokenizers = pytest.importorskip("tokenizers")

WORDS = "the </s> <pad> <unk> cat sat on mat dog how to".split()
V = {w: i for i, w in enumerate(WORDS)}
EOS, PADID = V["</s>"], V["<pad>"]


def make_tokenizer(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(V, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def write_h5(path: Path, feature: str, clients: dict[str, list[str]]) -> None:
    with h5py.File(path, "w") as f:
        g = f.create_group("examples")
        for cid, texts in clients.items():
            g.create_group(cid).create_dataset(feature, data=np.array(texts, dtype=object),
                                               dtype=h5py.string_dtype("utf-8"))


def test_tff_shakespeare_stream_windows(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    write_h5(tmp_path / "shakespeare_train.h5", "snippets", {"R": ["cat sat", "dog"],
                                                             "S": ["cat sat on"]})
    write_h5(tmp_path / "shakespeare_test.h5", "snippets", {"R": ["the"], "S": ["the"]})
    r = tff.open_tff("shakespeare", str(tmp_path), tokenizer=str(tok), sequence_length=3)
    assert r.task().label_offset == 1 and r.task().vocab_size == len(WORDS)
    b, s = list(r.clients())
    # S: [cat, sat, on, eos]: 3 pairs, exactly one window
    np.testing.assert_array_equal(s.train_y, [[V["sat"] + 1, V["on"] + 1, EOS + 1]])
    # stream [cat, sat, eos, dog, eos]: 4 pairs in windows of 3, overlapping by one token
    np.testing.assert_array_equal(b.train_x, [[V["cat"], V["sat"], EOS], [V["dog"], PADID, PADID]])
    np.testing.assert_array_equal(b.train_y, [[V["sat"] + 1, EOS + 1, V["dog"] + 1], [EOS + 1, 0, 0]])
    # test: [the, eos]: "the" is id 0, its target eos scored; nothing predicts "the" itself
    np.testing.assert_array_equal(b.test_x, [[V["the"], PADID, PADID]])
    np.testing.assert_array_equal(b.test_y, [[EOS + 1, 0, 0]])


def test_tff_stackoverflow_rows_per_sentence_without_word_counts(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    write_h5(tmp_path / "stackoverflow_train.h5", "tokens", {"u": ["how to cat", "the"]})
    write_h5(tmp_path / "stackoverflow_test.h5", "tokens", {"u": ["mat"]})
    r = tff.open_tff("stackoverflow_nwp", str(tmp_path), tokenizer=str(tok), sequence_length=2)
    (b,) = list(r.clients())
    # "how to cat" + eos cut at 2 + 1 tokens; "the" + eos: target eos (the first one is id 0)
    np.testing.assert_array_equal(b.train_x, [[V["how"], V["to"]], [V["the"], PADID]])
    np.testing.assert_array_equal(b.train_y, [[V["to"] + 1, V["cat"] + 1], [EOS + 1, 0]])
    np.testing.assert_array_equal(b.test_y, [[EOS + 1, 0]])


def test_leaf_refuses_a_tokenizer_naming_the_format():
    with pytest.raises(OptionError, match=r"^tokenizer: LEAF's shakespeare .* \(fmt tff or fedjax\)"):
        leaf.open_leaf("shakespeare", "/nonexistent", tokenizer="x")


def test_run_options_carry_the_tokenizer_to_the_reader():
    from fedjax_pfl.runner import RunConfig

    cfg = RunConfig.from_options(dataset="shakespeare", data_dir="/d", tokenizer="/t")
    assert cfg.data_options["tokenizer"] == "/t"
    assert "tokenizer" not in RunConfig.from_options(dataset="shakespeare", data_dir="/d").data_options
    with pytest.raises(OptionError, match=r"tokenizer applies to dataset jsonl / shakespeare / "
                                          r"stackoverflow_nwp only"):
        RunConfig.from_options(dataset="femnist", data_dir="/d", tokenizer="/t")
