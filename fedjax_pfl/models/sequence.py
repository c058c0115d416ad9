"""Sequence and text models for natural-client datasets: our LSTM, the published language models,
a small causal transformer, tag logistic regression and the Sent140 classifier.

Every module takes integer token ids x [B, L] (data/natural.py: 0 = PAD) and embeds them itself;
all are stateless (a 'params' collection only) and contain no Python loop over time, so the engine
vmaps them over clients like any other model. Inputs are cast to int32 inside, so a float array of
whole numbers (e.g. `model.from_flax`'s float32 zeros at init) also works.

Split-model algorithms (FedPer, FedRep, FedRoD, ...) take the last `Dense_<k>` module as the head
(models/split.py:head_pattern). Here that is always the output projection: every other submodule
has a name that is not Dense-like (`projection`, `fc`, `qkv`, ...), and the LSTM and bag-of-words
layers keep their parameters directly rather than in Dense submodules.

Sizes (tests/models/test_sequence.py checks each count):

* `CharLSTM`: FedJAX's `shakespeare.create_lstm_model` / TFF's Shakespeare model: Embed(V, 8),
  LSTM 256, LSTM 256, Dense(V). 820,522 parameters with V = 90 (86 characters + PAD/BOS/EOS/OOV),
  FedJAX's own test figure.
* `WordLSTM`: TFF's Stack Overflow next-word model (Reddi et al. 2021) / FedJAX's
  `stackoverflow.create_lstm_model`: Embed(V, 96), LSTM 670, Dense 96, Dense(V). 4,050,748
  parameters with V = 10,004 (10,000 words + PAD/BOS/EOS/OOV), FedJAX's test figure.
* `SentLSTM`: LEAF's sent140 `stacked_lstm.py`: Embed(V, 100), two LSTMs of 100, Dense 128,
  Dense 2.
* `TagLogReg`: TFF's tag-prediction logistic regression, Dense(num_tags) on the bag of words;
  5,000,500 parameters for 10,000 words and 500 tags.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_pfl.models import nets
from fedjax_pfl.models.layers import CONV_IMPLS, Dense
from fedjax_pfl.models.model import head_input
from fedjax_pfl.models.tasks import PAD, Task

__all__ = ["lstm_cell", "lstm_recurrence", "LSTMCell", "LSTM", "CharLSTM", "WordLSTM",
           "CausalTransformer", "TagLogReg", "SentLSTM", "SEQUENCE_MODELS", "FlaxFunctions",
           "from_flax_tokens", "get"]

Params = Any


def _forget_bias_init(forget_bias: float):
    """Bias init for the [i | f | g | o] layout: zeros, and `forget_bias` on the f block."""

    def init(key, shape, dtype=jnp.float32):
        hidden = shape[0] // 4
        return jnp.zeros(shape, dtype).at[hidden : 2 * hidden].set(forget_bias)

    return init


def lstm_cell(
    carry: tuple[jax.Array, jax.Array], x_proj: jax.Array, kernel_rec: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One LSTM step from the input's projection, the standard (Hochreiter–Schmidhuber with a
    forget gate, Gers et al. 2000) cell without peepholes, as Keras/TFF and haiku compute it:

        i  = σ(W_i x + U_i h + b_i)      input gate
        f  = σ(W_f x + U_f h + b_f)      forget gate
        g  = tanh(W_g x + U_g h + b_g)   candidate
        o  = σ(W_o x + U_o h + b_o)      output gate
        c' = f ⊙ c + i ⊙ g
        h' = o ⊙ tanh(c')

    Parameter layout: W = kernel_in [D, 4H], U = kernel_rec [H, 4H], b = bias [4H], the gate
    blocks along the last axis in the order [i | f | g | o] (each H wide). One bias per gate
    (Keras and haiku; PyTorch's nn.LSTM has two, b_ih + b_hh, which sum to this one).

    Args:
      carry: (c, h), each [..., H].
      x_proj: W x + b, [..., 4H] (computed for all timesteps at once by `LSTM`).
      kernel_rec: U, [H, 4H].
    Returns:
      (c', h').
    """
    c, h = carry
    z = x_proj + h @ kernel_rec
    i, f, g, o = jnp.split(z, 4, axis=-1)
    c_new = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    h_new = jax.nn.sigmoid(o) * jnp.tanh(c_new)
    return c_new, h_new


