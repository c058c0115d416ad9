"""Random pretrained folders in the Hugging Face layout (config.json, safetensors) for tests."""

import json

import numpy as np
from safetensors.numpy import save_file


def llama_weights(cfg, rng, scale=0.3):
    """Random tensors with HF's names and shapes (nn.Linear weight [out, in])."""
    dm, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim", dm // heads)
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], dm), "model.norm.weight": (dm,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (dm,), p + "post_attention_layernorm.weight": (dm,),
                       p + "self_attn.q_proj.weight": (heads * d, dm), p + "self_attn.k_proj.weight": (kv * d, dm),
                       p + "self_attn.v_proj.weight": (kv * d, dm), p + "self_attn.o_proj.weight": (dm, heads * d),
                       p + "mlp.gate_proj.weight": (inter, dm), p + "mlp.up_proj.weight": (inter, dm),
                       p + "mlp.down_proj.weight": (dm, inter)})
        if cfg.get("attention_bias"):
            shapes.update({p + "self_attn.q_proj.bias": (heads * d,), p + "self_attn.k_proj.bias": (kv * d,),
                           p + "self_attn.v_proj.bias": (kv * d,), p + "self_attn.o_proj.bias": (dm,)})
        if cfg.get("mlp_bias"):
            shapes.update({p + "mlp.gate_proj.bias": (inter,), p + "mlp.up_proj.bias": (inter,),
                           p + "mlp.down_proj.bias": (dm,)})
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (cfg["vocab_size"], dm)
    w = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            w[name] = (1 + 0.2 * rng.normal(size=shape)).astype(np.float32)
        else:
            w[name] = (scale * rng.normal(size=shape)).astype(np.float32)
    return w


def gpt2_weights(cfg, rng, prefix="transformer.", scale=0.3):
    """Random tensors with HF's names and shapes (Conv1D weight [in, out])."""
    dm, inner = cfg["n_embd"], cfg.get("n_inner") or 4 * cfg["n_embd"]
    shapes = {prefix + "wte.weight": (cfg["vocab_size"], dm), prefix + "wpe.weight": (cfg["n_positions"], dm),
              prefix + "ln_f.weight": (dm,), prefix + "ln_f.bias": (dm,)}
    for i in range(cfg["n_layer"]):
        p = f"{prefix}h.{i}."
        shapes.update({p + "ln_1.weight": (dm,), p + "ln_1.bias": (dm,), p + "ln_2.weight": (dm,),
                       p + "ln_2.bias": (dm,), p + "attn.c_attn.weight": (dm, 3 * dm),
                       p + "attn.c_attn.bias": (3 * dm,), p + "attn.c_proj.weight": (dm, dm),
                       p + "attn.c_proj.bias": (dm,), p + "mlp.c_fc.weight": (dm, inner),
                       p + "mlp.c_fc.bias": (inner,), p + "mlp.c_proj.weight": (inner, dm),
                       p + "mlp.c_proj.bias": (dm,)})
    if cfg.get("tie_word_embeddings") is False:
        shapes["lm_head.weight"] = (cfg["vocab_size"], dm)
    w = {}
    for name, shape in shapes.items():
        base = 1.0 if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) else 0.0
        w[name] = (base + scale * rng.normal(size=shape)).astype(np.float32)
    return w


def write_folder(folder, cfg, weights, shards=1, extra_files=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    names = sorted(weights)
    if shards == 1:
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for s in range(shards):
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: weights[n] for n in names[s::shards]}
            save_file(part, str(folder / file), metadata={"format": "pt"})
            weight_map.update({n: file for n in part})
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    for file, text in (extra_files or {}).items():
        (folder / file).write_text(text)
    return folder
