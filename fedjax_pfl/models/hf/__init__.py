"""Pretrained decoders from local folders in the Hugging Face layout (nothing is downloaded).

A folder holds `config.json`, `model.safetensors` (or shards listed by
`model.safetensors.index.json`) and, for text, `tokenizer.json`. Supported `model_type`s:
"llama" (SmolLM2, TinyLlama, Llama 2 and 3.x: models/hf/llama.py) and "gpt2"
(models/hf/gpt2.py). Our own flax modules, whose parameter paths mirror HF's tensor names
(models/hf/names.py), so that adapters on their Dense layers export under PEFT's names.

    decoder, params = hf.load("/models/SmolLM2-135M")           # float32; dtype="bfloat16"
    logits = decoder.apply(params, token_ids)                    # [B, T] int32 -> [B, T, V]
    model = hf.model_from_hf("/models/SmolLM2-135M")             # a models.Model for the engine
    tok = hf.Tokenizer("/models/SmolLM2-135M")                   # encode / decode, special ids

`model_from_hf` is what the command line's `--model hf:PATH` calls. A missing or inconsistent
file raises `PretrainedError` (`PretrainedNotFoundError` for a missing one): one line naming
the file, and the tensor or key at fault. docs/pretrained.md has the details.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from fedjax_pfl.errors import OptionError, arg
from fedjax_pfl.models.hf import names
from fedjax_pfl.models.hf.config import (
    MODEL_TYPES,
    GPT2Config,
    LlamaConfig,
    PretrainedError,
    PretrainedNotFoundError,
    config_from_dict,
    read_config,
)
from fedjax_pfl.models.hf.gpt2 import GPT2LMHeadModel
from fedjax_pfl.models.hf.llama import LlamaForCausalLM
from fedjax_pfl.models.hf.names import flax_path, from_hf, hf_name, is_transposed, to_hf
from fedjax_pfl.models.hf.task import (
    shifted_labels,
    shifted_sequence_loss,
    shifted_sequence_metric,
    shifted_sequence_weight,
)
from fedjax_pfl.models.hf.tokenizer import Tokenizer
from fedjax_pfl.models.model import Model

__all__ = ["DTYPES", "Decoder", "load", "model_from_hf", "decoder", "decoder_from_config", "Tokenizer",
           "PretrainedError", "PretrainedNotFoundError", "LlamaConfig", "GPT2Config", "MODEL_TYPES",
           "read_config", "config_from_dict", "LlamaForCausalLM", "GPT2LMHeadModel", "hf_name",
           "flax_path", "from_hf", "to_hf",
           "is_transposed", "shifted_labels", "shifted_sequence_loss", "shifted_sequence_weight",
           "shifted_sequence_metric", "names"]

Params = Any
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


class Decoder(NamedTuple):
    """A loaded decoder: its flax module (submodules named as HF's), settings and folder.

    `apply(params, tokens, mask=None)`: logits [B, T, vocab] float32 of token ids [B, T];
    `hidden`: the final normalised hidden states [B, T, D] (the lm_head's input).
    """

    module: LlamaForCausalLM | GPT2LMHeadModel
    config: LlamaConfig | GPT2Config
    path: str
    dtype: str

    @property
    def model_type(self) -> str:
        return self.config.model_type

    def apply(self, params: Params, tokens: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        return self.module.apply({"params": params}, tokens, mask)

    def hidden(self, params: Params, tokens: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        return self.module.apply({"params": params}, tokens, mask, method="hidden")

    def logits_and_hidden(self, params: Params, tokens: jax.Array, mask: jax.Array | None = None
                          ) -> tuple[jax.Array, jax.Array]:
        return self.module.apply({"params": params}, tokens, mask, method="logits_and_hidden")

    def param_shapes(self) -> Params:
        """The module's parameter tree as `jax.ShapeDtypeStruct`s (no weights read)."""
        tokens = jnp.zeros((1, 1), jnp.int32)
        return jax.eval_shape(self.module.init, jax.random.key(0), tokens)["params"]


def _check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise OptionError(f"{arg('dtype', 'model')} must be one of {list(DTYPES)}, got {dtype!r}")
    return dtype


def decoder(path: str, dtype: str = "float32") -> Decoder:
    """The `Decoder` of folder `path` from its config.json alone (no weights read)."""
    _check_dtype(dtype)
    return decoder_from_config(read_config(path), dtype, path=path)


def decoder_from_config(config: LlamaConfig | GPT2Config | dict, dtype: str = "float32", *,
                        path: str = "") -> Decoder:
    """The `Decoder` of a config (ours, or a config.json's contents as a dict); no weights.
    Its `module.init(key, tokens)` gives flax's random initialisation (tests, from scratch)."""
    dtype = _check_dtype(dtype)
    if isinstance(config, dict):
        config = config_from_dict(config)
    jdtype = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    module: LlamaForCausalLM | GPT2LMHeadModel
    if isinstance(config, GPT2Config):
        module = GPT2LMHeadModel(config, jdtype)
    else:
        module = LlamaForCausalLM(config, jdtype)
    return Decoder(module, config, str(path), dtype)


def load(path: str, dtype: str = "float32") -> tuple[Decoder, Params]:
    """The decoder of folder `path` and its weights.

    Args:
      path: a local folder with config.json and model.safetensors (or model.safetensors.index.json
        and its shards).
      dtype: "float32" or "bfloat16": the parameters' dtype and the computation's (softmax, norms'
        statistics and the logits in float32 either way).
    Returns:
      (decoder, params): `decoder.apply(params, token_ids [B, T] int32)` gives logits
      [B, T, vocab]; params is flax's parameter tree (jax arrays of `dtype`), paths as HF's names
      (`names.hf_name`).
    Raises:
      PretrainedNotFoundError: the folder, config.json, the weights or a shard is missing.
      PretrainedError: unknown model_type, a bad config key, a missing or unexpected tensor, a
        tensor of the wrong shape (each one line naming the file).
      OptionError: dtype is not one of `DTYPES`.
    """
    from fedjax_pfl.models.hf.weights import read_params

    dec = decoder(path, dtype)
    params = read_params(dec.path, dec.param_shapes(), dec.model_type, DTYPES[dtype],
                         tied=dec.config.tie_word_embeddings)
    return dec, jax.tree.map(jnp.asarray, params)


def model_from_hf(path: str, *, dtype: str = "float32", name: str | None = None) -> Model:
    """The pretrained decoder of folder `path` as the engine's `Model` (what `--model hf:PATH`
    calls): init returns the loaded params (whatever the key), apply gives logits [B, T, vocab],
    and loss / weight / metric are the next-token task of `models.hf.task` (labels: next id + 1,
    0 = not scored); features is the lm_head's input [B, T, D].
    """
    dec, params = load(path, dtype)

    def init(key: jax.Array) -> Params:
        del key                   # pretrained: every seed starts from the same weights
        return params

    def apply(p: Params, x: jax.Array) -> jax.Array:
        return dec.apply(p, x)

    def features(p: Params, x: jax.Array) -> jax.Array:
        return dec.hidden(p, x)

    features.with_outputs = dec.logits_and_hidden   # type: ignore[attr-defined]
    return Model(init=init, apply=apply, loss=shifted_sequence_loss, name=name or f"hf:{path}",
                 weight=shifted_sequence_weight, metric=shifted_sequence_metric, features=features)