def _lstm_params(module: nn.Module, features: int, in_features: int, forget_bias: float):
    """The LSTM parameters (names and initialisers shared by `LSTMCell` and `LSTM`)."""
    kernel_in = module.param("kernel_in", nn.initializers.glorot_uniform(),
                             (in_features, 4 * features), jnp.float32)
    kernel_rec = module.param("kernel_rec", nn.initializers.orthogonal(),
                              (features, 4 * features), jnp.float32)
    bias = module.param("bias", _forget_bias_init(forget_bias), (4 * features,), jnp.float32)
    return kernel_in, kernel_rec, bias


class LSTMCell(nn.Module):
    """One step of `lstm_cell` with its own parameters: (carry (c, h), x [..., D]) -> (carry', h').

    Initialisation as Keras's `LSTM` (TFF's models): kernel_in Glorot-uniform, kernel_rec
    orthogonal, bias zeros with `forget_bias` (default 1.0, Keras's `unit_forget_bias=True`; haiku
    instead adds 1 to the forget pre-activation at run time, the same function at init) on f.
    """

    features: int
    forget_bias: float = 1.0

    @nn.compact
    def __call__(self, carry, x):
        kernel_in, kernel_rec, bias = _lstm_params(self, self.features, x.shape[-1],
                                                   self.forget_bias)
        carry = lstm_cell(carry, x @ kernel_in + bias, kernel_rec)
        return carry, carry[1]


def _lstm_scan(x_proj, kernel_rec, mask, keep: bool):
    """The LSTM recurrence as one `lax.scan` over time (x_proj [T, B, 4H], mask [T, B] or None).

    keep=False: h_t [T, B, H]. keep=True: (h_t, h_{t-1}, the coefficients of ż_t in the [i | f |
    g | o] layout [T, B, 4H], σ(f), σ(o)(1 − tanh²(c_t))): what `lstm_recurrence`'s tangent
    needs, computed in the same loop as the gates they come from.
    """
    zeros = jnp.zeros((x_proj.shape[1], kernel_rec.shape[0]), x_proj.dtype)

    def step(carry, inputs):
        c, h = carry
        xp, m = inputs
        i, f, g, o = jnp.split(xp + h @ kernel_rec, 4, axis=-1)
        si, sf, tg, so = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
        c_new = sf * c + si * tg
        tc = jnp.tanh(c_new)
        h_new = so * tc
        if m is None:
            c_t, h_t = c_new, h_new
        else:
            # A masked step carries the state unchanged (see `LSTM`).
            c_t, h_t = jnp.where(m[:, None], c_new, c), jnp.where(m[:, None], h_new, h)
        if not keep:
            return (c_t, h_t), h_t
        coef = jnp.concatenate([tg * si * (1 - si), c * sf * (1 - sf), si * (1 - tg * tg),
                                tc * so * (1 - so)], axis=-1)
        return (c_t, h_t), (h_t, h, coef, sf, so * (1 - tc * tc))

    return jax.lax.scan(step, (zeros, zeros), (x_proj, mask))[1]


