"""GPT-2 (`transformers`' `GPT2LMHeadModel`; Radford et al. 2019) as flax linen modules whose
submodules carry HF's names (models/hf/names.py).

    h⁰ = wte[x] + wpe[0..T−1]                          learned positions
    a  = h + c_proj(Attn(split₃(c_attn(LN₁(h)))))      fused q|k|v projection [D, 3D]
    h' = a + mlp.c_proj(GELU(c_fc(LN₂(a))))
    logits = LN_f(h^L) wteᵀ                            (lm_head with tie_word_embeddings false)

LayerNorm(x) = γ ⊙ (x − μ)/√(σ² + ε) + β with ε = layer_norm_epsilon. GELU is the tanh
approximation 0.5x(1 + tanh(√(2/π)(x + 0.044715x³))) for gelu_new / gelu_pytorch_tanh /
gelu_fast, the exact x·Φ(x) for gelu. Scores q kᵀ/√d (scale_attn_weights), divided again by
layer index + 1 with scale_attn_by_inverse_layer_idx. HF's Conv1D keeps weight [in, out], our
Dense kernel as is.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_pfl.models.hf.config import GPT2Config
from fedjax_pfl.models.hf.llama import causal_attention

__all__ = ["GPT2LMHeadModel"]


def _dense(n: int, name: str, dtype: Any) -> nn.Dense:
    return nn.Dense(n, name=name, dtype=dtype, param_dtype=dtype)


def _layer_norm(config: GPT2Config, dtype: Any, name: str) -> nn.LayerNorm:
    # Two-pass variance (E[(x − μ)²]), as torch's LayerNorm; statistics in float32.
    return nn.LayerNorm(epsilon=config.layer_norm_epsilon, use_fast_variance=False, dtype=dtype,
                        param_dtype=dtype, name=name)


class _Attention(nn.Module):
    config: GPT2Config
    layer_idx: int
    dtype: Any = jnp.float32

    def setup(self):
        d = self.config.n_embd
        self.c_attn = _dense(3 * d, "c_attn", self.dtype)
        self.c_proj = _dense(d, "c_proj", self.dtype)

    def __call__(self, x: jax.Array, mask: jax.Array | None) -> jax.Array:
        c = self.config
        b, t, d = x.shape
        hd = d // c.n_head
        q, k, v = (y.reshape(b, t, c.n_head, hd) for y in jnp.split(self.c_attn(x), 3, axis=-1))
        scale = hd ** -0.5 if c.scale_attn_weights else 1.0
        if c.scale_attn_by_inverse_layer_idx:
            scale /= self.layer_idx + 1
        return self.c_proj(causal_attention(q, k, v, scale, mask).reshape(b, t, d))


class _MLP(nn.Module):
    config: GPT2Config
    dtype: Any = jnp.float32

    def setup(self):
        self.c_fc = _dense(self.config.n_inner, "c_fc", self.dtype)
        self.c_proj = _dense(self.config.n_embd, "c_proj", self.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        approximate = self.config.activation_function != "gelu"
        return self.c_proj(nn.gelu(self.c_fc(x), approximate=approximate))


class _Block(nn.Module):
    config: GPT2Config
    layer_idx: int
    dtype: Any = jnp.float32

    def setup(self):
        self.ln_1 = _layer_norm(self.config, self.dtype, "ln_1")
        self.attn = _Attention(self.config, self.layer_idx, self.dtype, name="attn")
        self.ln_2 = _layer_norm(self.config, self.dtype, "ln_2")
        self.mlp = _MLP(self.config, self.dtype, name="mlp")

    def __call__(self, h: jax.Array, mask: jax.Array | None) -> jax.Array:
        h = h + self.attn(self.ln_1(h), mask)
        return h + self.mlp(self.ln_2(h))


class _GPT2Model(nn.Module):
    """HF's `GPT2Model` (the `transformer.` prefix)."""

    config: GPT2Config
    dtype: Any = jnp.float32

    def setup(self):
        c = self.config
        self.wte = nn.Embed(c.vocab_size, c.n_embd, dtype=self.dtype, param_dtype=self.dtype, name="wte")
        self.wpe = nn.Embed(c.n_positions, c.n_embd, dtype=self.dtype, param_dtype=self.dtype, name="wpe")
        self.h = [_Block(c, i, self.dtype) for i in range(c.n_layer)]
        self.ln_f = _layer_norm(c, self.dtype, "ln_f")

    def __call__(self, tokens: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        t = tokens.shape[-1]
        if t > self.config.n_positions:
            raise ValueError(f"GPT-2 has {self.config.n_positions} positions (n_positions); got "
                             f"sequences of {t} tokens")
        h = self.wte(tokens) + self.wpe(jnp.arange(t))
        for block in self.h:
            h = block(h, mask)
        return self.ln_f(h)

    def logits_tied(self, h: jax.Array) -> jax.Array:
        return self.wte.attend(h)


class GPT2LMHeadModel(nn.Module):
    """Logits [B, T, vocab] (float32) of token ids [B, T], T ≤ n_positions; `mask` [B, T]
    (optional, True for real tokens) hides padding keys. `hidden`: LN_f's output [B, T, D]."""

    config: GPT2Config
    dtype: Any = jnp.float32

    def setup(self):
        self.transformer = _GPT2Model(self.config, self.dtype, name="transformer")
        if not self.config.tie_word_embeddings:
            self.lm_head = nn.Dense(self.config.vocab_size, use_bias=False, dtype=self.dtype,
                                    param_dtype=self.dtype, name="lm_head")

    def hidden(self, tokens: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        return self.transformer(jnp.asarray(tokens).astype(jnp.int32), mask)

    def logits_and_hidden(self, tokens: jax.Array, mask: jax.Array | None = None
                          ) -> tuple[jax.Array, jax.Array]:
        h = self.hidden(tokens, mask)
        logits = (self.transformer.logits_tied(h) if self.config.tie_word_embeddings
                  else self.lm_head(h))
        return logits.astype(jnp.float32), h

    def __call__(self, tokens: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        return self.logits_and_hidden(tokens, mask)[0]
