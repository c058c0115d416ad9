"""Tests for fedjax_pfl.data.jsonl (JSON Lines text clients) and data.tokenizer (the token contract).

Every fixture is written here: .jsonl files, and a tiny tokenizer.json built with the
`tokenizers` library itself (a WordLevel model on a 16-word vocabulary, whitespace split; one
with a BOS post-processor). Expected ids come from that tokenizer's own `encode`, called here, or
are spelt out by hand from the vocabulary; the +1 shift, the padding and the response mask are
written out again in the test, never taken from the reader.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from fedjax_pfl.data import formats, jsonl
from fedjax_pfl.data.federated import check_labels
from fedjax_pfl.data.natural import DataFormatError
from fedjax_pfl.data.sources import DatasetNotFoundError
from fedjax_pfl.errors import OptionError
from fedjax_pfl.models import tasks

# "the" is id 0 on purpose: a real token of id 0 must be scored (label 1), not taken for padding.
WORDS = ("the </s> <pad> <unk> cat sat on mat dog ran ### Instruction: Response: say hi "
         "hello").split()
V = {w: i for i, w in enumerate(WORDS)}
EOS, PADID = V["</s>"], V["<pad>"]


def make_tokenizer(folder: Path, words=WORDS, bos: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", words.index("<s>"))])
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def write_jsonl(path: Path, records) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def blocks(data, tok, **options):
    return {b.client_id: b for b in jsonl.open_jsonl("jsonl", data, tokenizer=tok, **options).clients()}


def reference(text_ids, T, pad, scored_from=0):
    """x, y of one example by the contract, from ids s: x = s[:T] padded, y_t = s[t+1] + 1
    where t + 1 >= scored_from, 0 elsewhere (float64-free: plain Python lists)."""
    s = list(text_ids)[:T + 1]
    n = max(len(s) - 1, 0)
    x = s[:n] + [pad] * (T - n)
    y = [(s[t + 1] + 1 if t + 1 >= scored_from else 0) for t in range(n)] + [0] * (T - n)
    return np.array(x), np.array(y)


@pytest.fixture
def tok(tmp_path):
    return make_tokenizer(tmp_path / "tok")


# ---------------------------------------------------------------------------------------------
# clients, ids, labels


def test_clients_grouped_sorted_in_file_order(tmp_path, tok):
    d = tmp_path / "data"
    write_jsonl(d / "a.jsonl", [{"client": "bob", "text": "cat sat"},
                                {"client": 7, "text": "dog"},
                                {"client": "bob", "text": "dog ran"}])
    write_jsonl(d / "b.jsonl", [{"client": "bob", "text": "mat"}, "",
                                {"client": "amy", "text": "hi"}])
    write_jsonl(d / "ignored.json", [{"client": "zed", "text": "hi"}])
    got = blocks(d, tok, test_fraction=0.25, max_length=4)
    assert list(got) == ["7", "amy", "bob"]                # sorted string ids; .json not read
    bob = got["bob"]
    # 3 examples: ceil(0.75) = 1 held out, the last one (file order: a.jsonl's two, then b's).
    firsts = [row[0] for row in np.concatenate([bob.train_x, bob.test_x])]
    assert firsts == [V["cat"], V["dog"], V["mat"]]
    assert bob.train_x.shape == (2, 4) and bob.test_x.shape == (1, 4)
    # a client of one example keeps it for training
    assert got["amy"].train_x.shape == (1, 4) and got["amy"].test_x.shape == (0, 4)


def test_split_sizes_follow_ceil_of_fraction(tmp_path, tok):
    recs = [{"client": "c", "text": " ".join(["cat"] * (i + 1))} for i in range(7)]
    for f, n_test in ((0.25, 2), (0.5, 4), (0.0, 0)):         # ceil(1.75), ceil(3.5), 0
        b = blocks(write_jsonl(tmp_path / "d.jsonl", recs), tok, test_fraction=f, max_length=10)["c"]
        assert b.test_x.shape[0] == n_test and b.train_x.shape[0] == 7 - n_test
        # the held-out ones are the last: example i has i + 1 cats, i + 2 tokens with eos
        lengths = [int(np.sum(y > 0)) for y in np.concatenate([b.train_y, b.test_y])]
        assert lengths == list(range(1, 8))


def test_token_ids_match_the_tokenizers_own_encode(tmp_path, tok):
    texts = ["the cat sat on the mat", "dog ran", "hello unknownword the"]
    data = write_jsonl(tmp_path / "d.jsonl", [{"client": "c", "text": t} for t in texts])
    b = blocks(data, tok, test_fraction=0.0, max_length=8)["c"]
    ref_tok = Tokenizer.from_file(str(tok))
    for i, t in enumerate(texts):
        ids = ref_tok.encode(t).ids + [EOS]
        x, y = reference(ids, 8, PADID)
        np.testing.assert_array_equal(b.train_x[i], x)
        np.testing.assert_array_equal(b.train_y[i], y)
    assert b.train_x.dtype == np.int32 and b.train_y.dtype == np.int32


def test_labels_are_next_token_plus_one_and_pad_zero(tmp_path, tok):
    # "cat the" -> ids [4, 0, 1(eos)]: x = [4, 0, pad, pad], y = [0 + 1, 1 + 1, 0, 0].
    data = write_jsonl(tmp_path / "d.jsonl", [{"client": "c", "text": "cat the"}])
    b = blocks(data, tok, test_fraction=0.0, max_length=4)["c"]
    np.testing.assert_array_equal(b.train_x[0], [4, 0, 2, 2])
    np.testing.assert_array_equal(b.train_y[0], [1, 2, 0, 0])


def test_pad_id_falls_back_to_eos_then_zero(tmp_path):
    no_pad = [w for w in WORDS if w != "<pad>"]
    t1 = make_tokenizer(tmp_path / "t1", no_pad)
    data = write_jsonl(tmp_path / "d.jsonl", [{"client": "c", "text": "cat"}])
    b = blocks(data, t1, test_fraction=0.0, max_length=4)["c"]
    eos = no_pad.index("</s>")
    np.testing.assert_array_equal(b.train_x[0], [no_pad.index("cat"), eos, eos, eos])
    np.testing.assert_array_equal(b.train_y[0], [eos + 1, 0, 0, 0])


def test_no_eos_no_pad_uses_zero(tmp_path):
    neither = [w for w in WORDS if w not in ("</s>", "<pad>")]
    t = make_tokenizer(tmp_path / "t", neither)
    data = write_jsonl(tmp_path / "d.jsonl", [{"client": "c", "text": "cat sat"}])
    b = blocks(data, t, test_fraction=0.0, max_length=4)["c"]
    cat, sat = neither.index("cat"), neither.index("sat")
    np.testing.assert_array_equal(b.train_x[0], [cat, 0, 0, 0])
    np.testing.assert_array_equal(b.train_y[0], [sat + 1, 0, 0, 0])


def test_tokenizer_config_names_the_specials(tmp_path, tok):
    # tokenizer_config.json says eos is "mat" and pad "dog" (a string and an AddedToken dict).
    (tok.parent / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "mat", "pad_token": {"content": "dog"}}))
    data = write_jsonl(tmp_path / "d.jsonl", [{"client": "c", "text": "cat"}])
    b = blocks(data, tok.parent, test_fraction=0.0, max_length=3)["c"]
    np.testing.assert_array_equal(b.train_x[0], [V["cat"], V["dog"], V["dog"]])
    np.testing.assert_array_equal(b.train_y[0], [V["mat"] + 1, 0, 0])


def test_truncation_keeps_the_first_max_length_plus_one_tokens(tmp_path, tok):
    text = "the cat sat on the mat dog ran"                   # 8 words + eos = 9 tokens
    data = write_jsonl(tmp_path / "d.jsonl", [{"client": "c", "text": text}])
    ids = [V[w] for w in text.split()]
    b = blocks(data, tok, test_fraction=0.0, max_length=5)["c"]
    np.testing.assert_array_equal(b.train_x[0], ids[:5])
    np.testing.assert_array_equal(b.train_y[0], np.array(ids[1:6]) + 1)   # no eos: it was cut
    b = blocks(data, tok, test_fraction=0.0, max_length=8)["c"]           # exactly fits
    np.testing.assert_array_equal(b.train_y[0], np.array(ids[1:] + [EOS]) + 1)


# ---------------------------------------------------------------------------------------------
# instruction mode


def test_instruction_mode_scores_the_response_only(tmp_path, tok):
    data = write_jsonl(tmp_path / "d.jsonl", [
        {"client": "c", "q": "say hi", "a": "hello the"}])
    b = blocks(data, tok, test_fraction=0.0, max_length=12, instruction_field="q",
               response_field="a", prompt_template="### Instruction: {instruction} ### Response:")["c"]
    prompt = ["###", "Instruction:", "say", "hi", "###", "Response:"]      # P = 6 tokens
    s = [V[w] for w in prompt] + [V["hello"], V["the"], EOS]
    x_ref = s[:8] + [PADID] * 4
    # targets s[1..8]; only those at index >= 6 (hello, the, eos) are scored
    y_ref = [0, 0, 0, 0, 0, V["hello"] + 1, V["the"] + 1, EOS + 1] + [0] * 4
    np.testing.assert_array_equal(b.train_x[0], x_ref)
    np.testing.assert_array_equal(b.train_y[0], y_ref)


def test_default_template_and_other_fields(tmp_path, tok):
    assert jsonl.DEFAULT_PROMPT_TEMPLATE == "### Instruction:\n{instruction}\n\n### Response:\n"
    data = write_jsonl(tmp_path / "d.jsonl", [{"client": "c", "q": "say", "a": "hi", "ctx": "cat"}])
    b = blocks(data, tok, test_fraction=0.0, max_length=8, instruction_field="q",
               response_field="a")["c"]
    p = Tokenizer.from_file(str(tok)).encode(jsonl.DEFAULT_PROMPT_TEMPLATE.format(instruction="say")).ids
    x, y = reference(p + [V["hi"], EOS], 8, PADID, scored_from=len(p))
    np.testing.assert_array_equal(b.train_x[0], x)
    np.testing.assert_array_equal(b.train_y[0], y)
    b = blocks(data, tok, test_fraction=0.0, max_length=8, instruction_field="q",
               response_field="a", prompt_template="{ctx} {instruction}")["c"]
    np.testing.assert_array_equal(b.train_y[0], [0, V["hi"] + 1, EOS + 1, 0, 0, 0, 0, 0])


def test_bos_post_processor_on_the_prompt_not_the_response(tmp_path):
    words = [*WORDS, "<s>"]
    t = make_tokenizer(tmp_path / "t", words, bos=True)
    bos = words.index("<s>")
    data = write_jsonl(tmp_path / "d.jsonl", [{"client": "c", "text": "cat", "q": "say", "a": "hi"}])
    b = blocks(data, t, test_fraction=0.0, max_length=4)["c"]
    np.testing.assert_array_equal(b.train_x[0], [bos, V["cat"], PADID, PADID])
    np.testing.assert_array_equal(b.train_y[0], [V["cat"] + 1, EOS + 1, 0, 0])
    b = blocks(data, t, test_fraction=0.0, max_length=4, instruction_field="q", response_field="a",
               prompt_template="{instruction}")["c"]
    np.testing.assert_array_equal(b.train_x[0], [bos, V["say"], V["hi"], PADID])
    np.testing.assert_array_equal(b.train_y[0], [0, V["hi"] + 1, EOS + 1, 0])


def test_prompt_filling_max_length_is_dropped(tmp_path, tok):
    data = write_jsonl(tmp_path / "d.jsonl", [
        {"client": "c", "q": "cat cat cat cat", "a": "hi"},       # prompt 4 tokens, T = 3: dropped
        {"client": "c", "q": "cat", "a": "hi"}])
    r = jsonl.open_jsonl("jsonl", data, tokenizer=tok, test_fraction=0.0, max_length=3,
                         instruction_field="q", response_field="a", prompt_template="{instruction}")
    (b,) = list(r.clients())
    assert b.train_x.shape[0] == 1 and r.dropped == 1
    np.testing.assert_array_equal(b.train_y[0], [V["hi"] + 1, EOS + 1, 0])


# ---------------------------------------------------------------------------------------------
# errors


def test_error_missing_file_and_folder(tmp_path, tok):
    with pytest.raises(DatasetNotFoundError, match=r"data_dir .*nope.jsonl: no such JSON Lines"):
        jsonl.open_jsonl("jsonl", tmp_path / "nope.jsonl", tokenizer=tok)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetNotFoundError, match=r"holds no \*\.jsonl file"):
        jsonl.open_jsonl("jsonl", tmp_path / "empty", tokenizer=tok)
    data = write_jsonl(tmp_path / "d.jsonl", [{"client": "c", "text": "cat"}])
    with pytest.raises(DatasetNotFoundError, match=r"^tokenizer .*: no tokenizer file"):
        jsonl.open_jsonl("jsonl", data, tokenizer=tmp_path / "empty")
    with pytest.raises(OptionError, match=r"jsonl needs tokenizer PATH"):
        jsonl.open_jsonl("jsonl", data)
    (tmp_path / "bad.json").write_text("{not a tokenizer")
    with pytest.raises(OptionError, match=r"^tokenizer .*bad.json is not a tokenizer.json"):
        jsonl.open_jsonl("jsonl", data, tokenizer=tmp_path / "bad.json")


@pytest.mark.parametrize("line, pattern", [
    ('{"client": "c", "text": "cat"', r"d\.jsonl:2: not JSON"),
    ('[1, 2]', r"d\.jsonl:2: a JSON list, not an object"),
    ('{"text": "cat"}', r"d\.jsonl:2: the record has no field 'client' \(client_field\)"),
    ('{"client": "c"}', r"d\.jsonl:2, client 'c': the record has no field 'text' \(text_field\)"),
    ('{"client": ["c"], "text": "x"}', r"d\.jsonl:2: field 'client' \(client_field\) is list"),
    ('{"client": "c", "text": 3}', r"d\.jsonl:2, client 'c': field 'text' \(text_field\) is int"),
])
def test_error_bad_line_names_file_line_and_field(tmp_path, tok, line, pattern):
    data = write_jsonl(tmp_path / "d.jsonl", [{"client": "c", "text": "cat"}, line])
    with pytest.raises(DataFormatError, match=pattern) as e:
        blocks(data, tok)
    assert "\n" not in str(e.value)


def test_error_instruction_fields(tmp_path, tok):
    data = write_jsonl(tmp_path / "d.jsonl", [{"client": "c", "q": "say"}])
    with pytest.raises(DataFormatError, match=r"d\.jsonl:1, client 'c': the record has no field "
                                              r"'a' \(response_field\)"):
        blocks(data, tok, instruction_field="q", response_field="a")
    with pytest.raises(OptionError, match=r"instruction_field and response_field turn on"):
        blocks(data, tok, instruction_field="q")
    with pytest.raises(OptionError, match=r"prompt_template applies to instruction mode only"):
        blocks(data, tok, prompt_template="{instruction}")
    data = write_jsonl(tmp_path / "d.jsonl", [{"client": "c", "q": "say", "a": "hi"}])
    with pytest.raises(DataFormatError, match=r"prompt_template names \{ctx\}, a field the record"):
        blocks(data, tok, instruction_field="q", response_field="a", prompt_template="{ctx}")
    with pytest.raises(OptionError, match=r"max_length must be an integer >= 1, got 0"):
        blocks(data, tok, max_length=0)


def test_error_empty_dataset(tmp_path, tok):
    data = write_jsonl(tmp_path / "d.jsonl", ["", "  "])
    with pytest.raises(DatasetNotFoundError, match=r"no record in .*d\.jsonl \(empty dataset\)"):
        blocks(data, tok)
    data = write_jsonl(tmp_path / "d.jsonl", [{"client": "c", "q": "cat cat", "a": "hi"}])
    with pytest.raises(DatasetNotFoundError, match=r"none of the 1 examples .*max_length 1"):
        blocks(data, tok, max_length=1, instruction_field="q", response_field="a",
               prompt_template="{instruction}")


# ---------------------------------------------------------------------------------------------
# the shifted-label loss and metric (models/tasks.py), against float64 NumPy


def test_shifted_loss_and_accuracy_against_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 4, 5)).astype(np.float32)
    labels = np.array([[1, 5, 0, 0], [3, 0, 2, 1]], np.int32)    # classes y − 1; 0 not scored
    for b, t in ((0, 0), (1, 2), (1, 3)):                       # these predict their class y − 1
        logits[b, t, labels[b, t] - 1] += 10.0
    task = tasks.Task(kind="sequence", num_classes=5, inputs="tokens", vocab_size=5, label_offset=1)
    fns = tasks.for_task(task)
    z = logits.astype(np.float64)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    want = [sum(-logp[b, t, labels[b, t] - 1] for t in range(4) if labels[b, t]) for b in range(2)]
    np.testing.assert_allclose(np.asarray(fns["loss"](logits, labels)), want, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(fns["weight"](labels)), [2, 3])
    hits, count = fns["metric"](logits, labels)
    arg = z.argmax(-1)
    want_hits = [sum(arg[b, t] == labels[b, t] - 1 for t in range(4) if labels[b, t]) for b in range(2)]
    np.testing.assert_array_equal(np.asarray(hits), want_hits)
    assert want_hits[0] >= 1 and want_hits[1] >= 2                # (the boosted ones, at least)
    np.testing.assert_array_equal(np.asarray(count), [2, 3])
    # offset 0 keeps the unshifted functions themselves (bit for bit for every existing task)
    plain = tasks.for_task(tasks.Task(kind="sequence", num_classes=5, inputs="tokens", vocab_size=5))
    assert plain["loss"] is tasks.sequence_cross_entropy


def test_label_range_with_offset():
    task = tasks.Task(kind="sequence", num_classes=5, inputs="tokens", vocab_size=5, label_offset=1)
    check_labels(np.array([[0, 5]]), 5, task)                  # y − 1 = 4: the last class
    with pytest.raises(ValueError, match=r"label 6 is outside"):
        check_labels(np.array([[0, 6]]), 5, task)
    with pytest.raises(ValueError, match=r"label_offset"):
        tasks.Task(kind="classify", num_classes=5, label_offset=1)


# ---------------------------------------------------------------------------------------------
# the natural-data path: cache, subsets, the run configuration


def test_load_natural_caches_and_keys_the_tokenizer(tmp_path, tok):
    data = write_jsonl(tmp_path / "d.jsonl", [{"client": c, "text": "cat sat on the mat"}
                                              for c in "abcab"])
    logs: list[str] = []
    fd, info = formats.load_natural("jsonl", data_dir=str(data), tokenizer=str(tok), max_length=6,
                                    test_fraction=0.5, log=logs.append, device=False)
    assert info["num_clients"] == 3 and info["format"] == "jsonl"
    assert info["train_size"]["total"] == 3 and info["test_size"]["total"] == 2  # a, b: 1 + 1; c: 1 + 0
    assert fd.task.label_offset == 1 and fd.task.vocab_size == len(WORDS)
    assert any("converting" in m for m in logs)
    assert (tmp_path / ".fedjax_pfl_cache").is_dir()                   # beside the file
    logs.clear()
    formats.load_natural("jsonl", data_dir=str(data), tokenizer=str(tok), max_length=6,
                         test_fraction=0.5, log=logs.append, device=False)
    assert not logs                                                     # opened, not converted
    make_tokenizer(tok.parent, [*WORDS, "extra"])                       # another tokenizer
    formats.load_natural("jsonl", data_dir=str(data), tokenizer=str(tok), max_length=6,
                         test_fraction=0.5, log=logs.append, device=False)
    assert any("converting" in m for m in logs)                         # another cache key


def test_cli_flags_reach_the_reader(tmp_path, tok):
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
    import run as cli

    from fedjax_pfl.runner import loop

    data = write_jsonl(tmp_path / "d.jsonl", [
        {"who": "x", "q": "say", "a": "hi"}, {"who": "x", "q": "say", "a": "hello"},
        {"who": "y", "q": "cat", "a": "sat"}])
    args = cli.build_parser().parse_args([
        "--dataset", "jsonl", "--data-dir", str(data), "--tokenizer", str(tok.parent),
        "--client-field", "who", "--instruction-field", "q", "--response-field", "a",
        "--prompt-template", "{instruction}", "--max-length", "4", "--test-fraction", "0.5",
        "--out", str(tmp_path / "run")])
    args.explicit = {"dataset", "data_dir", "tokenizer", "client_field", "instruction_field",
                     "response_field", "prompt_template", "max_length", "test_fraction", "out"}
    cfg = cli.config_from_args(args)
    assert cfg.model is None and cfg.data_options["max_length"] == 4
    fd, info = loop.load_data(cfg)
    assert list(info["client_ids"]) == ["x", "y"]
    y = np.asarray(fd.y)
    assert y.shape[1] == 4
    # x's first example: "say" -> hi, eos scored: y = [hi + 1, eos + 1, 0, 0]
    np.testing.assert_array_equal(y[0], [V["hi"] + 1, EOS + 1, 0, 0])


def test_jsonl_options_refused_elsewhere():
    from fedjax_pfl.runner import RunConfig

    with pytest.raises(OptionError, match=r"max_length applies to dataset jsonl only"):
        RunConfig.from_options(dataset="digits", max_length=8)
    with pytest.raises(OptionError, match=r"tokenizer applies to dataset jsonl"):
        RunConfig.from_options(dataset="digits", tokenizer="x")


@pytest.mark.slow
def test_cli_trains_a_small_transformer_one_round(tmp_path, tok):
    from support.helpers import finished_cli_run

    recs = [{"client": c, "text": t} for c in ("a", "b", "c")
            for t in ("the cat sat on the mat", "dog ran", "cat sat", "the dog")]
    data = write_jsonl(tmp_path / "d.jsonl", recs)
    summary, rows, _ = finished_cli_run(tmp_path / "run", [
        "--dataset", "jsonl", "--data-dir", str(data), "--tokenizer", str(tok), "--max-length", "8",
        "--rounds", "1", "--model-options", "width=16,layers=1,heads=2"])
    assert summary["dataset"] == "jsonl" and summary["model"] == "transformer"
    assert math.isfinite(rows[-1]["train_loss"])
    # untrained and after one round, the loss is near log V (uniform over 16 tokens), not 0
    assert 0.5 * math.log(len(WORDS)) < rows[-1]["train_loss"] < 2 * math.log(len(WORDS))


def test_label_counts_count_classes_not_shifted_labels(tmp_path, tok):
    from fedjax_pfl.data.federated import label_counts

    # client a: "cat the" -> targets the (id 0), eos; client b: "the the the" -> the, the, eos
    data = write_jsonl(tmp_path / "d.jsonl", [{"client": "a", "text": "cat the"},
                                              {"client": "b", "text": "the the the"}])
    fd, _ = formats.load_natural("jsonl", data_dir=str(data), tokenizer=str(tok), max_length=4,
                                 test_fraction=0.0, log=None, device=False)
    counts = label_counts(fd, "all")
    want = np.zeros((2, len(WORDS)), np.int64)
    want[0, V["the"]], want[0, EOS] = 1, 1
    want[1, V["the"]], want[1, EOS] = 2, 1
    np.testing.assert_array_equal(counts, want)
