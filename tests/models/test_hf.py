"""Pretrained decoders from Hugging Face folders (models/hf/): random weights written here in HF's
own layout (config.json with its real keys, safetensors with HF's tensor names and shapes:
nn.Linear weights [out, in], GPT-2's Conv1D [in, out]) are loaded and their logits compared with
float64 NumPy forward passes of the architectures written below from HF's modeling code
(`modeling_llama.py`, `modeling_gpt2.py`), independently of the flax modules."""

import json
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hf_folders import gpt2_weights, llama_weights, write_folder

from fedjax_pfl.errors import OptionError
from fedjax_pfl.models import hf

# -- float64 references, on HF-layout tensors ---------------------------------------------------


def _rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def _layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    return w * (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) + b


def _softmax(s):
    s = s - s.max(-1, keepdims=True)
    e = np.exp(s)
    return e / e.sum(-1, keepdims=True)


def _ref_inv_freq(d, theta, scaling):
    """transformers' ROPE_INIT_FUNCTIONS (default, linear, llama3), vectorised."""
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind in (None, "default"):
        return inv
    if kind == "linear":
        return inv / scaling["factor"]
    factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    out = np.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return np.where(medium, (1 - smooth) * out / factor + smooth * out, out)


def _attend(q, k, v, scale, key_mask=None):
    """q [B, T, H, d], k/v [B, T, H, d] (already one per query head): causal attention."""
    t = q.shape[1]
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    allowed = np.tril(np.ones((t, t), bool))[None, None]
    if key_mask is not None:
        allowed = (allowed & key_mask[:, None, None, :]) | np.eye(t, dtype=bool)
    s = np.where(allowed, s, -np.inf)
    return np.einsum("bhqk,bkhd->bqhd", _softmax(s), v)