@jax.custom_jvp
def lstm_recurrence(x_proj: jax.Array, kernel_rec: jax.Array,
                    mask: jax.Array | None = None) -> jax.Array:
    """h_t [T, B, H] of the LSTM (`lstm_cell`) from the input projections x_proj [T, B, 4H]
    (z_t = x_proj_t + h_{t-1} U), zero initial state; at mask_t = False ([T, B] bool, optional)
    the state is carried unchanged.

    Its derivative is written by hand (`jax.custom_jvp`) so that reverse mode computes the
    recurrent kernel's gradient as ONE matmul over all T·B rows instead of T small ones inside the
    backward scan. Tangent (forward mode), with a_t = ẋ_t + h_{t-1} U̇ the part of ż_t that does
    not depend on the earlier tangents, computed for all steps at once OUTSIDE the scan as one
    [T·B, H] × [H, 4H] matmul:

        ż_t = a_t + ḣ_{t-1} U
        ċ_t = σ(f)(1−σ(f)) c_{t-1} ż_f + tanh(g) σ(i)(1−σ(i)) ż_i + σ(i)(1−tanh²(g)) ż_g
              + σ(f) ċ_{t-1}
        ḣ_t = tanh(c_t) σ(o)(1−σ(o)) ż_o + σ(o)(1−tanh²(c_t)) ċ_t

    (masked steps: ċ_t = ċ_{t-1}, ḣ_t = ḣ_{t-1}); the gate values come from the primal scan, so
    the tangent scan carries only (ċ, ḣ) and does one [B, H] × [H, 4H] matmul per step. This is
    plain differentiable JAX, linear in the tangents, so:
      * reverse mode is JAX's transpose of it: the transposed tangent scan carries the cotangents
        of (c, h) only, and the transpose of a_t's matmul gives ∂L/∂U = Σ_t h_{t-1}ᵀ ∂L/∂z_t as
        ONE [H, T·B] × [T·B, 4H] matmul after the scan. Autodiff through the scan instead adds
        h_{t-1}ᵀ ∂L/∂z_t into a [H, 4H] carry at every step (reading and writing 1 MiB per step
        for H = 256) - the slowest matmul of the client step (docs/decisions/lstm-recurrence.md);
      * forward mode (jax.jvp) and forward-over-reverse (jax.jvp of jax.grad: Per-FedAvg HF's
        Hessian-vector products) differentiate the rule itself, exactly;
    which a `jax.custom_vjp` (the earlier prototype, docs/decisions/lstm-recurrence.md) would not allow.
    Values equal autodiff through the scan up to float rounding (tests/models/test_sequence.py
    checks loss, gradient, jvp and jvp-of-grad against a NumPy float64 LSTM).
    """
    return _lstm_scan(x_proj, kernel_rec, mask, keep=False)


def _lstm_recurrence_jvp(primals, tangents):
    x_proj, kernel_rec, mask = primals
    dx, du, _ = tangents                                  # the mask's tangent (float0) is unused
    hs, h_prev, coef, sf, c_in_h = _lstm_scan(x_proj, kernel_rec, mask, keep=True)
    t, b, hdim = hs.shape
    # a_t = ẋ_t + h_{t-1} U̇. A symbolically zero tangent (symbolic_zeros=True: an argument that
    # is not differentiated, e.g. the kernel when only the input is) costs nothing. JAX calls the
    # rule only when x_proj or kernel_rec carries a tangent (the mask never does), so at most
    # one of the two is zero.
    zero = jax.custom_derivatives.SymbolicZero
    if isinstance(du, zero):
        a = dx
    else:
        rec = (h_prev.reshape(t * b, hdim) @ du).reshape(t, b, 4 * hdim)   # all steps, one matmul
        a = rec if isinstance(dx, zero) else dx + rec
    # Every per-step input of the tangent scan is precomputed in the shape it is used in (the
    # mask broadcast to [T, B, H]): a known operation inside the linear scan would otherwise be
    # stacked by JAX's partial evaluation in an extra loop.
    keep = None if mask is None else jnp.broadcast_to(mask[..., None], hs.shape)
    # Uᵀ [4H, H] materialised once and the step's product written as ḣ (Uᵀ)ᵀ: its transpose in
    # the reverse scan, ∂L/∂z_t Uᵀ, is then a plain [B, 4H] × [4H, H] GEMM at each step (with
    # ḣ U written directly, XLA contracts U's last axis inside the loop: the layer's gradient
    # took ~20 % longer, T = 80, B = 10, H = 256, one core).
    u_t = kernel_rec.T
    zeros = jnp.zeros((b, hdim), hs.dtype)

    def step(carry, inputs):
        dc, dh = carry
        a_t, coef_t, sf_t, c_in_h_t, k = inputs
        dz = a_t + jax.lax.dot_general(dh, u_t, (((1,), (1,)), ((), ())))     # a_t + ḣ U
        qi, qf, qg, qo = jnp.split(coef_t * dz, 4, axis=-1)
        dc_new = qi + qf + qg + sf_t * dc
        dh_new = qo + c_in_h_t * dc_new
        if k is not None:
            dc_new, dh_new = jnp.where(k, dc_new, dc), jnp.where(k, dh_new, dh)
        return (dc_new, dh_new), dh_new

    _, dhs = jax.lax.scan(step, (zeros, zeros), (a, coef, sf, c_in_h, keep))
    return hs, dhs


