"""Text conventions (data/text.py) against FedJAX's published values and hand-worked cases."""

import json

import numpy as np
import pytest

from fedjax_pfl.data import text
from fedjax_pfl.data.natural import DataFormatError

# The vocabulary string as printed in FedJAX's shakespeare.py and TFF's tutorial, typed again here
# so that a change to the module's copy is caught.
CHARS = "dhlptx@DHLPTX $(,048cgkoswCGKOSW[_#'/37;?bfjnrvzBFJNRVZ\"&*.26:\naeimquyAEIMQUY]!%)-159\r"
PAD, BOS, EOS, OOV = 0, 1, 2, 89          # FedJAX shakespeare.py: num_reserved=3, OOV = 3 + 86


def char_id(c: str) -> int:
    return CHARS.index(c) + 3 if c in CHARS else OOV


def reference_windows(snippets, L):
    """Brute force from the documented rule: s = [BOS c… EOS]*, row r = s[rL : rL+L+1]."""
    s = []
    for snip in snippets:
        s += [BOS] + [char_id(chr(b)) if b < 128 else OOV for b in snip.encode()] + [EOS]
    xs, ys = [], []
    for start in range(0, len(s) - 1, L):
        w = s[start:start + L + 1]
        x, y = w[:-1], w[1:]
        xs.append(x + [PAD] * (L - len(x)))
        ys.append(y + [PAD] * (L - len(y)))
    return np.array(xs, np.int32).reshape(-1, L), np.array(ys, np.int32).reshape(-1, L)


def test_shakespeare_special_ids_and_vocab():
    assert len(CHARS) == 86
    assert (text.PAD, text.SHAKESPEARE_BOS, text.SHAKESPEARE_EOS, text.SHAKESPEARE_OOV) == (0, 1, 2, 89)
    assert text.SHAKESPEARE_VOCAB_SIZE == 90
    vocab = text.shakespeare_vocab()
    assert vocab[:3] == ("<pad>", "<bos>", "<eos>") and vocab[89] == "<oov>"
    assert [vocab[char_id(c)] for c in CHARS] == list(CHARS)


def test_shakespeare_fedjax_golden():
    # fedjax/datasets/shakespeare_test.py: [b'hello', b'hi there'], sequence_length=10.
    x, y = text.shakespeare_sequences([b"hello", b"hi there"], 10)
    np.testing.assert_array_equal(x, [[1, 4, 67, 5, 5, 26, 2, 1, 4, 68],
                                      [16, 7, 4, 67, 48, 67, 0, 0, 0, 0]])
    np.testing.assert_array_equal(y, [[4, 67, 5, 5, 26, 2, 1, 4, 68, 16],
                                      [7, 4, 67, 48, 67, 2, 0, 0, 0, 0]])
    assert x.dtype == y.dtype == np.int32


def test_shakespeare_docstring_example():
    # FedJAX's docstring: [b'ABCD', b'E'], L = 3.
    A, B, C, D, E = (char_id(c) for c in "ABCDE")
    x, y = text.shakespeare_sequences([b"ABCD", b"E"], 3)
    np.testing.assert_array_equal(x, [[BOS, A, B], [C, D, EOS], [BOS, E, PAD]])
    np.testing.assert_array_equal(y, [[A, B, C], [D, EOS, BOS], [E, EOS, PAD]])


@pytest.mark.parametrize("L", [1, 5, 80])
def test_shakespeare_matches_brute_force(L):
    rng = np.random.default_rng(L)
    alphabet = CHARS + "~é"               # '~' and the two UTF-8 bytes of 'é' are out of vocabulary
    snippets = ["".join(rng.choice(list(alphabet), size=n)) for n in (0, 1, 7, 79, 80, 81, 200)]
    x, y = text.shakespeare_sequences(snippets, L)
    ex, ey = reference_windows(snippets, L)
    np.testing.assert_array_equal(x, ex)
    np.testing.assert_array_equal(y, ey)
    # Every character pair appears once: J − 1 targets for J joined tokens.
    joined = sum(len(s.encode()) + 2 for s in snippets)
    assert (y != PAD).sum() == joined - 1


def test_shakespeare_oov_is_per_byte_and_empty_client():
    x, y = text.shakespeare_sequences(["é"], 4)          # 2 bytes → 2 OOV tokens
    np.testing.assert_array_equal(x, [[BOS, OOV, OOV, PAD]])
    np.testing.assert_array_equal(y, [[OOV, OOV, EOS, PAD]])
    x, y = text.shakespeare_sequences([], 80)
    assert x.shape == y.shape == (0, 80)