def llama_reference(w, cfg, ids, key_mask=None):
    """LlamaForCausalLM's forward in float64: (logits, final hidden)."""
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim", cfg["hidden_size"] // heads)
    eps = cfg["rms_norm_eps"]
    b, t = ids.shape
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    inv = _ref_inv_freq(d, theta, rope if rope else cfg.get("rope_scaling"))
    ang = np.arange(t)[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope_(x):                                       # [B, T, h, d], HF's rotate_half layout
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos[None, :, None] + np.concatenate([-x2, x1], -1) * sin[None, :, None]

    def lin(x, name):
        y = x @ w[name + ".weight"].T                  # nn.Linear: weight [out, in]
        return y + w[name + ".bias"] if name + ".bias" in w else y

    h = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = _rms(h, w[p + "input_layernorm.weight"], eps)
        q = rope_(lin(x, p + "self_attn.q_proj").reshape(b, t, heads, d))
        k = rope_(lin(x, p + "self_attn.k_proj").reshape(b, t, kv, d))
        v = lin(x, p + "self_attn.v_proj").reshape(b, t, kv, d)
        k, v = np.repeat(k, heads // kv, axis=2), np.repeat(v, heads // kv, axis=2)   # repeat_kv
        h = h + lin(_attend(q, k, v, d ** -0.5, key_mask).reshape(b, t, heads * d), p + "self_attn.o_proj")
        x = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
        g = lin(x, p + "mlp.gate_proj")
        h = h + lin(g / (1 + np.exp(-g)) * lin(x, p + "mlp.up_proj"), p + "mlp.down_proj")
    h = _rms(h, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else w["lm_head.weight"]
    return h @ head.T, h


def gpt2_reference(w, cfg, ids):
    """GPT2LMHeadModel's forward in float64 (Conv1D: x @ weight + bias, weight [in, out])."""
    w = {k.removeprefix("transformer."): np.asarray(v, np.float64) for k, v in w.items()}
    b, t = ids.shape
    dm, nh, eps = cfg["n_embd"], cfg["n_head"], cfg["layer_norm_epsilon"]
    hd = dm // nh
    conv = lambda x, name: x @ w[name + ".weight"] + w[name + ".bias"]
    gelu = lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    h = w["wte.weight"][ids] + w["wpe.weight"][np.arange(t)]
    for i in range(cfg["n_layer"]):
        p = f"h.{i}."
        x = _layer_norm(h, w[p + "ln_1.weight"], w[p + "ln_1.bias"], eps)
        qkv = conv(x, p + "attn.c_attn")
        q, k, v = (qkv[..., j * dm:(j + 1) * dm].reshape(b, t, nh, hd) for j in range(3))
        scale = hd ** -0.5 / ((i + 1) if cfg.get("scale_attn_by_inverse_layer_idx") else 1)
        h = h + conv(_attend(q, k, v, scale).reshape(b, t, dm), p + "attn.c_proj")
        x = _layer_norm(h, w[p + "ln_2.weight"], w[p + "ln_2.bias"], eps)
        h = h + conv(gelu(conv(x, p + "mlp.c_fc")), p + "mlp.c_proj")
    h = _layer_norm(h, w["ln_f.weight"], w["ln_f.bias"], eps)
    head = w["wte.weight"] if cfg.get("tie_word_embeddings", True) else w["lm_head.weight"]
    return h @ head.T, h


# -- folders in HF's layout -----------------------------------------------------------------------

LLAMA_GQA = dict(  # GQA 4:2, tied, explicit head_dim ≠ hidden/heads, llama3 rope scaling
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=23, hidden_size=12,
    intermediate_size=20, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
    max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    torch_dtype="bfloat16",
    # wavelengths 2π·θ^(2j/8) = 6.3, 63, 628, 6283 against 64/4 = 16 and 64/1 = 64: one
    # frequency kept, one smoothed, two divided by the factor.
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=64))
LLAMA_MHA = dict(  # multi-head, untied lm_head, biases, no rope scaling
    model_type="llama", vocab_size=19, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=500.0,
    tie_word_embeddings=False, attention_bias=True, mlp_bias=True, rope_scaling=None)
LLAMA_MQA = dict(  # one key/value head, linear scaling, transformers 5's rope_parameters
    model_type="llama", vocab_size=17, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=1, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="linear", rope_theta=100.0, factor=4.0))
GPT2 = dict(model_type="gpt2", vocab_size=29, n_positions=16, n_embd=12, n_layer=2, n_head=3,
            n_inner=None, layer_norm_epsilon=1e-5, activation_function="gelu_new",
            scale_attn_weights=True, bos_token_id=0, eos_token_id=0)


def _ids(rng, vocab, b=2, t=11):
    return rng.integers(0, vocab, size=(b, t)).astype(np.int32)


def _close(got, want, rtol=1e-5):
    """Relative to the reference's scale: |got − want| ≤ rtol·(|want| + max|want|·0.1)."""
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol,
                               atol=rtol * 0.1 * np.abs(want).max())


# -- logits against the references ----------------------------------------------------------------


@pytest.mark.parametrize("cfg", [LLAMA_GQA, LLAMA_MHA, LLAMA_MQA], ids=["gqa-tied-llama3", "mha-untied-bias",
                                                                         "mqa-linear-rope5"])
@pytest.mark.slow
def test_llama_logits_equal_a_float64_reference(tmp_path, cfg):
    rng = np.random.default_rng(0)
    w = llama_weights(cfg, rng)
    decoder, params = hf.load(str(write_folder(tmp_path / "m", cfg, w)))
    ids = _ids(rng, cfg["vocab_size"])
    want, _ = llama_reference(w, cfg, ids)
    got = jax.jit(decoder.apply)(params, jnp.asarray(ids))
    assert got.shape == (2, 11, cfg["vocab_size"]) and got.dtype == jnp.float32
    _close(got, want)


def test_llama3_rope_scaling_hits_its_three_bands():
    """The GQA case's frequencies: one kept, one smoothed, two divided by the factor (so the
    logits test covers each branch), and our frequencies equal the reference's."""
    s = LLAMA_GQA["rope_scaling"]
    base = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)
    ref = _ref_inv_freq(8, 10000.0, s)
    assert ref[0] == base[0]
    assert base[1] / 8 < ref[1] < base[1]
    np.testing.assert_allclose(ref[2:], base[2:] / 8, rtol=1e-15)
    got = hf.config.rope_frequencies(8, 10000.0, hf.config.config_from_dict(LLAMA_GQA).scaling)
    np.testing.assert_allclose(got, ref, rtol=1e-14)


