"""The Llama family's decoder (`transformers`' `LlamaForCausalLM`) as flax linen modules whose
submodules carry HF's names (models/hf/names.py).

    h⁰ = E[x]                                          embed_tokens
    a  = h + o_proj(Attn(RoPE(q_proj(n)), RoPE(k_proj(n)), v_proj(n))),  n = RMSNorm₁(h)
    h' = a + down_proj(SiLU(gate_proj(m)) ⊙ up_proj(m)),                 m = RMSNorm₂(a)
    logits = lm_head(RMSNorm(h^L))   (or RMSNorm(h^L) Eᵀ with tie_word_embeddings)

RMSNorm(x) = w ⊙ x / √(mean(x²) + ε) (Zhang & Sennrich 2019; ε = rms_norm_eps). Rotary
embeddings (Su et al. 2021, RoFormer) in HF's "rotate half" layout: for position p and
j < d/2, (x_j, x_{j+d/2}) is rotated by the angle p·ω_j (`config.rope_frequencies`, with
rope_theta and rope_scaling). Grouped-query attention (Ainslie et al. 2023): H query heads share
K key/value heads, query head h reading key/value head ⌊h / (H/K)⌋ (HF's `repeat_kv`).
Attention is causal, softmax(q kᵀ/√d) in float32.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfl.models.hf.config import LlamaConfig, rope_frequencies

__all__ = ["LlamaForCausalLM", "rotate_half", "apply_rope", "causal_attention"]


def rotate_half(x: jax.Array) -> jax.Array:
    """(x₁, x₂) → (−x₂, x₁) on the halves of the last axis (HF's `rotate_half`)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """x ⊙ cos θ + rotate_half(x) ⊙ sin θ with θ_{p, j} = θ_{p, j + d/2} = p·ω_j.

    Args:
      x: [B, T, heads, d].
      positions: [T] (or [B, T]) integer positions.
      inv_freq: [d/2] float32 ω.
    """
    angles = positions[..., None].astype(jnp.float32) * inv_freq              # [.., T, d/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[..., None, :]          # [.., T, 1, d]
    xf = x.astype(jnp.float32)
    return (xf * jnp.cos(angles) + rotate_half(xf) * jnp.sin(angles)).astype(x.dtype)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float,
                     mask: jax.Array | None = None) -> jax.Array:
    """softmax(q kᵀ · scale + causal (and padding) mask) v, grouped-query.

    Args:
      q: [B, T, H, d]; k, v: [B, T, K, d] with H a multiple of K: query head h reads key/value
        head h // (H/K).
      scale: the factor of the scores (1/√d).
      mask: optional [B, T] bool, False for padding keys. A query always sees itself, so no
        softmax row is empty (a padding query's output is garbage and must not be scored).
    Returns:
      [B, T, H, d] in q's dtype; scores and softmax in float32.
    """
    b, t, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    qg = q.reshape(b, t, kv, g, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32) * scale
    allowed = jnp.tril(jnp.ones((t, t), bool))
    if mask is not None:
        allowed = allowed & mask[:, None, None, None, :].astype(bool) | jnp.eye(t, dtype=bool)
    scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
    return out.reshape(b, t, h, d)


class _Attention(nn.Module):
    config: LlamaConfig
    dtype: Any = jnp.float32

    def setup(self):
        c = self.config
        dense = lambda n, name: nn.Dense(n, use_bias=c.attention_bias, name=name, dtype=self.dtype,
                                         param_dtype=self.dtype)
        self.q_proj = dense(c.num_attention_heads * c.head_dim, "q_proj")
        self.k_proj = dense(c.num_key_value_heads * c.head_dim, "k_proj")
        self.v_proj = dense(c.num_key_value_heads * c.head_dim, "v_proj")
        self.o_proj = dense(c.hidden_size, "o_proj")

    def __call__(self, x: jax.Array, inv_freq: jax.Array, mask: jax.Array | None) -> jax.Array:
        c = self.config
        b, t, _ = x.shape
        positions = jnp.arange(t)
        q = self.q_proj(x).reshape(b, t, c.num_attention_heads, c.head_dim)
        k = self.k_proj(x).reshape(b, t, c.num_key_value_heads, c.head_dim)
        v = self.v_proj(x).reshape(b, t, c.num_key_value_heads, c.head_dim)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        out = causal_attention(q, k, v, c.head_dim ** -0.5, mask)
        return self.o_proj(out.reshape(b, t, c.num_attention_heads * c.head_dim))


class _MLP(nn.Module):
    config: LlamaConfig
    dtype: Any = jnp.float32

    def setup(self):
        c = self.config
        dense = lambda n, name: nn.Dense(n, use_bias=c.mlp_bias, name=name, dtype=self.dtype,
                                         param_dtype=self.dtype)
        self.gate_proj = dense(c.intermediate_size, "gate_proj")
        self.up_proj = dense(c.intermediate_size, "up_proj")
        self.down_proj = dense(c.hidden_size, "down_proj")

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


def _rms_norm(config: LlamaConfig, dtype: Any, name: str) -> nn.RMSNorm:
    # Statistics in float32 (flax promotes), as HF's LlamaRMSNorm computes them.
    return nn.RMSNorm(epsilon=config.rms_norm_eps, dtype=dtype, param_dtype=dtype, name=name)


class _DecoderLayer(nn.Module):
    config: LlamaConfig
    dtype: Any = jnp.float32

    def setup(self):
        self.input_layernorm = _rms_norm(self.config, self.dtype, "input_layernorm")
        self.self_attn = _Attention(self.config, self.dtype, name="self_attn")
        self.post_attention_layernorm = _rms_norm(self.config, self.dtype, "post_attention_layernorm")
        self.mlp = _MLP(self.config, self.dtype, name="mlp")

    def __call__(self, h: jax.Array, inv_freq: jax.Array, mask: jax.Array | None) -> jax.Array:
        h = h + self.self_attn(self.input_layernorm(h), inv_freq, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class _LlamaModel(nn.Module):
    """HF's `LlamaModel` (the `model.` prefix of every tensor but lm_head)."""

    config: LlamaConfig
    dtype: Any = jnp.float32

    def setup(self):
        c = self.config
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype,
                                     param_dtype=self.dtype, name="embed_tokens")
        self.layers = [_DecoderLayer(c, self.dtype) for _ in range(c.num_hidden_layers)]
        self.norm = _rms_norm(c, self.dtype, "norm")

    def __call__(self, tokens: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        c = self.config
        inv_freq = jnp.asarray(np.asarray(rope_frequencies(c.head_dim, c.rope_theta, c.scaling),
                                          np.float32))
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = layer(h, inv_freq, mask)
        return self.norm(h)

    def logits_tied(self, h: jax.Array) -> jax.Array:
        return self.embed_tokens.attend(h)


class LlamaForCausalLM(nn.Module):
    """Logits [B, T, vocab] (float32) of token ids [B, T]; `mask` [B, T] (optional, True for real
    tokens) hides padding keys. Positions are 0..T−1 in every row: pad on the right (our token
    tasks do), where the causal mask already keeps real tokens from reading padding.

    `hidden` gives the final normalised hidden states [B, T, D], the head's input.
    """

    config: LlamaConfig
    dtype: Any = jnp.float32

    def setup(self):
        self.model = _LlamaModel(self.config, self.dtype, name="model")
        if not self.config.tie_word_embeddings:
            self.lm_head = nn.Dense(self.config.vocab_size, use_bias=False, dtype=self.dtype,
                                    param_dtype=self.dtype, name="lm_head")

    def hidden(self, tokens: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        return self.model(jnp.asarray(tokens).astype(jnp.int32), mask)

    def logits_and_hidden(self, tokens: jax.Array, mask: jax.Array | None = None
                          ) -> tuple[jax.Array, jax.Array]:
        h = self.hidden(tokens, mask)
        logits = self.model.logits_tied(h) if self.config.tie_word_embeddings else self.lm_head(h)
        return logits.astype(jnp.float32), h

    def __call__(self, tokens: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        return self.logits_and_hidden(tokens, mask)[0]
