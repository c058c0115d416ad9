"""Reading a folder's safetensors into our decoders' parameter tree.

One file (`model.safetensors`) or shards listed by `model.safetensors.index.json`
(`{"weight_map": {tensor name: shard file}}`). Every tensor the module needs is looked up by
its HF name (`names.hf_name`), checked against the module's own shape (from `jax.eval_shape`
of its init, laid out as HF stores it) before it is read, transposed where HF's layout is the
transpose of ours (`names.from_hf`) and cast to the requested dtype (bfloat16 through
`ml_dtypes`; BF16, F16 and F32 files all load). A tensor the module does not have is an error,
except the buffers `transformers` writes beside the weights (rotary `inv_freq`, GPT-2's
`attn.bias` / `attn.masked_bias` causal masks) and a tied checkpoint's redundant `lm_head.weight`.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping

import numpy as np

from fedjax_pfl.models.hf import names
from fedjax_pfl.models.hf.config import PretrainedError, PretrainedNotFoundError, where

__all__ = ["SINGLE_FILE", "INDEX_FILE", "tensor_files", "read_params"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_BUFFERS = re.compile(r"(^|\.)(rotary_emb\.inv_freq|attn\.bias|attn\.masked_bias)$")


def tensor_files(path: str) -> dict[str, str]:
    """HF tensor name -> the safetensors file (inside `path`) that holds it."""
    from safetensors import safe_open

    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
        except (OSError, ValueError, AttributeError) as e:
            raise PretrainedError(f"{where(path, INDEX_FILE)} is not readable JSON "
                                  f"({type(e).__name__})") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise PretrainedError(f"{where(path, INDEX_FILE)} has no 'weight_map' object")
        for shard in sorted(set(weight_map.values())):
            if not os.path.isfile(os.path.join(path, shard)):
                raise PretrainedNotFoundError(f"{where(path, shard)} is missing (a shard that "
                                              f"{INDEX_FILE} lists)")
        return dict(weight_map)
    single = os.path.join(path, SINGLE_FILE)
    if not os.path.isfile(single):
        if not os.path.isdir(path):
            raise PretrainedNotFoundError(f"{where(path)}: no such folder")
        others = [f for f in ("pytorch_model.bin", "model.bin", "tf_model.h5", "flax_model.msgpack")
                  if os.path.isfile(os.path.join(path, f))]
        hint = (f" ({others[0]} is not read: convert it to safetensors)" if others else "")
        raise PretrainedNotFoundError(f"{where(path)}: neither {SINGLE_FILE} nor {INDEX_FILE} is "
                                      f"there{hint}")
    try:
        with safe_open(single, framework="numpy") as f:
            keys = list(f.keys())
    except Exception as e:       # safetensors raises its own SafetensorError, or OSError
        raise PretrainedError(f"{where(path, SINGLE_FILE)} is not a readable safetensors file "
                              f"({type(e).__name__})") from None
    return {k: SINGLE_FILE for k in keys}


def _flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(_flatten(value, path))
        else:
            out[path] = value
    return out


def _unflatten(flat: Mapping[str, Any]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def _hf_spelling(name: str, available: Mapping[str, str]) -> str | None:
    """The spelling of HF name `name` in the files: as is, or a GPT-2 name without its
    `transformer.` prefix (checkpoints saved from GPT2Model)."""
    if name in available:
        return name
    if name.startswith("transformer.") and name[len("transformer."):] in available:
        return name[len("transformer."):]
    return None


def read_params(path: str, shapes: Mapping, model_type: str, dtype: Any,
                tied: bool) -> dict:
    """The parameter tree shaped like `shapes` (a pytree of `ShapeDtypeStruct`, the module's
    `eval_shape`d init params) filled from the safetensors of folder `path`, as numpy arrays of
    `dtype`."""
    from safetensors import safe_open

    files = tensor_files(path)
    wanted = {p: s.shape for p, s in _flatten(shapes).items()}
    spelled = {}
    for p in sorted(wanted):
        name = names.hf_name(p)
        found = _hf_spelling(name, files)
        if found is None:
            raise PretrainedError(f"{where(path)}: missing tensor {name!r} (in none of "
                                  f"{', '.join(sorted(set(files.values())))})")
        spelled[p] = found
    used = set(spelled.values())
    for name in sorted(files):
        if name in used or _BUFFERS.search(name):
            continue
        if tied and name.split(".")[-2:] == ["lm_head", "weight"]:
            continue        # transformers ties it to the embedding and ignores the stored copy
        raise PretrainedError(f"{where(path, files[name])}: unexpected tensor {name!r} (not a "
                              f"parameter of this {model_type} config; check config.json)")
    by_file: dict[str, list[str]] = {}
    for p, name in spelled.items():
        by_file.setdefault(files[name], []).append(p)
    flat = {}
    for file, paths in sorted(by_file.items()):
        try:
            handle = safe_open(os.path.join(path, file), framework="numpy")
        except Exception as e:
            raise PretrainedError(f"{where(path, file)} is not a readable safetensors file "
                                  f"({type(e).__name__})") from None
        with handle as f:
            for p in paths:
                name = spelled[p]
                if name not in f.keys():
                    raise PretrainedError(f"{where(path, file)}: missing tensor {name!r} "
                                          f"({INDEX_FILE} puts it there)")
                stored = tuple(f.get_slice(name).get_shape())
                expected = tuple(wanted[p][::-1]) if names.is_transposed(p, model_type) else tuple(wanted[p])
                if stored != expected:
                    raise PretrainedError(f"{where(path, file)}: shape of {name!r} is "
                                          f"{list(stored)}, expected {list(expected)} from config.json")
                tensor = f.get_tensor(name)
                flat[p] = np.ascontiguousarray(names.from_hf(p, tensor, model_type)).astype(dtype)
    return _unflatten(flat)
