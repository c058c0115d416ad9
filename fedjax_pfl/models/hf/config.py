"""`config.json` of a Hugging Face folder, read into our decoders' settings, and the errors of a
folder that cannot be loaded.

Every message is one line that names the file (and the key or tensor) at fault; the folder is
marked as the argument `path` of the space "model" (`errors.arg("path", "model")`), which the
command line spells as its `--model hf:PATH` flag.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from fedjax_pfl.errors import MarkedError, arg

__all__ = ["PretrainedError", "PretrainedNotFoundError", "LlamaConfig", "GPT2Config", "MODEL_TYPES",
           "read_config", "config_from_dict", "rope_frequencies"]


class PretrainedError(MarkedError, ValueError):
    """A pretrained folder whose files are inconsistent (a missing tensor, a wrong shape, an
    unknown `model_type`): one line naming the file and what is wrong."""


class PretrainedNotFoundError(PretrainedError, FileNotFoundError):
    """A pretrained folder, or a file it needs, does not exist."""


def where(path: str, file: str = "") -> str:
    """`path` marked as the argument, with the file inside it: the start of every message."""
    return f"{arg('path', 'model')} {path}" + (f": {file}" if file else "")


# model_type -> the family our module implements.
MODEL_TYPES = {"llama": "llama", "gpt2": "gpt2"}
# What `transformers` names the same activations.
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The Llama family (`LlamaForCausalLM`: SmolLM2, TinyLlama, Llama 2/3.x). Fields are
    config.json's keys, with `transformers`' defaults where a key is absent."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # sorted items of the rope_scaling dict; () = none
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"

    @property
    def scaling(self) -> dict:
        return dict(self.rope_scaling)


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """GPT-2 (`GPT2LMHeadModel`). Fields are config.json's keys, `transformers`' defaults."""

    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    n_inner: int
    layer_norm_epsilon: float = 1e-5
    activation_function: str = "gelu_new"
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    tie_word_embeddings: bool = True
    model_type: str = "gpt2"


def _read_json(path: str, file: str, required: bool = True) -> dict | None:
    full = os.path.join(path, file)
    if not os.path.isfile(full):
        if not required:
            return None
        if not os.path.isdir(path):
            raise PretrainedNotFoundError(f"{where(path)}: no such folder")
        raise PretrainedNotFoundError(f"{where(path, file)} is missing")
    try:
        with open(full, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise PretrainedError(f"{where(path, file)} is not readable JSON ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(data, dict):
        raise PretrainedError(f"{where(path, file)} must hold a JSON object, got {type(data).__name__}")
    return data


def _get(cfg: dict, key: str, path: str, kind: type, default: Any = None, required: bool = False) -> Any:
    if key not in cfg or cfg[key] is None:
        if required:
            raise PretrainedError(f"{where(path, 'config.json')} has no {key!r}")
        return default
    value = cfg[key]
    ok = (isinstance(value, bool) if kind is bool else
          isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else
          isinstance(value, int) and not isinstance(value, bool) and value >= 1 if kind is int else
          isinstance(value, kind))
    if not ok:
        words = {int: "an integer >= 1", float: "a number", bool: "true or false", str: "a string",
                 dict: "an object"}[kind]
        raise PretrainedError(f"{where(path, 'config.json')}: {key!r} must be {words}, got {value!r}")
    return float(value) if kind is float else value


def _rope(cfg: dict, path: str) -> tuple[float, tuple[tuple[str, Any], ...]]:
    """rope_theta and rope_scaling, as transformers < 5 writes them (top-level keys) or as 5
    does (`rope_parameters` holding both)."""
    params = _get(cfg, "rope_parameters", path, dict, default=None)
    theta = _get(cfg, "rope_theta", path, float, default=10000.0)
    scaling = _get(cfg, "rope_scaling", path, dict, default=None)
    if params is not None:
        theta = float(params.get("rope_theta", theta))
        scaling = params
    if not scaling:
        return theta, ()
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise PretrainedError(f"{where(path, 'config.json')}: rope scaling type {kind!r} is not "
                              f"supported; expected one of {list(_ROPE_TYPES)}")
    need = {"default": (), "linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings")}[kind]
    for key in need:
        value = scaling.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise PretrainedError(f"{where(path, 'config.json')}: rope scaling {kind!r} needs a "
                                  f"positive {key!r}, got {value!r}")
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise PretrainedError(f"{where(path, 'config.json')}: rope scaling 'llama3' needs "
                              f"high_freq_factor > low_freq_factor, got {scaling['high_freq_factor']}"
                              f" and {scaling['low_freq_factor']}")
    if kind == "default":
        return theta, ()
    return theta, tuple(sorted([("rope_type", kind)] + [(k, float(scaling[k])) for k in need]))


def read_config(path: str) -> LlamaConfig | GPT2Config:
    """The decoder settings of the folder `path` (its config.json)."""
    cfg = _read_json(path, "config.json")
    assert cfg is not None
    return config_from_dict(cfg, path)


def config_from_dict(cfg: dict, path: str = "<config>") -> LlamaConfig | GPT2Config:
    """The decoder settings of a config.json's contents (`path` only names it in errors)."""
    model_type = cfg.get("model_type")
    if model_type not in MODEL_TYPES:
        raise PretrainedError(f"{where(path, 'config.json')}: unknown model_type {model_type!r}; "
                              f"supported: {', '.join(MODEL_TYPES)}")
    if model_type == "gpt2":
        return _gpt2(cfg, path)
    return _llama(cfg, path)