@pytest.mark.slow
def test_gpt2_logits_equal_a_float64_reference(tmp_path):
    rng = np.random.default_rng(1)
    w = gpt2_weights(GPT2, rng)
    decoder, params = hf.load(str(write_folder(tmp_path / "g", GPT2, w)))
    ids = _ids(rng, GPT2["vocab_size"], t=16)
    want, want_h = gpt2_reference(w, GPT2, ids)
    _close(jax.jit(decoder.apply)(params, jnp.asarray(ids)), want)
    _close(jax.jit(decoder.hidden)(params, jnp.asarray(ids)), want_h)


def test_gpt2_saved_from_gpt2model_untied_and_layer_scaled(tmp_path):
    """openai-community/gpt2's spelling (no `transformer.` prefix, causal-mask buffers beside
    the weights), and the untied lm_head (nn.Linear [V, D]) with inverse-layer scaling."""
    cfg = dict(GPT2, tie_word_embeddings=False, scale_attn_by_inverse_layer_idx=True)
    rng = np.random.default_rng(2)
    w = gpt2_weights(cfg, rng, prefix="")
    stored = dict(w)
    for i in range(cfg["n_layer"]):
        stored[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 16, 16), np.float32))
        stored[f"h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    decoder, params = hf.load(str(write_folder(tmp_path / "g", cfg, stored)))
    assert params["lm_head"]["kernel"].shape == (12, 29)          # transposed [V, D] -> [D, V]
    ids = _ids(rng, cfg["vocab_size"], t=9)
    _close(jax.jit(decoder.apply)(params, jnp.asarray(ids)), gpt2_reference(w, cfg, ids)[0])


def test_sharded_checkpoint_loads_the_same_weights(tmp_path):
    rng = np.random.default_rng(3)
    w = llama_weights(LLAMA_GQA, rng)
    folder = write_folder(tmp_path / "s", LLAMA_GQA, w, shards=3)
    assert not (folder / "model.safetensors").exists()
    decoder, params = hf.load(str(folder))
    np.testing.assert_array_equal(params["model"]["layers_1"]["self_attn"]["k_proj"]["kernel"],
                                  w["model.layers.1.self_attn.k_proj.weight"].T)
    ids = _ids(rng, LLAMA_GQA["vocab_size"])
    _close(jax.jit(decoder.apply)(params, jnp.asarray(ids)), llama_reference(w, LLAMA_GQA, ids)[0])


def test_tied_checkpoint_with_a_stored_lm_head_and_rotary_buffers_ignores_them(tmp_path):
    rng = np.random.default_rng(4)
    w = llama_weights(LLAMA_GQA, rng)
    stored = dict(w, **{"lm_head.weight": rng.normal(size=(23, 12)).astype(np.float32),
                        "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)})
    decoder, params = hf.load(str(write_folder(tmp_path / "t", LLAMA_GQA, stored)))
    assert "lm_head" not in params
    ids = _ids(rng, 23)
    _close(jax.jit(decoder.apply)(params, jnp.asarray(ids)), llama_reference(w, LLAMA_GQA, ids)[0])


# -- bfloat16 -------------------------------------------------------------------------------------


def test_bfloat16_base_is_close_to_the_float32_reference(tmp_path):
    rng = np.random.default_rng(5)
    w = llama_weights(LLAMA_GQA, rng)
    decoder, params = hf.load(str(write_folder(tmp_path / "b", LLAMA_GQA, w)), dtype="bfloat16")
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(params))
    np.testing.assert_array_equal(                      # round-to-nearest of the stored float32
        np.asarray(params["model"]["embed_tokens"]["embedding"]),
        w["model.embed_tokens.weight"].astype(ml_dtypes.bfloat16))
    ids = _ids(rng, 23)
    want, _ = llama_reference(w, LLAMA_GQA, ids)
    got = np.asarray(jax.jit(decoder.apply)(params, jnp.asarray(ids)), np.float64)
    # bfloat16 has 8 bits of mantissa (relative step 2^-8 ≈ 0.4 %) through 2 layers.
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.999


def test_bf16_file_loads_exactly_as_float32(tmp_path):
    """A checkpoint stored in BF16 (SmolLM2's, Llama 3.2's): the float32 base holds its values
    exactly, and the logits match the reference on those values."""
    rng = np.random.default_rng(6)
    w = {k: v.astype(ml_dtypes.bfloat16) for k, v in llama_weights(LLAMA_MHA, rng).items()}
    decoder, params = hf.load(str(write_folder(tmp_path / "b", LLAMA_MHA, w)))
    np.testing.assert_array_equal(params["model"]["layers_0"]["mlp"]["down_proj"]["kernel"],
                                  w["model.layers.0.mlp.down_proj.weight"].astype(np.float32).T)
    ids = _ids(rng, 19)
    _close(jax.jit(decoder.apply)(params, jnp.asarray(ids)),
           llama_reference({k: v.astype(np.float32) for k, v in w.items()}, LLAMA_MHA, ids)[0])


# -- masks ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_padding_mask_hides_keys(tmp_path):
    """With a key mask, masked positions' tokens no longer reach later positions, and the logits
    equal the reference that leaves those keys out."""
    rng = np.random.default_rng(7)
    w = llama_weights(LLAMA_GQA, rng)
    decoder, params = hf.load(str(write_folder(tmp_path / "m", LLAMA_GQA, w)))
    ids = _ids(rng, 23, t=8)
    mask = np.ones(ids.shape, bool)
    mask[0, 2:4] = False
    got = jax.jit(decoder.apply)(params, jnp.asarray(ids), jnp.asarray(mask))
    _close(got, llama_reference(w, LLAMA_GQA, ids, key_mask=mask)[0])
    other = ids.copy()
    other[0, 2:4] = (ids[0, 2:4] + 5) % 23
    again = jax.jit(decoder.apply)(params, jnp.asarray(other), jnp.asarray(mask))
    np.testing.assert_allclose(again[0, 4:], got[0, 4:], rtol=1e-6)
    unmasked = [np.asarray(jax.jit(decoder.apply)(params, jnp.asarray(i))) for i in (ids, other)]
    assert np.abs(unmasked[0] - unmasked[1])[0, 4:].max() > 1e-3     # without the mask they do


# -- the engine's Model and the task --------------------------------------------------------------


def test_shifted_labels_by_hand():
    x = np.array([[5, 0, 7, 9], [3, 4, 0, 0]])
    scored = np.array([[True, True, True, True], [True, True, False, False]])
    np.testing.assert_array_equal(hf.shifted_labels(x, scored), [[1, 8, 10, 0], [5, 0, 0, 0]])
    np.testing.assert_array_equal(hf.shifted_labels(x), [[1, 8, 10, 0], [5, 1, 1, 0]])


@pytest.mark.slow
def test_model_from_hf_loss_weight_metric_and_features(tmp_path):
    rng = np.random.default_rng(8)
    w = llama_weights(LLAMA_GQA, rng)
    model = hf.model_from_hf(str(write_folder(tmp_path / "m", LLAMA_GQA, w)))
    params = model.init(jax.random.key(123))
    ids = _ids(rng, 23, t=7)
    ids[1, 5:] = 0                                              # padding after 5 tokens (id 0 = a real id)
    y = hf.shifted_labels(ids, np.arange(7)[None] < np.array([[7], [5]]))
    logits = jax.jit(model.apply)(params, jnp.asarray(ids))
    want_logits, want_h = llama_reference(w, LLAMA_GQA, ids)
    # float64: Σ over scored t of −log softmax(z_t)[x_{t+1}], and argmax hits.
    logp = want_logits - want_logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    n = [6, 4]
    want_loss = [-sum(logp[b, t, ids[b, t + 1]] for t in range(n[b])) for b in range(2)]
    want_hits = [sum(want_logits[b, t].argmax() == ids[b, t + 1] for t in range(n[b])) for b in range(2)]
    _close(model.loss(logits, jnp.asarray(y)), want_loss)
    np.testing.assert_array_equal(model.weight(jnp.asarray(y)), n)
    hits, count = model.metric(logits, jnp.asarray(y))
    np.testing.assert_array_equal(hits, want_hits)
    np.testing.assert_array_equal(count, n)
    _close(jax.jit(model.features)(params, jnp.asarray(ids)), want_h)
    both = jax.jit(model.features.with_outputs)(params, jnp.asarray(ids))
    _close(both[0], want_logits)
    _close(both[1], want_h)


def test_loss_gradient_reaches_every_parameter(tmp_path):
    rng = np.random.default_rng(9)
    model = hf.model_from_hf(str(write_folder(tmp_path / "m", GPT2, gpt2_weights(GPT2, rng))))
    ids = _ids(rng, 29, t=6)
    y = jnp.asarray(hf.shifted_labels(ids))
    grads = jax.jit(jax.grad(lambda p: model.loss(model.apply(p, jnp.asarray(ids)), y).sum()))(model.init(None))
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    assert leaves and all(np.isfinite(g).all() and np.abs(g).max() > 0 for _, g in leaves)


# -- names ----------------------------------------------------------------------------------------


def test_every_parameter_path_maps_to_its_hf_tensor_and_back(tmp_path):
    rng = np.random.default_rng(10)
    for cfg, w in ((LLAMA_MHA, llama_weights(LLAMA_MHA, rng)), (GPT2, gpt2_weights(GPT2, rng))):
        decoder, params = hf.load(str(write_folder(tmp_path / cfg["model_type"], cfg, w)))
        seen = set()
        for keys, leaf in jax.tree_util.tree_leaves_with_path(params):
            path = "/".join(k.key for k in keys)
            name = hf.hf_name(path)
            assert hf.flax_path(name) == path
            np.testing.assert_array_equal(hf.to_hf(path, leaf, cfg["model_type"]), w[name])
            seen.add(name)
        assert seen == set(w)
    assert hf.hf_name("model/layers_0/self_attn/q_proj") == "model.layers.0.self_attn.q_proj"
    assert hf.hf_name("transformer/h_11/attn/c_attn/kernel") == "transformer.h.11.attn.c_attn.weight"
    assert hf.flax_path("h.3.mlp.c_fc.weight") == "transformer/h_3/mlp/c_fc/kernel"
    assert hf.is_transposed("model/layers_0/mlp/up_proj/kernel", "llama")
    assert not hf.is_transposed("transformer/h_0/mlp/c_fc/kernel", "gpt2")
    assert hf.is_transposed("lm_head/kernel", "gpt2")


def test_every_linear_layer_is_a_flax_dense():
    import flax.linen as nn

    decoder = hf.decoder_from_config(LLAMA_MHA)
    found = []

    def record(next_fun, args, kwargs, context):
        if isinstance(context.module, nn.Dense) and context.method_name == "__call__":
            found.append("/".join(context.module.path))
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(decoder.module.init, jax.random.key(0), jnp.zeros((1, 3), jnp.int32))
    want = {f"model/layers_{i}/{m}" for i in range(2) for m in
            ("self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj", "self_attn/o_proj",
             "mlp/gate_proj", "mlp/up_proj", "mlp/down_proj")} | {"lm_head"}
    assert set(found) == want


# -- tokenizer ------------------------------------------------------------------------------------


def _tokenizer_json():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "hello": 4, "world": 5, "to": 6, "be": 7}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>", "<pad>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok.to_str()


def test_tokenizer_encodes_decodes_and_finds_special_ids(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(_tokenizer_json())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False}}))
    (folder / "config.json").write_text(json.dumps({"pad_token_id": 3, "eos_token_id": [7, 2]}))
    tok = hf.Tokenizer(str(folder))
    assert tok.encode("hello world to be") == [1, 4, 5, 6, 7]
    assert tok.encode("hello nope", add_special_tokens=False) == [4, 0]
    assert tok.encode_batch(["be", "to be"]) == [[1, 7], [1, 6, 7]]
    assert tok.decode([1, 4, 5]) == "hello world"
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 2, 3, 8)
    (folder / "tokenizer_config.json").unlink()
    tok = hf.Tokenizer(str(folder))                 # from config.json's ids (the first of a list)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (None, 7, 3)


