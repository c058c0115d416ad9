"""Text conventions shared by the TensorFlow Federated and FedJAX readers: vocabularies, special
token ids and the turning of raw strings into fixed-length id arrays.

Every function here takes one client's raw examples (bytes or str) and returns host NumPy arrays
in `natural`'s conventions (token ids int32, 0 = padding). The id conventions are FedJAX's,
because its datasets ship the preprocessing as code we can state exactly; where TensorFlow
Federated (TFF) numbers the specials differently, the docstring says so.

Shakespeare (next character), FedJAX ``fedjax/datasets/shakespeare.py``:

* ids: PAD = 0, BOS = 1, EOS = 2, the 86 characters of `SHAKESPEARE_CHARS` → 3 … 88 (character i
  of the string → i + 3), every other byte → OOV = 89; vocabulary 90 with the specials.
  (TFF's ``simulation/baselines/shakespeare/char_prediction_preprocessing.py`` uses the same
  86-character string with PAD = 0, characters 1 … 86, OOV = 87, BOS = 88, EOS = 89.)
* text is read byte by byte (as both FedJAX's ``TABLE[list(snippet)]`` and TFF's
  ``tf.strings.bytes_split`` do): a multi-byte UTF-8 character is several OOV tokens.

Stack Overflow next word, FedJAX ``fedjax/datasets/stackoverflow.py`` (``DefaultWordTokenizer``):

* ids: PAD = 0, BOS = 1, EOS = 2, the k-th most frequent word of ``stackoverflow.word_count``
  (k = 0 … V−1, V = 10,000) → k + 3, every other word → OOV = V + 3; vocabulary V + 4.
  (TFF's ``word_prediction_preprocessing.py``: PAD = 0, words 1 … V, OOV = V + 1, BOS = V + 2,
  EOS = V + 3. The windows below are the same in both.)

Stack Overflow tags: TFF ``simulation/baselines/stackoverflow/tag_prediction_preprocessing.py``
(FedJAX has no tag task); see `stackoverflow_tp_examples`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from fedjax_pfl.data.natural import PAD, DataFormatError, Task

__all__ = [
    "PAD", "SHAKESPEARE_CHARS", "SHAKESPEARE_BOS", "SHAKESPEARE_EOS", "SHAKESPEARE_OOV",
    "SHAKESPEARE_VOCAB_SIZE", "SHAKESPEARE_SEQUENCE_LENGTH", "shakespeare_vocab",
    "shakespeare_sequences", "shakespeare_task",
    "SO_BOS", "SO_EOS", "SO_VOCAB_SIZE", "SO_SEQUENCE_LENGTH", "SO_TAG_VOCAB_SIZE", "SO_MAX_TOKENS",
    "SO_MAX_TAGS", "WordVocab", "read_word_counts", "read_tag_counts",
    "stackoverflow_nwp_sequences", "stackoverflow_tp_examples", "stackoverflow_nwp_task",
    "stackoverflow_tp_task",
]

# --- Shakespeare -------------------------------------------------------------------------------

# The 86 characters of TFF's "Federated Learning for Text Generation" tutorial, in its order;
# FedJAX (shakespeare.py, `_build_look_up_table(..., num_reserved=3)`) and TFF's baselines reuse it.
SHAKESPEARE_CHARS = ("dhlptx@DHLPTX $(,048cgkoswCGKOSW[_#'/37;?bfjnrvzBFJNRVZ\"&*.26:\n"
                     "aeimquyAEIMQUY]!%)-159\r")
SHAKESPEARE_BOS = 1
SHAKESPEARE_EOS = 2
_SHAKESPEARE_RESERVED = 3                                           # PAD, BOS, EOS
SHAKESPEARE_OOV = _SHAKESPEARE_RESERVED + len(SHAKESPEARE_CHARS)    # 89
SHAKESPEARE_VOCAB_SIZE = SHAKESPEARE_OOV + 1                        # 90
SHAKESPEARE_SEQUENCE_LENGTH = 80   # McMahan et al. (AISTATS 2017); FedJAX's and TFF's default


def _shakespeare_table() -> np.ndarray:
    """[256] int32: byte value → token id (FedJAX's `TABLE`)."""
    table = np.full(256, SHAKESPEARE_OOV, np.int32)
    for i, ch in enumerate(SHAKESPEARE_CHARS.encode("ascii")):
        table[ch] = _SHAKESPEARE_RESERVED + i
    return table


_SHAKESPEARE_TABLE = _shakespeare_table()


def shakespeare_vocab() -> tuple[str, ...]:
    """Token strings by id: ("<pad>", "<bos>", "<eos>", 'd', 'h', …, '\\r', "<oov>")."""
    return ("<pad>", "<bos>", "<eos>", *SHAKESPEARE_CHARS, "<oov>")


def _as_bytes(s: bytes | str) -> bytes:
    return s.encode("utf-8") if isinstance(s, str) else bytes(s)


def shakespeare_sequences(snippets: Sequence[bytes | str],
                          sequence_length: int = SHAKESPEARE_SEQUENCE_LENGTH
                          ) -> tuple[np.ndarray, np.ndarray]:
    """One client's snippets → next-character inputs and targets, as FedJAX's `preprocess_client`.

    The snippets are joined into one id sequence s = [BOS, c₁…, EOS, BOS, c'₁…, EOS, …] of length
    J; inputs are s[0 : J−1] and targets s[1 : J], both cut into rows of `sequence_length` and the
    last row padded with PAD. Row r is thus the length-(L+1) window s[rL : rL+L+1] split into
    input (first L) and target (last L): consecutive windows overlap by one token, so no token is
    lost (TFF's tutorial windows do not overlap and lose one token in L+1). With L = 3,
    [b"ABCD", b"E"] gives inputs [[BOS,A,B],[C,D,EOS],[BOS,E,PAD]] and targets
    [[A,B,C],[D,EOS,BOS],[E,EOS,PAD]] (FedJAX's docstring).

    Returns:
      (x, y), both [ceil((J−1)/L), L] int32; [0, L] for a client without snippets.
    """
    if sequence_length < 1:
        raise ValueError(f"sequence_length must be >= 1, got {sequence_length}")
    pieces = []
    for snippet in snippets:
        ids = _SHAKESPEARE_TABLE[np.frombuffer(_as_bytes(snippet), np.uint8)]
        pieces += [np.array([SHAKESPEARE_BOS], np.int32), ids,
                   np.array([SHAKESPEARE_EOS], np.int32)]
    joined = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
    n = max(joined.shape[0] - 1, 0)                        # input/target pairs
    rows = -(-n // sequence_length)
    x = np.full(rows * sequence_length, PAD, np.int32)
    y = np.full(rows * sequence_length, PAD, np.int32)
    x[:n], y[:n] = joined[:n], joined[1:n + 1]
    return x.reshape(rows, sequence_length), y.reshape(rows, sequence_length)


def shakespeare_task() -> Task:
    """Next-character prediction over 90 ids.

    Accuracy leaves out PAD (always) and EOS: FedJAX's Shakespeare model reports
    ``accuracy_in_vocab`` and ``accuracy_no_eos`` with ``masked_target_values=(pad, eos)``
    (``fedjax/models/shakespeare.py``); OOV targets count, and are errors unless predicted. (That
    file numbers the specials bos = 87, eos = 88, oov = 89, unlike its dataset's BOS = 1, EOS = 2,
    OOV = 89, which are what the arrays hold; we exclude the dataset's EOS, the intent of the mask.
    TFF's baseline masks PAD only.)
    """
    return Task(kind="sequence", num_classes=SHAKESPEARE_VOCAB_SIZE, inputs="tokens",
                vocab_size=SHAKESPEARE_VOCAB_SIZE, metric_excluded=(SHAKESPEARE_EOS,),
                default_model="char_lstm")


# --- Stack Overflow ----------------------------------------------------------------------------

SO_BOS = 1
SO_EOS = 2
_SO_RESERVED = 3                    # PAD, BOS, EOS
SO_VOCAB_SIZE = 10_000              # words (specials not counted); TFF and FedJAX default
SO_SEQUENCE_LENGTH = 20             # TFF constants.DEFAULT_SEQUENCE_LENGTH; FedJAX train length
SO_TAG_VOCAB_SIZE = 500             # TFF constants.DEFAULT_TAG_VOCAB_SIZE
SO_MAX_TOKENS = 64                  # our L for tag-prediction inputs (see stackoverflow_tp_examples)
SO_MAX_TAGS = 5                     # K: Stack Overflow allows at most five tags per question


class WordVocab:
    """The V most frequent words, with FedJAX's ids (module docstring): word k → k + 3."""

    def __init__(self, words: Sequence[str]):
        self.words = tuple(words)
        self.oov = _SO_RESERVED + len(self.words)
        self.size = self.oov + 1
        self._ids = {w.encode("utf-8"): _SO_RESERVED + k for k, w in enumerate(self.words)}

    def strings(self) -> tuple[str, ...]:
        """Token strings by id: ("<pad>", "<bos>", "<eos>", words…, "<oov>")."""
        return ("<pad>", "<bos>", "<eos>", *self.words, "<oov>")

    def lookup(self, words: Sequence[bytes]) -> list[int]:
        """Ids of the words (OOV for any word outside the vocabulary)."""
        get, oov = self._ids.get, self.oov
        return [get(w, oov) for w in words]


def read_word_counts(path: str, vocab_size: int = SO_VOCAB_SIZE) -> list[str]:
    """The first `vocab_size` words of TFF's ``stackoverflow.word_count`` (lines "word count", most
    frequent first; TFF ``stackoverflow.load_word_counts`` and FedJAX ``default_vocab`` read it
    the same way). A file with fewer words gives them all; a malformed line raises
    `DataFormatError`."""
    words: list[str] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if len(words) >= vocab_size:
                break
            parts = line.split()
            if len(parts) != 2 or not parts[1].isdigit():
                raise DataFormatError(path, f"line {lineno} is not 'word count': {line.rstrip()!r}")
            words.append(parts[0])
    if not words:
        raise DataFormatError(path, "no words")
    return words


def read_tag_counts(path: str, num_tags: int = SO_TAG_VOCAB_SIZE) -> list[str]:
    """The `num_tags` most frequent tags of TFF's ``stackoverflow.tag_count`` (a JSON object tag →
    count). Sorted by count, descending; ties keep the file's order (Python's stable sort, as
    TFF's ``load_tag_counts`` sorts the same dict)."""
    try:
        with open(path, encoding="utf-8") as f:
            counts = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataFormatError(path, f"not a JSON object of tag counts ({e})") from None
    if not isinstance(counts, dict) or not counts or not all(
            isinstance(c, int) for c in counts.values()):
        raise DataFormatError(path, "not a non-empty JSON object of tag -> integer count")
    ranked = sorted(counts.items(), key=lambda item: item[1], reverse=True)
    return [tag for tag, _ in ranked[:num_tags]]


def stackoverflow_nwp_sequences(sentences: Sequence[bytes | str], vocab: WordVocab,
                                sequence_length: int = SO_SEQUENCE_LENGTH
                                ) -> tuple[np.ndarray, np.ndarray]:
    """Each sentence → one next-word row, as FedJAX's `DefaultWordTokenizer` (and TFF's
    `build_to_ids_fn` + `split_input_target`, up to the special ids).

    With w₁ … w_m the sentence's whitespace-separated words mapped to ids, s = [BOS, w₁…w_m, EOS];
    inputs = s[0 : m+1] and targets = s[1 : m+2], each truncated or PAD-padded to L. So a sentence
    of m ≥ L words has no EOS target (it is cut), and one of m < L words ends its targets with
    EOS. Words are split on any whitespace (the tokens were whitespace-normalised by TFF);
    an empty sentence gives inputs [BOS] and targets [EOS].

    Returns:
      (x, y), both [len(sentences), L] int32.
    """
    if sequence_length < 1:
        raise ValueError(f"sequence_length must be >= 1, got {sequence_length}")
    L = sequence_length
    x = np.zeros((len(sentences), L), np.int32)
    y = np.zeros((len(sentences), L), np.int32)
    for i, sentence in enumerate(sentences):
        s = [SO_BOS, *vocab.lookup(_as_bytes(sentence).split()[:L]), SO_EOS]
        n = min(len(s) - 1, L)
        x[i, :n] = s[:n]
        y[i, :n] = s[1:n + 1]
    return x, y


def stackoverflow_tp_examples(tokens: Sequence[bytes | str], titles: Sequence[bytes | str],
                              tags: Sequence[bytes | str], vocab: WordVocab,
                              tag_vocab: Sequence[str], max_tokens: int = SO_MAX_TOKENS,
                              max_tags: int = SO_MAX_TAGS) -> tuple[np.ndarray, np.ndarray]:
    """Tag prediction examples: the words of a post (as ids, the model builds the bag) → its tags.

    TFF's ``tag_prediction_preprocessing.build_to_ids_fn`` joins ``tokens + " " + title``, splits on
    whitespace, and feeds the model the normalised bag of words: the mean of the one-hot rows over
    V + 1 ids (the V words and one out-of-vocabulary bucket), then the OOV column is dropped — so
    an out-of-vocabulary word has no feature but counts in the mean's denominator — and a
    multi-hot vector of the post's in-vocabulary tags (``tags`` split on "|").

    Here x[i] holds the words of (tokens, then title) in order, as ids k + 1 for the k-th most
    frequent word (1 … V) and V + 1 for any other word, truncated to the first `max_tokens` = L
    words and PAD-padded (PAD = 0). The task's input vocabulary is V + 1 ids (PAD and the words):
    the OOV id V + 1 lies outside it, so `models.sequence.TagLogReg`'s bag count(id)/#non-PAD gives
    it no feature while it counts in the denominator — TFF's input exactly when the post has ≤ L
    words; words past L are dropped. y[i] holds the post's tags among the `tag_vocab` (ids = rank 0 … T−1,
    duplicates removed, in the post's order), at most `max_tags` = K of them, padded with −1.
    A post whose tags are all outside the T (e.g. an answer, whose ``tags`` is empty) keeps its
    row with y = [−1 …]: it adds nothing to recall@k's true labels, as TFF's all-zero tag vector
    adds nothing to Keras' Recall, and in a sigmoid loss all its tags are negatives, as in TFF.

    Returns:
      x [n, L] int32 and y [n, K] int32.
    """
    if not (len(tokens) == len(titles) == len(tags)):
        raise ValueError(f"tokens, titles and tags differ in length: "
                         f"{len(tokens)}, {len(titles)}, {len(tags)}")
    tag_ids = {t.encode("utf-8"): k for k, t in enumerate(tag_vocab)}
    x = np.zeros((len(tokens), max_tokens), np.int32)
    y = np.full((len(tokens), max_tags), -1, np.int32)
    for i, (body, title, post_tags) in enumerate(zip(tokens, titles, tags)):
        words = _as_bytes(body).split() + _as_bytes(title).split()
        # WordVocab ids are k + 3; here the bag's ids are k + 1 (no BOS/EOS in a bag).
        ids = [w - 2 for w in vocab.lookup(words)][:max_tokens]       # OOV: V + 3 → V + 1
        x[i, :len(ids)] = ids
        seen: list[int] = []
        for t in _as_bytes(post_tags).split(b"|"):
            k = tag_ids.get(t)
            if k is not None and k not in seen:
                seen.append(k)
        seen = seen[:max_tags]
        y[i, :len(seen)] = seen
    return x, y


def stackoverflow_nwp_task(vocab_size: int = SO_VOCAB_SIZE) -> Task:
    """Next-word prediction over V + 4 ids.

    Accuracy leaves out PAD (always) and EOS, as FedJAX's Stack Overflow model
    (``fedjax/models/stackoverflow.py``: ``masked_target_values=(pad, eos)``); OOV targets count
    and are errors unless predicted (FedJAX's ``accuracy_in_vocab`` also forbids predicting OOV;
    TFF's ``accuracy_without_out_of_vocab_or_end_of_sentence`` drops OOV targets as well).
    """
    size = vocab_size + _SO_RESERVED + 1
    return Task(kind="sequence", num_classes=size, inputs="tokens", vocab_size=size,
                metric_excluded=(SO_EOS,), default_model="word_lstm")


def stackoverflow_tp_task(vocab_size: int = SO_VOCAB_SIZE,
                          num_tags: int = SO_TAG_VOCAB_SIZE) -> Task:
    """Tag prediction: V + 1 input ids (PAD and the words; the OOV id V + 1 lies outside, see
    `stackoverflow_tp_examples`) → `num_tags` tags, recall@5 (TFF's
    ``tf.keras.metrics.Recall(top_k=5)`` in ``tag_prediction_tasks.py``)."""
    return Task(kind="multilabel", num_classes=num_tags, inputs="tokens",
                vocab_size=vocab_size + 1, topk=5, default_model="tag_logreg")
