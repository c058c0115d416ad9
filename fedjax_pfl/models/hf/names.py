"""The one mapping between our parameter paths and Hugging Face's tensor names.

Our decoders name every submodule as `transformers` does, so a parameter's path mirrors its
HF key: a list index `layers.0` is the flax submodule `layers_0` (what flax names the items of
a list assigned in `setup`), and the leaf is flax's name for the same tensor:

    ours (path in the params tree)              HF (safetensors key)                      layout
    model/embed_tokens/embedding   [V, D]      model.embed_tokens.weight        [V, D]   as is
    model/layers_0/self_attn/q_proj/kernel     model.layers.0.self_attn.q_proj.weight    transposed
                                   [D, H·hd]                                    [H·hd, D]
    model/layers_0/self_attn/q_proj/bias       model.layers.0.self_attn.q_proj.bias      as is
    model/layers_0/input_layernorm/scale       model.layers.0.input_layernorm.weight     as is
    lm_head/kernel                 [D, V]      lm_head.weight                   [V, D]   transposed
    transformer/h_0/attn/c_attn/kernel [D, 3D] transformer.h.0.attn.c_attn.weight [D, 3D] as is
    transformer/h_0/ln_1/scale, .../bias       transformer.h.0.ln_1.weight, .bias        as is
    transformer/wte/embedding      [V, D]      transformer.wte.weight           [V, D]   as is

Every linear layer is a `flax.linen.Dense` (kernel [in, out]). PyTorch's `nn.Linear` (the
Llama family's projections, and GPT-2's untied `lm_head`) stores weight [out, in]: the kernel is
its transpose. GPT-2's `Conv1D` (c_attn, c_proj, c_fc) stores weight [in, out] already, the
kernel as is. `hf_name` works on module paths too (`model/layers_0/self_attn/q_proj` →
`model.layers.0.self_attn.q_proj`), which is what a PEFT export prefixes with `base_model.model.`
(e.g. `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`).

GPT-2 checkpoints saved from `GPT2Model` (openai-community/gpt2 itself) have no `transformer.`
prefix (`h.0.attn.c_attn.weight`); `flax_path` accepts both spellings and `hf_name` writes the
`GPT2LMHeadModel` one, which PEFT's names use.
"""

from __future__ import annotations

import re

import numpy as np

__all__ = ["hf_name", "flax_path", "to_hf", "from_hf", "is_transposed"]

# flax leaf name -> HF leaf name.
_LEAF_TO_HF = {"kernel": "weight", "embedding": "weight", "scale": "weight", "bias": "bias"}
_LIST_MODULES = ("layers", "h")                       # Llama's decoder layers, GPT-2's blocks
_EMBEDDINGS = ("embed_tokens", "wte", "wpe")
_GPT2_CONV1D = ("c_attn", "c_proj", "c_fc")


def _is_norm(module: str) -> bool:
    # input_layernorm, post_attention_layernorm, norm (Llama); ln_1, ln_2, ln_f (GPT-2).
    return module.endswith("norm") or module.startswith("ln_")


def hf_name(path: str) -> str:
    """The HF name of a parameter path or module path of our decoders ('/'-separated).

    `model/layers_3/mlp/down_proj/kernel` → `model.layers.3.mlp.down_proj.weight`;
    `model/layers_3/mlp/down_proj` → `model.layers.3.mlp.down_proj`.
    """
    parts = path.strip("/").split("/")
    out = []
    for i, part in enumerate(parts):
        match = re.fullmatch(r"(\w+?)_(\d+)", part)
        if match and match.group(1) in _LIST_MODULES:
            out += [match.group(1), match.group(2)]
        elif i == len(parts) - 1 and part in _LEAF_TO_HF and i > 0:
            out.append(_LEAF_TO_HF[part])
        else:
            out.append(part)
    return ".".join(out)


def flax_path(name: str) -> str:
    """The parameter path of a HF tensor name (the inverse of `hf_name` on parameters):
    `model.layers.0.self_attn.q_proj.weight` → `model/layers_0/self_attn/q_proj/kernel`. A GPT-2
    name without its `transformer.` prefix gets it (`h.0.ln_1.bias` → `transformer/h_0/ln_1/bias`).
    """
    parts = name.split(".")
    if parts[0] in ("h", "wte", "wpe", "ln_f"):
        parts = ["transformer", *parts]
    out: list[str] = []
    i = 0
    while i < len(parts):
        part = parts[i]
        if part in _LIST_MODULES and i + 1 < len(parts) and parts[i + 1].isdigit():
            out.append(f"{part}_{parts[i + 1]}")
            i += 2
            continue
        out.append(part)
        i += 1
    leaf, module = out[-1], out[-2] if len(out) > 1 else ""
    if leaf == "weight":
        if module in _EMBEDDINGS:
            out[-1] = "embedding"
        elif _is_norm(module):
            out[-1] = "scale"
        else:
            out[-1] = "kernel"
    return "/".join(out)


def is_transposed(path: str, model_type: str) -> bool:
    """Whether the HF tensor of parameter `path` is the transpose of ours: a `nn.Linear` weight
    [out, in] (every Llama projection; GPT-2's lm_head), not GPT-2's `Conv1D` [in, out]."""
    if not path.endswith("/kernel"):
        return False
    module = path.split("/")[-2]
    return not (model_type == "gpt2" and module in _GPT2_CONV1D)


def from_hf(path: str, tensor: np.ndarray, model_type: str) -> np.ndarray:
    """HF's tensor (as read from safetensors) laid out as our parameter `path`."""
    return tensor.T if is_transposed(path, model_type) else tensor


def to_hf(path: str, array: np.ndarray, model_type: str) -> np.ndarray:
    """Our parameter `path`'s array laid out as HF stores it (for exports)."""
    array = np.asarray(array)
    return array.T if is_transposed(path, model_type) else array