# -- errors: one line naming the file -------------------------------------------------------------


def _error(exc, fn, *args, **kwargs):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_errors_name_the_file_and_what_is_wrong(tmp_path):
    rng = np.random.default_rng(11)
    w = llama_weights(LLAMA_MHA, rng)
    good = write_folder(tmp_path / "good", LLAMA_MHA, w)

    msg = _error(hf.PretrainedNotFoundError, hf.load, str(tmp_path / "nowhere"))
    assert "nowhere" in msg and "no such folder" in msg
    with pytest.raises(hf.PretrainedError) as info:     # the folder is the argument, for the CLI
        hf.load(str(tmp_path / "nowhere"))
    assert info.value.arguments == [("path", "model")]
    spell = {("path", "model"): "--model hf:"}.get
    assert info.value.render(lambda n, s: spell((n, s))).startswith(f"--model hf: {tmp_path}/nowhere: ")
    (tmp_path / "empty").mkdir()
    assert "config.json is missing" in _error(FileNotFoundError, hf.load, str(tmp_path / "empty"))

    bert = write_folder(tmp_path / "bert", dict(LLAMA_MHA, model_type="bert"), w)
    msg = _error(hf.PretrainedError, hf.load, str(bert))
    assert "config.json" in msg and "unknown model_type 'bert'" in msg and "llama" in msg

    nofile = write_folder(tmp_path / "nofile", LLAMA_MHA, w)
    (nofile / "model.safetensors").rename(nofile / "pytorch_model.bin")
    msg = _error(hf.PretrainedNotFoundError, hf.load, str(nofile))
    assert "model.safetensors" in msg and "pytorch_model.bin" in msg

    shard = write_folder(tmp_path / "shard", LLAMA_MHA, w, shards=2)
    (shard / "model-00002-of-00002.safetensors").unlink()
    assert "model-00002-of-00002.safetensors is missing" in _error(hf.PretrainedNotFoundError, hf.load, str(shard))

    missing = dict(w)
    del missing["model.layers.1.mlp.up_proj.weight"]
    msg = _error(hf.PretrainedError, hf.load, str(write_folder(tmp_path / "miss", LLAMA_MHA, missing)))
    assert "missing tensor 'model.layers.1.mlp.up_proj.weight'" in msg

    wrong = dict(w, **{"model.layers.0.self_attn.k_proj.weight": np.zeros((16, 8), np.float32)})
    msg = _error(hf.PretrainedError, hf.load, str(write_folder(tmp_path / "shape", LLAMA_MHA, wrong)))
    assert "model.safetensors" in msg and "shape of 'model.layers.0.self_attn.k_proj.weight' is [16, 8], " \
        "expected [16, 16]" in msg

    extra = dict(w, **{"model.layers.2.input_layernorm.weight": np.ones(16, np.float32)})
    msg = _error(hf.PretrainedError, hf.load, str(write_folder(tmp_path / "extra", LLAMA_MHA, extra)))
    assert "unexpected tensor 'model.layers.2.input_layernorm.weight'" in msg

    for bad, words in ((dict(LLAMA_MHA, num_key_value_heads=3), "multiple of num_key_value_heads 3"),
                       (dict(LLAMA_MHA, rope_scaling={"rope_type": "yarn", "factor": 2.0}), "'yarn'"),
                       (dict(LLAMA_MHA, rope_scaling={"rope_type": "llama3", "factor": 8.0}),
                        "'low_freq_factor'"),
                       (dict(LLAMA_MHA, hidden_act="gelu"), "hidden_act 'gelu'"),
                       ({k: v for k, v in LLAMA_MHA.items() if k != "vocab_size"}, "no 'vocab_size'"),
                       (dict(GPT2, activation_function="swish"), "activation_function 'swish'")):
        folder = tmp_path / f"cfg{abs(hash(words))}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(bad))
        msg = _error(hf.PretrainedError, hf.load, str(folder))
        assert "config.json" in msg and words in msg, msg

    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "config.json").write_text("{not json")
    assert "config.json is not readable JSON" in _error(hf.PretrainedError, hf.load, str(tmp_path / "json"))

    msg = _error(OptionError, hf.load, str(good), dtype="float16")
    assert "dtype must be one of ['float32', 'bfloat16']" in msg
    with pytest.raises(OptionError) as info:
        hf.load(str(good), dtype="float16")
    assert info.value.arguments == [("dtype", "model")]
    assert "tokenizer.json is missing" in _error(hf.PretrainedNotFoundError, hf.Tokenizer, str(good))