lstm_recurrence.defjvp(_lstm_recurrence_jvp, symbolic_zeros=True)


class LSTM(nn.Module):
    """An LSTM layer over a sequence: x [B, T, D] -> h [B, T, H], zero initial state.

    The input projection W x_t + b of all T steps is one matmul outside the recurrence; only
    h U is inside `jax.lax.scan` over time, so the scan body is one [B, H] × [H, 4H] matmul and the
    layer has no Python loop (it vmaps over clients). Parameters and cell: `lstm_cell`, `LSTMCell`;
    the recurrence and its hand-written derivative (the recurrent kernel's gradient as one matmul
    after the backward scan; forward mode supported): `lstm_recurrence`. The input projection is
    a plain matmul, so the whole layer supports jax.jvp as well as jax.grad.

    mask [B, T] (optional, True on real tokens): at a masked step the state (c, h) is carried
    unchanged and the output is the carried h, so padding anywhere leaves every real position's
    output (and the last output, the state after the last real token) as without it.
    """

    features: int
    forget_bias: float = 1.0

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        kernel_in, kernel_rec, bias = _lstm_params(self, self.features, x.shape[-1],
                                                   self.forget_bias)
        x_proj = jnp.swapaxes(x @ kernel_in + bias, 0, 1)             # [T, B, 4H]
        if mask is not None:
            mask = jnp.swapaxes(mask.astype(bool), 0, 1)               # [T, B]
        return jnp.swapaxes(lstm_recurrence(x_proj, kernel_rec, mask), 0, 1)   # [B, T, H]


def _embed(vocab_size: int, features: int, stddev: float = 1.0) -> nn.Embed:
    # N(0, stddev²) (PyTorch's nn.Embedding default is N(0, 1)); path "Embed_0/embedding".
    return nn.Embed(vocab_size, features, embedding_init=nn.initializers.normal(stddev))


def _tokens(x: jax.Array) -> jax.Array:
    return x.astype(jnp.int32)


class CharLSTM(nn.Module):
    """The character LSTM of FedJAX's and TFF's Shakespeare experiments (McMahan et al. 2017):
    Embed(vocab_size, 8) → LSTM 256 → LSTM 256 → Dense(num_classes).

    Outputs logits [B, T, num_classes] (next-character prediction at every position), or with
    `last_only` the logits [B, num_classes] of the last position only (LEAF's Shakespeare: 80
    characters → the next one). PAD inputs are masked in the LSTMs (`LSTM`), so the last position's
    output is that of the last real character wherever the padding is.
    `output_tanh=True` applies tanh to each LSTM layer's output, as FedJAX's haiku model does
    (hk.DeepRNN([LSTM, tanh, LSTM, tanh])); the default, without it, is TFF's Keras model. The
    parameter count is the same (820,522 for vocab_size = num_classes = 90).
    """

    vocab_size: int
    num_classes: int
    embed: int = 8
    hidden: int = 256
    layers: int = 2
    last_only: bool = False
    output_tanh: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = _tokens(x)
        mask = x != PAD
        h = _embed(self.vocab_size, self.embed)(x)
        for _ in range(self.layers):
            h = LSTM(self.hidden)(h, mask)
            if self.output_tanh:
                h = jnp.tanh(h)
        if self.last_only:
            h = h[:, -1]
        return Dense(self.num_classes)(h)