def _llama(cfg: dict, path: str) -> LlamaConfig:
    req = lambda key: _get(cfg, key, path, int, required=True)
    heads = req("num_attention_heads")
    hidden = req("hidden_size")
    kv_heads = _get(cfg, "num_key_value_heads", path, int, default=heads)
    if heads % kv_heads:
        raise PretrainedError(f"{where(path, 'config.json')}: num_attention_heads {heads} must be a "
                              f"multiple of num_key_value_heads {kv_heads}")
    if "head_dim" not in cfg and hidden % heads:
        raise PretrainedError(f"{where(path, 'config.json')}: hidden_size {hidden} must be a "
                              f"multiple of num_attention_heads {heads} (or give head_dim)")
    head_dim = _get(cfg, "head_dim", path, int, default=hidden // heads)
    if head_dim % 2:
        raise PretrainedError(f"{where(path, 'config.json')}: head_dim {head_dim} must be even "
                              "(rotary embeddings rotate pairs)")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise PretrainedError(f"{where(path, 'config.json')}: hidden_act {act!r} is not supported "
                              "for llama; expected 'silu'")
    theta, scaling = _rope(cfg, path)
    return LlamaConfig(
        vocab_size=req("vocab_size"), hidden_size=hidden, intermediate_size=req("intermediate_size"),
        num_hidden_layers=req("num_hidden_layers"), num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=_get(cfg, "rms_norm_eps", path, float, default=1e-6),
        rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=_get(cfg, "max_position_embeddings", path, int, default=2048),
        tie_word_embeddings=_get(cfg, "tie_word_embeddings", path, bool, default=False),
        attention_bias=_get(cfg, "attention_bias", path, bool, default=False),
        mlp_bias=_get(cfg, "mlp_bias", path, bool, default=False))


def _gpt2(cfg: dict, path: str) -> GPT2Config:
    req = lambda key: _get(cfg, key, path, int, required=True)
    n_embd, n_head = req("n_embd"), req("n_head")
    if n_embd % n_head:
        raise PretrainedError(f"{where(path, 'config.json')}: n_embd {n_embd} must be a multiple of "
                              f"n_head {n_head}")
    act = _get(cfg, "activation_function", path, str, default="gelu_new")
    if act not in (*_GELU_TANH, "gelu"):
        raise PretrainedError(f"{where(path, 'config.json')}: activation_function {act!r} is not "
                              f"supported; expected one of {[*_GELU_TANH, 'gelu']}")
    return GPT2Config(
        vocab_size=req("vocab_size"), n_positions=req("n_positions"), n_embd=n_embd,
        n_layer=req("n_layer"), n_head=n_head,
        n_inner=_get(cfg, "n_inner", path, int, default=4 * n_embd),
        layer_norm_epsilon=_get(cfg, "layer_norm_epsilon", path, float, default=1e-5),
        activation_function=act,
        scale_attn_weights=_get(cfg, "scale_attn_weights", path, bool, default=True),
        scale_attn_by_inverse_layer_idx=_get(cfg, "scale_attn_by_inverse_layer_idx", path, bool,
                                             default=False),
        tie_word_embeddings=_get(cfg, "tie_word_embeddings", path, bool, default=True))


def rope_frequencies(head_dim: int, theta: float, scaling: dict) -> list[float]:
    """The rotary inverse frequencies ω_j, j < head_dim/2 (as `transformers`' ROPE_INIT_FUNCTIONS).

    default: ω_j = θ^(−2j/d).
    linear:  ω_j / factor (positions divided by the factor: Chen et al. 2023, position interpolation).
    llama3:  with wavelength λ_j = 2π/ω_j, L the original context, lo/hi the low/high frequency
             factors: ω_j/factor where λ_j > L/lo (low frequencies); ω_j where λ_j < L/hi (high);
             between them (1 − s)·ω_j/factor + s·ω_j with s = (L/λ_j − lo)/(hi − lo) (Meta's
             Llama 3.1 reference, `apply_scaling`).
    Computed in float64 on the host; the module casts them to float32.
    """
    base = [theta ** (-(2 * j) / head_dim) for j in range(head_dim // 2)]
    kind = scaling.get("rope_type")
    if not kind:
        return base
    factor = scaling["factor"]
    if kind == "linear":
        return [w / factor for w in base]
    lo, hi, length = (scaling["low_freq_factor"], scaling["high_freq_factor"],
                      scaling["original_max_position_embeddings"])
    out = []
    for w in base:
        wavelen = 2 * math.pi / w
        if wavelen > length / lo:
            out.append(w / factor)
        elif wavelen < length / hi:
            out.append(w)
        else:
            s = (length / wavelen - lo) / (hi - lo)
            out.append((1 - s) * w / factor + s * w)
    return out