# -- against transformers itself, where it is installed ------------------------------------------


@pytest.mark.slow
def test_folders_saved_by_transformers_match_its_own_logits_and_tokenizer(tmp_path):
    """`save_pretrained` folders of transformers' own LlamaForCausalLM (GQA, tied, llama3 rope,
    in the config layout transformers writes) and GPT2LMHeadModel, in float32 and BF16, load to
    transformers' logits; its PreTrainedTokenizerFast's files give its ids."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)

    def randomise(module):                   # weights of order 1, not the init's 0.02
        with torch.no_grad():
            for name, p in module.named_parameters():
                base = 1.0 if p.ndim == 1 and ("norm" in name or "ln_" in name) and name.endswith("weight") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
        return module.eval()

    llama = randomise(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=16))))
    gpt2 = randomise(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=40, n_positions=32, n_embd=24, n_layer=2, n_head=3, bos_token_id=1, eos_token_id=2)))
    ids = np.random.default_rng(0).integers(0, 40, (2, 20))
    for label, module in (("llama", llama), ("gpt2", gpt2)):
        with torch.no_grad():
            want = module(torch.tensor(ids)).logits.double().numpy()
        module.save_pretrained(tmp_path / label)
        decoder, params = hf.load(str(tmp_path / label))
        _close(jax.jit(decoder.apply)(params, jnp.asarray(ids, jnp.int32)), want, rtol=2e-5)
        module.to(torch.bfloat16).save_pretrained(tmp_path / f"{label}-bf16")
        # Read back in float32 by transformers (a fresh float32 rotary buffer: `.to` rounds it).
        again = type(module).from_pretrained(tmp_path / f"{label}-bf16", dtype=torch.float32).eval()
        with torch.no_grad():
            want16 = again(torch.tensor(ids)).logits.double().numpy()
        decoder, params = hf.load(str(tmp_path / f"{label}-bf16"))   # BF16 file, float32 base
        _close(jax.jit(decoder.apply)(params, jnp.asarray(ids, jnp.int32)), want16, rtol=2e-5)

    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=__import__("tokenizers").Tokenizer.from_str(
        _tokenizer_json()), bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    fast.save_pretrained(tmp_path / "tok")
    tok = hf.Tokenizer(str(tmp_path / "tok"))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id)
    assert tok.encode("hello world be") == fast("hello world be")["input_ids"]


@pytest.mark.slow
def test_fedavg_trains_a_pretrained_model_on_shifted_labels(tmp_path):
    """The engine takes `model_from_hf` as any Model: FedAvg rounds on four clients' token rows
    (labels from `shifted_labels`, so num_classes = vocab + 1); each client's evaluated count is
    its scored next tokens, counted by hand, and the mean test loss falls."""
    from fedjax_pfl import algorithms
    from fedjax_pfl.data.federated import FederatedData
    from fedjax_pfl.data.natural import Task

    model = hf.model_from_hf(str(write_folder(tmp_path / "g", GPT2, gpt2_weights(GPT2, np.random.default_rng(0)))))
    v, t = GPT2["vocab_size"], 8
    rng = np.random.default_rng(1)
    train, test = np.array([5, 3, 4, 6]), np.array([2, 2, 1, 3])
    n = int(train.sum() + test.sum())
    x = rng.integers(0, v, (n, t)).astype(np.int32)
    scored = np.arange(t)[None] < rng.integers(2, t + 1, n)[:, None]     # right padding
    task = Task(kind="sequence", inputs="tokens", num_classes=v + 1, vocab_size=v)
    data = FederatedData.from_blocks(x, hf.shifted_labels(x, scored), train, test, num_classes=v + 1,
                                     name="tokens", task=task)
    algo = algorithms.get("fedavg", model=model, participation=1.0, batch_size=2, lr=0.05, local_epochs=1)
    state = algo.init(jax.random.key(0), data)
    before = algo.evaluate(state, data)["client"]
    round_fn = jax.jit(algo.round_fn)
    for r in range(3):
        state, metrics = round_fn(state, data, jax.random.key(r))
        assert np.isfinite(np.asarray(metrics["train_loss"])).all()
    after = algo.evaluate(state, data)["client"]
    test_rows = np.split(scored[train.sum():], np.cumsum(test)[:-1])
    want = [rows[:, 1:].sum() for rows in test_rows]          # position t scores token t + 1
    np.testing.assert_array_equal(after.count, want)
    assert np.mean(after.loss) < np.mean(before.loss)