def test_shakespeare_task():
    t = text.shakespeare_task()
    assert (t.kind, t.inputs, t.num_classes, t.vocab_size) == ("sequence", "tokens", 90, 90)
    assert t.metric_excluded == (EOS,) and t.default_model == "char_lstm"


# --- Stack Overflow ----------------------------------------------------------------------------

def write_word_counts(path, words):
    path.write_text("".join(f"{w} {1000 - i}\n" for i, w in enumerate(words)))


def test_read_word_counts_takes_the_first_v(tmp_path):
    p = tmp_path / "stackoverflow.word_count"
    write_word_counts(p, ["the", "i", "to", "a"])
    assert text.read_word_counts(str(p), 3) == ["the", "i", "to"]
    assert text.read_word_counts(str(p), 10) == ["the", "i", "to", "a"]
    p.write_text("the 10\nbroken\n")
    with pytest.raises(DataFormatError, match=r"stackoverflow.word_count: line 2"):
        text.read_word_counts(str(p), 10)


def test_read_tag_counts_sorts_by_count_ties_in_file_order(tmp_path):
    p = tmp_path / "stackoverflow.tag_count"
    # m, a and z tie: file order, neither alphabetical order.
    p.write_text(json.dumps({"m": 5, "java": 9, "a": 5, "python": 12, "z": 5, "go": 1}))
    assert text.read_tag_counts(str(p), 5) == ["python", "java", "m", "a", "z"]
    assert text.read_tag_counts(str(p), 2) == ["python", "java"]
    p.write_text("{not json")
    with pytest.raises(DataFormatError, match="stackoverflow.tag_count"):
        text.read_tag_counts(str(p))


def test_nwp_ids_windows_and_truncation():
    vocab = text.WordVocab(["the", "i", "to"])          # the → 3, i → 4, to → 5, OOV → 6
    assert (vocab.oov, vocab.size) == (6, 7)
    assert vocab.strings() == ("<pad>", "<bos>", "<eos>", "the", "i", "to", "<oov>")
    x, y = text.stackoverflow_nwp_sequences(
        [b"i to the", "i zebra", b"the the the the", b"", b"to  i"], vocab, 4)
    np.testing.assert_array_equal(x, [[1, 4, 5, 3],        # 3 words < 4: inputs BOS w1 w2 w3
                                      [1, 4, 6, 0],        # OOV word → 6, then padding
                                      [1, 3, 3, 3],        # 4 words = L: truncated, no EOS
                                      [1, 0, 0, 0],        # empty: [BOS] → [EOS]
                                      [1, 5, 4, 0]])       # any whitespace splits
    np.testing.assert_array_equal(y, [[4, 5, 3, 2],
                                      [4, 6, 2, 0],
                                      [3, 3, 3, 3],
                                      [2, 0, 0, 0],
                                      [5, 4, 2, 0]])


def test_nwp_task():
    t = text.stackoverflow_nwp_task(10_000)
    assert (t.kind, t.inputs, t.num_classes, t.vocab_size) == ("sequence", "tokens", 10_004, 10_004)
    assert t.metric_excluded == (2,) and t.default_model == "word_lstm"


def test_tp_bag_ids_tags_and_padding():
    vocab = text.WordVocab(["the", "i", "to", "how"])   # bag ids: the 1, i 2, to 3, how 4
    tags = ["python", "java", "c"]                       # tag ids 0, 1, 2
    x, y = text.stackoverflow_tp_examples(
        tokens=[b"how to zebra the", b"i i", b"", b"the the the the"],
        titles=[b"to python", "", b"how", b"i"],
        tags=[b"java|java|rust|python", b"", b"rust|go", b"c|java|python"],
        vocab=vocab, tag_vocab=tags, max_tokens=4, max_tags=2)
    np.testing.assert_array_equal(x, [[4, 3, 5, 1],      # tokens then title; OOV → V + 1 = 5
                                      [2, 2, 0, 0],
                                      [4, 0, 0, 0],
                                      [1, 1, 1, 1]])     # 5 words, truncated to L = 4
    np.testing.assert_array_equal(y, [[1, 0],            # java once, rust dropped, python
                                      [-1, -1],          # no tags: kept, all −1
                                      [-1, -1],          # all tags outside the vocabulary
                                      [2, 1]])           # truncated to K = 2
    t = text.stackoverflow_tp_task(4, 3)
    assert (t.kind, t.inputs, t.num_classes, t.vocab_size, t.topk) == ("multilabel", "tokens", 3, 5, 5)
    assert t.default_model == "tag_logreg"
