"""The command line with a pretrained model: --model hf:PATH, --peft lora, --export in PEFT's format."""

import json

import jax
import numpy as np
import pytest
from helpers import finished_cli_run
from hf_folders import llama_weights, write_folder
from safetensors.numpy import load_file
from tokenizers import Tokenizer, models, pre_tokenizers

WORDS = ["<unk>", "</s>", "<pad>", "the", "cat", "dog", "sat", "ran", "on", "mat", "a", "big"]
LLAMA = dict(model_type="llama", vocab_size=len(WORDS), hidden_size=8, intermediate_size=12,
             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-6,
             rope_theta=10000.0, tie_word_embeddings=True, rope_scaling=None)


def _tokenizer(folder, words=WORDS):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))


def _folders(tmp_path, words=WORDS):
    model = write_folder(tmp_path / "llama", LLAMA, llama_weights(LLAMA, np.random.default_rng(0)))
    _tokenizer(model, words)
    rng = np.random.default_rng(1)
    lines = [json.dumps({"client": f"c{i % 3}",
                         "text": " ".join(rng.choice(WORDS[3:], size=6))}) for i in range(24)]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(lines) + "\n")
    return model, data


def _argv(model, data, *extra):
    return ["--model", f"hf:{model}", "--dataset", "jsonl", "--data-dir", str(data),
            "--max-length", "8", "--algo", "fedavg", "--rounds", "2", "--local-steps", "2",
            "--lr", "0.5", *extra]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_lora_fedavg_exports_peft_adapters_and_a_merged_hf_folder(tmp_path, dtype):
    model, data = _folders(tmp_path)
    out = tmp_path / "run"
    finished_cli_run(out, _argv(model, data, "--peft", "lora", "--lora-rank", "2",
                                "--lora-alpha", "4", "--lora-targets", "q_proj,v_proj",
                                "--model-dtype", dtype, "--export"))
    # (a bfloat16 base: the merged kernels are rounded to bfloat16, 8 bits of mantissa)
    # (bfloat16: W + (α/r)·BA rounded once, BA itself maybe once: 2 roundings of 2^-9)
    rtol, atol = (1e-5, 1e-6) if dtype == "float32" else (2.0 ** -7, 1e-6)
    loaded = np.dtype(jax.numpy.dtype(dtype))       # the base as loaded: the source rounded
    final = out / "final"
    adapters = load_file(str(final / "global" / "adapter_model.safetensors"))
    # The expected tensors, written out: 2 layers × (q_proj [out 8], v_proj [out 4 = 1 kv head × 4]).
    want = {}
    for i in range(2):
        for proj, d_out in (("q_proj", 8), ("v_proj", 4)):
            m = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            want[f"{m}.lora_A.weight"] = (2, 8)
            want[f"{m}.lora_B.weight"] = (d_out, 2)
    assert {k: v.shape for k, v in adapters.items()} == want
    # Trained: B left zero would mean no update reached the adapters.
    assert all(np.abs(v).max() > 0 for k, v in adapters.items() if k.endswith("lora_B.weight"))
    config = json.loads((final / "global" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["lora_dropout"]) == (
        "LORA", 2, 4.0, 0.0)
    assert config["target_modules"] == ["q_proj", "v_proj"]
    assert config["base_model_name_or_path"] == str(model)
    # The base never changed: the merged export is the source's weights except the targeted
    # kernels, which are W + (α/r)·B A (PyTorch's [out, in] layout), computed here in float64.
    source = load_file(str(model / "model.safetensors"))
    merged = load_file(str(final / "merged" / "model.safetensors"))
    assert set(merged) == set(source)
    for name, w in source.items():
        module = name.rsplit(".", 1)[0]
        a = adapters.get(f"base_model.model.{module}.lora_A.weight")
        if a is None:
            np.testing.assert_array_equal(np.asarray(merged[name], np.float32),
                                          np.asarray(w.astype(loaded), np.float32))
        else:
            b = adapters[f"base_model.model.{module}.lora_B.weight"].astype(np.float64)
            w0, a = np.asarray(w.astype(loaded), np.float64), a.astype(np.float64)
            want = w0 + (4.0 / 2) * b @ a
            # each rounding's error is relative to the magnitudes it rounds (|W|, |B||A|)
            bound = rtol * (np.abs(w0) + (4.0 / 2) * np.abs(b) @ np.abs(a)) + atol
            assert np.all(np.abs(np.asarray(merged[name], np.float64) - want) <= bound), name
    assert (final / "merged" / "config.json").exists()


def test_a_tokenizer_larger_than_the_models_vocabulary_is_one_line(tmp_path, capsys):
    import run as cli

    model, data = _folders(tmp_path)
    other = tmp_path / "tok"
    other.mkdir()
    _tokenizer(other, WORDS + ["extra", "words", "here"])
    with pytest.raises(SystemExit) as exit_:
        cli.main(_argv(model, data, "--tokenizer", str(other / "tokenizer.json"),
                       "--out", str(tmp_path / "r"), "--quiet"))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
    assert f"has a vocabulary of {len(WORDS)} tokens, the task's is {len(WORDS) + 3}" in err
    assert "--model" in err and "--tokenizer" in err


@pytest.mark.parametrize("flags,message", [
    ("--peft lora --lora-targets q_proj",
     "--lora-targets 'q_proj' names no dense module; the model's dense modules are Dense_0, Dense_1"),
    ("--peft lora --lora-targets all --lora-rank 65",
     "--lora-rank 65 exceeds Dense_0's dimensions (64, 100) (d_in, d_out)"),
    ("--peft lora --lora-targets ,", "--lora-targets names no module, got ','"),
    ("--lora-rank 4", "--lora-rank applies with --peft lora only"),
    ("--peft lora --lora-dropout 1", "--lora-dropout must be in [0, 1), got 1.0"),
])
def test_a_bad_adapter_setting_on_a_zoo_model_is_one_line(flags, message, tmp_path, capsys):
    import run as cli

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        cli.main(flags.split() + ["--rounds", "1", "--out", str(out), "--quiet"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"run.py: error: {message}\n"
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_pretrained_model_trained_whole_exports_and_loads_back(tmp_path, dtype):
    """hf:PATH without --peft: final/ is the library's export (export.load rebuilds the decoder
    from PATH) and final/hf/ the global model in the Hugging Face layout; both give the same
    logits, the weights moved from the source's, and the names and shapes are the source's."""
    import jax
    import jax.numpy as jnp

    from fedjax_pfl import export
    from fedjax_pfl.models import hf

    model, data = _folders(tmp_path)
    out = tmp_path / "run"
    finished_cli_run(out, _argv(model, data, "--model-dtype", dtype, "--export"))
    final = out / "final"
    rebuilt, params, personal = export.load(str(final))
    assert personal is None
    assert json.loads((final / "model.json").read_text())["model"]["dtype"] == dtype
    source = load_file(str(model / "model.safetensors"))
    written = load_file(str(final / "hf" / "model.safetensors"))
    assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in source.items()}
    moved = [k for k in source if not np.array_equal(np.asarray(written[k], np.float32),
                                                     np.asarray(source[k], np.float32))]
    assert moved, "no weight changed in 2 rounds of training"
    assert (final / "hf" / "config.json").exists() and (final / "hf" / "tokenizer.json").exists()
    _, hf_params = hf.load(str(final / "hf"), dtype)
    tokens = jnp.asarray([[3, 4, 5, 6, 7, 8]], jnp.int32)
    ours = np.asarray(rebuilt.apply(params, tokens), np.float32)
    theirs = np.asarray(hf.model_from_hf(str(final / "hf"), dtype=dtype).apply(hf_params, tokens),
                        np.float32)
    assert ours.shape == (1, 6, len(WORDS))
    np.testing.assert_array_equal(ours, theirs)
    assert {str(x.dtype) for x in jax.tree.leaves(params)} == {dtype}
