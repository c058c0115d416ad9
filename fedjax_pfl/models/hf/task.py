"""Next-token prediction with a pretrained decoder: labels, loss, weight and metric.

The label contract of pretrained token tasks (shared with the JSONL reader, data/): the inputs
x [B, T] are the model's token ids (int32; any id, 0 included, is a real token); the labels
y [B, T] are the NEXT token's id + 1, with 0 = not scored (padding, the last position, or a
prompt the loss leaves out). The shift by one keeps the engine's "0 = PAD" convention
(models/tasks.py) whatever id 0 is in the tokenizer. With z the logits [B, T, V]:

    loss_b   = Σ_t [y_bt > 0] · CE(z_bt, y_bt − 1)
    weight_b = Σ_t [y_bt > 0]
    metric_b = (Σ_t [y_bt > 0]·[argmax z_bt = y_bt − 1],  Σ_t [y_bt > 0])

so the engine's mean loss Σ m_b loss_b / Σ m_b weight_b is the mean over the scored tokens, as
HF's `LlamaForCausalLM` loss (labels −100 ignored) is on one batch. A dataset of such labels runs
0 … V, so its `num_classes` (and its `Task`'s) is V + 1 for a vocabulary of V logits
(`data.federated.check_labels` accepts labels below num_classes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_pfl.models.tasks import token_weight

__all__ = ["shifted_labels", "shifted_sequence_loss", "shifted_sequence_weight",
           "shifted_sequence_metric"]


def shifted_labels(token_ids: np.ndarray, scored: np.ndarray | None = None) -> np.ndarray:
    """Labels y [B, T] of token ids x [B, T]: y_t = x_{t+1} + 1 where position t+1 is scored,
    else 0 (and y_{T−1} = 0).

    Args:
      token_ids: [B, T] int.
      scored: [B, T] bool, whether each TOKEN is a target (False for padding and for prompt
        tokens whose prediction the loss leaves out); None: all.
    Returns:
      [B, T] int32.
    """
    x = np.asarray(token_ids, np.int64)
    ok = np.ones(x.shape, bool) if scored is None else np.asarray(scored, bool)
    y = np.zeros(x.shape, np.int32)
    y[..., :-1] = np.where(ok[..., 1:], x[..., 1:] + 1, 0)
    return y


def shifted_sequence_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """ℓ_b = Σ_t [y_bt > 0] · (−log softmax(z_bt)[y_bt − 1]); [B, T, V], [B, T] -> [B]."""
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels - 1, 0))
    # where, not a product: an unscored position's value never reaches the sum or the gradient.
    return jnp.sum(jnp.where(labels > 0, per_token, 0.0), axis=-1)


def shifted_sequence_weight(labels: jax.Array) -> jax.Array:
    """w_b = Σ_t [y_bt > 0]; [B, T] -> [B] (`tasks.token_weight`: labels are ≥ 0)."""
    return token_weight(labels)


def shifted_sequence_metric(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(Σ_t [y_bt > 0]·[argmax z_bt = y_bt − 1], Σ_t [y_bt > 0]): next-token accuracy."""
    scored = labels > 0
    hits = jnp.sum(scored & (jnp.argmax(logits, axis=-1) == labels - 1), axis=-1)
    return hits.astype(jnp.float32), jnp.sum(scored, axis=-1).astype(jnp.float32)