class WordLSTM(nn.Module):
    """The word LSTM of TFF's Stack Overflow next-word prediction (Reddi et al. 2021, "Adaptive
    Federated Optimization"; FedJAX's `stackoverflow.create_lstm_model`): Embed(vocab_size, 96) →
    LSTM 670 → Dense 96 (linear projection, named `projection`) → Dense(num_classes).
    Outputs [B, T, num_classes]. 4,050,748 parameters for vocab_size = num_classes = 10,004.
    `output_tanh`: as `CharLSTM` (FedJAX applies tanh to the LSTM output; TFF does not).
    """

    vocab_size: int
    num_classes: int
    embed: int = 96
    hidden: int = 670
    last_only: bool = False
    output_tanh: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = _tokens(x)
        h = LSTM(self.hidden)(_embed(self.vocab_size, self.embed)(x), x != PAD)
        if self.output_tanh:
            h = jnp.tanh(h)
        if self.last_only:
            h = h[:, -1]
        h = Dense(self.embed, name="projection")(h)
        return Dense(self.num_classes)(h)


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: x + MHA(LN(x)) then x + MLP(LN(x)), MLP = Dense(4d) → GELU → Dense(d).

    `allowed` [B, T, T] says which keys each query attends to (causal, PAD keys masked).
    """

    heads: int
    mlp_ratio: int = 4

    @nn.compact
    def __call__(self, x: jax.Array, allowed: jax.Array) -> jax.Array:
        b, t, d = x.shape
        dh = d // self.heads
        qkv = Dense(3 * d, name="qkv")(nn.LayerNorm(name="ln_attn")(x))
        q, k, v = jnp.split(qkv.reshape(b, t, 3, self.heads, dh), 3, axis=2)
        q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]                   # [B, T, heads, dh]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(dh))
        scores = jnp.where(allowed[:, None], scores, jnp.finfo(scores.dtype).min)
        attn = jax.nn.softmax(scores, axis=-1)
        y = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, t, d)
        x = x + Dense(d, name="attn_out")(y)
        y = Dense(self.mlp_ratio * d, name="mlp_in")(nn.LayerNorm(name="ln_mlp")(x))
        return x + Dense(d, name="mlp_out")(jax.nn.gelu(y))


class CausalTransformer(nn.Module):
    """A small decoder-only transformer: token + learned positional embeddings (N(0, 0.02²)),
    `layers` pre-LayerNorm blocks of `heads` heads, final LayerNorm, Dense(num_classes).

    Attention is causal (position t sees positions ≤ t) and never looks at PAD keys (a position
    always sees itself, so no softmax row is empty). Outputs [B, T, num_classes], or with
    `last_only` the [B, num_classes] of each sequence's last non-PAD position. Sequences must be
    at most `max_len` long; padding goes at the end (a PAD before a real token would shift the
    learned positions of the tokens after it).
    """

    vocab_size: int
    num_classes: int
    max_len: int
    width: int = 128
    heads: int = 4
    layers: int = 2
    last_only: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.width % self.heads:
            raise ValueError(f"transformer width {self.width} is not a multiple of heads "
                             f"{self.heads}")
        x = _tokens(x)
        b, t = x.shape
        if t > self.max_len:
            raise ValueError(f"sequence length {t} exceeds the transformer's max_len "
                             f"{self.max_len}")
        pos = self.param("pos_embedding", nn.initializers.normal(0.02),
                         (self.max_len, self.width), jnp.float32)
        h = _embed(self.vocab_size, self.width, 0.02)(x) + pos[:t]
        causal = jnp.tril(jnp.ones((t, t), bool))
        allowed = causal[None] & ((x != PAD)[:, None, :] | jnp.eye(t, dtype=bool)[None])
        for i in range(self.layers):
            h = TransformerBlock(self.heads, name=f"Block_{i}")(h, allowed)
        h = nn.LayerNorm(name="ln_final")(h)
        if self.last_only:
            # The last real token's output (a trailing PAD query would also see the PAD itself).
            last = jnp.max(jnp.where(x != PAD, jnp.arange(t)[None], 0), axis=1)
            h = h[jnp.arange(b), last]
        return Dense(self.num_classes)(h)


BAG_FEATURES = ("frequency", "count", "binary")


class _BagDense(nn.Module):
    """logits_b = Σ_t w_bt · kernel[x_bt − first_word] + bias: a Dense layer applied to the bag of
    words without forming the [B, V] bag (a gather of L rows per example; its gradient is a
    scatter-add). Tokens outside [first_word, first_word + num_words) have no row (zero feature)."""

    num_tags: int
    num_words: int
    first_word: int
    features: str

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        real = x != PAD
        in_vocab = real & (x >= self.first_word) & (x < self.first_word + self.num_words)
        if self.features == "frequency":
            n = jnp.maximum(jnp.sum(real, axis=-1, keepdims=True), 1)
            w = in_vocab / n
        elif self.features == "count":
            w = in_vocab.astype(jnp.float32)
        else:  # binary: a word counts at its first occurrence only
            t = x.shape[-1]
            same = x[:, :, None] == x[:, None, :]                       # [B, t, s]
            earlier = jnp.tril(jnp.ones((t, t), bool), k=-1)[None]      # s < t
            w = (in_vocab & ~jnp.any(same & earlier, axis=-1)).astype(jnp.float32)
        kernel = self.param("kernel", nn.initializers.glorot_uniform(),
                            (self.num_words, self.num_tags), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (self.num_tags,), jnp.float32)
        rows = jnp.take(kernel, jnp.clip(x - self.first_word, 0, self.num_words - 1), axis=0)
        return jnp.einsum("bt,btc->bc", w.astype(kernel.dtype), rows) + bias


class TagLogReg(nn.Module):
    """TFF's Stack Overflow tag prediction model: logistic regression on a bag of words,
    logits = Dense(num_tags)(bag(x)); the sigmoid is in the loss (tasks.multilabel_sigmoid_loss).

    bag(x)_v for the words v = first_word, ..., first_word + num_words − 1 (default: every id but
    PAD, num_words = vocab_size − 1):
      "frequency" (TFF's choice: the mean of the one-hot rows of the post's words,
                   `tf.reduce_mean(tf.one_hot(ids, V + 1), 0)[:V]`): count(v) / (number of
                   non-PAD tokens, out-of-vocabulary ones included);
      "count":     count(v);
      "binary":    [v occurs].
    To reproduce TFF exactly, give the 10,000 words a contiguous id range (num_words = 10,000) and
    put out-of-vocabulary ids outside it: they count in the denominator but have no feature, as
    TFF drops the OOV column. Kernel Glorot-uniform, bias zeros (Keras's Dense). The parameters
    live in a module named `Dense_0`, so the whole model is the split-model head, as for `logreg`.
    """

    vocab_size: int
    num_tags: int
    features: str = "frequency"
    first_word: int = 1
    num_words: int | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.features not in BAG_FEATURES:
            raise ValueError(f"tag_logreg features must be one of {BAG_FEATURES}, "
                             f"got {self.features!r}")
        num_words = (self.vocab_size - self.first_word if self.num_words is None
                     else self.num_words)
        if num_words < 1 or self.first_word < 1:
            raise ValueError(f"tag_logreg needs first_word >= 1 and num_words >= 1, got "
                             f"{self.first_word}, {num_words}")
        return _BagDense(self.num_tags, num_words, self.first_word, self.features,
                         name="Dense_0")(_tokens(x))


class SentLSTM(nn.Module):
    """LEAF's Sent140 classifier (models/sent140/stacked_lstm.py, n_hidden = 100, 25 words):
    Embed(vocab_size, 100) → LSTM 100 → LSTM 100 → last state → Dense 128 (linear, named `fc`, as
    in LEAF) → Dense(num_classes = 2).

    LEAF embeds with a trainable [V + 1, n_hidden] table (V = its GloVe word list) and runs the LSTM
    over its padding; we mask PAD (`LSTM`), so the last state is that after the last real word.
    """

    vocab_size: int
    num_classes: int = 2
    embed: int = 100
    hidden: int = 100
    layers: int = 2
    fc: int = 128

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = _tokens(x)
        mask = x != PAD
        h = _embed(self.vocab_size, self.embed)(x)
        for _ in range(self.layers):
            h = LSTM(self.hidden)(h, mask)
        h = Dense(self.fc, name="fc")(h[:, -1])
        return Dense(self.num_classes)(h)


class FlaxFunctions(NamedTuple):
    """A flax module as the pure functions of `models.Model` (keyword arguments of it)."""

    init: Callable[[jax.Array], Params]
    apply: Callable[[Params, jax.Array], jax.Array]
    features: Callable[[Params, jax.Array], jax.Array]   # the head's input (`model.head_input`)


def from_flax_tokens(
    module: nn.Module, input_shape: Sequence[int], dtype: Any = jnp.int32
) -> FlaxFunctions:
    """(init, apply, features) of a stateless flax module whose inputs are `dtype` (int32 token
    ids): init traces the module on zeros [1, *input_shape] of that dtype (all PAD); features is
    the input of the head (`model.head_input`: [B, T, H] for a per-token model)."""
    input_shape = tuple(int(s) for s in input_shape)
    dummy = jnp.zeros((1, *input_shape), dtype)
    variables = jax.eval_shape(module.init, jax.random.key(0), dummy)
    extra = sorted(set(variables) - {"params"})
    if extra:
        raise ValueError(f"{type(module).__name__} has non-parameter collections {extra}; the "
                         "engine supports stateless modules only")

    def init(key: jax.Array) -> Params:
        return module.init(key, dummy)["params"]

    def apply(params: Params, x: jax.Array) -> jax.Array:
        return module.apply({"params": params}, x)

    return FlaxFunctions(init, apply, head_input(module, variables["params"]))


SEQUENCE_MODELS: tuple[str, ...] = ("char_lstm", "word_lstm", "transformer", "tag_logreg",
                                    "sent_lstm", "femnist_cnn")

# Published hyperparameters each model accepts as options (anything else is an error).
_OPTIONS = {
    "char_lstm": ("embed", "hidden", "layers", "output_tanh"),
    "word_lstm": ("embed", "hidden", "output_tanh"),
    "transformer": ("width", "heads", "layers"),
    "tag_logreg": ("features", "first_word", "num_words"),
    "sent_lstm": ("embed", "hidden", "layers", "fc"),
    "femnist_cnn": ("conv",),
}


def _size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# What each option takes, by name (the same in every model that has it): (test, words).
_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    **{key: (_size, "an integer >= 1") for key in ("embed", "hidden", "layers", "width", "heads",
                                                   "fc", "first_word", "num_words")},
    "output_tanh": (lambda v: isinstance(v, bool), "true or false"),
    "features": (lambda v: v in BAG_FEATURES, f"one of {list(BAG_FEATURES)}"),
    "conv": (lambda v: v in CONV_IMPLS, f"one of {list(CONV_IMPLS)}"),
}


def check_options(name: str, options: Mapping[str, Any]) -> None:
    """The model options of `name` (`_OPTIONS`), each of its kind (`_KINDS`), checked before
    any model is built: an OptionError naming `model_options` and the option otherwise."""
    from fedjax_pfl.errors import OptionError, arg

    if not options:
        return
    if name not in SEQUENCE_MODELS:
        raise OptionError(f"{arg('model_options')} {sorted(options)}: {arg('model')} {name} takes "
                          "no model options")
    for key, value in options.items():
        if key not in _OPTIONS[name]:
            raise OptionError(f"{arg('model_options')} {key}: {arg('model')} {name} has no such "
                              f"option; it takes {', '.join(_OPTIONS[name])}")
        test, words = _KINDS[key]
        if not test(value):
            raise OptionError(f"{arg('model_options')} {key} must be {words}, got {value!r}")
    if name == "transformer":
        width, heads = options.get("width", 128), options.get("heads", 4)
        if width % heads:
            raise OptionError(f"{arg('model_options')} width {width} must be a multiple of heads "
                              f"{heads}")


def get(name: str, task: Task, input_shape: Sequence[int], **options) -> dict:
    """The model `name` for a natural `Task`, as keyword arguments of `models.Model`:
    dict(init=, apply=, features=, loss=, weight=, metric=, name=), loss/weight/metric from
    `tasks.for_task(task)`.

    input_shape: one example's input without the batch axis ((L,) for tokens, (H, W, C) images).
    Sequence-output models (char_lstm, word_lstm, transformer) give [B, T, C] for a "sequence"
    task and the last position's [B, C] for a "classify" one (LEAF's next character).
    options: the model's sizes (`_OPTIONS`), e.g. hidden=64 for a small LSTM.
    """
    from fedjax_pfl.models import tasks

    if name not in SEQUENCE_MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {SEQUENCE_MODELS}")
    unknown = sorted(set(options) - set(_OPTIONS[name]))
    if unknown:
        raise ValueError(f"model {name!r} takes no option(s) {unknown}; it accepts "
                         f"{list(_OPTIONS[name])}")
    input_shape = tuple(int(s) for s in input_shape)
    c = task.num_classes
    if name == "femnist_cnn":
        if task.inputs != "image" or len(input_shape) != 3 or min(input_shape[:2]) < 6:
            raise ValueError(f"femnist_cnn needs image inputs [H, W, C] of at least 6x6, got "
                             f"{task.inputs} {input_shape}")
        module = nets.FemnistCNN(c, **options)
        dtype = jnp.float32
    else:
        if task.inputs != "tokens" or len(input_shape) != 1:
            raise ValueError(f"model {name!r} needs token inputs [L], got {task.inputs} "
                             f"{input_shape}")
        kinds = {"tag_logreg": ("multilabel",), "sent_lstm": ("classify",)}.get(
            name, ("sequence", "classify"))
        if task.kind not in kinds:
            raise ValueError(f"model {name!r} does not fit a {task.kind!r} task (it fits {kinds})")
        last_only = task.kind == "classify"
        v = task.vocab_size
        if name == "char_lstm":
            module = CharLSTM(v, c, last_only=last_only, **options)
        elif name == "word_lstm":
            module = WordLSTM(v, c, last_only=last_only, **options)
        elif name == "transformer":
            module = CausalTransformer(v, c, max_len=input_shape[0], last_only=last_only,
                                       **options)
        elif name == "tag_logreg":
            module = TagLogReg(v, c, **options)
        else:
            module = SentLSTM(v, c, **options)
        dtype = jnp.int32
    init, apply, features = from_flax_tokens(module, input_shape, dtype)
    return dict(init=init, apply=apply, features=features, name=name, **tasks.for_task(task))
