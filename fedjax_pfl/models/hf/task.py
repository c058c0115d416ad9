"""Next-token prediction with a pretrained decoder: labels, loss, weight and metric.

The loss, weight and metric are `models.tasks`' shifted functions at k = 1 (one
implementation, which `tasks.for_task` also returns for a `Task` with `label_offset` = 1); this
module only builds the labels and names the k = 1 instances.

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

import numpy as np

from fedjax_pfl.models.tasks import shifted_sequence_cross_entropy, shifted_token_accuracy, token_weight

__all__ = ["LABEL_OFFSET", "shifted_labels", "shifted_sequence_loss", "shifted_sequence_weight",
           "shifted_sequence_metric"]

LABEL_OFFSET = 1        # y = next token id + 1; 0 = not scored (module docstring)


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
    y[..., :-1] = np.where(ok[..., 1:], x[..., 1:] + LABEL_OFFSET, 0)
    return y


# ℓ_b = Σ_t [y_bt > 0] · (−log softmax(z_bt)[y_bt − 1]); [B, T, V], [B, T] -> [B].
shifted_sequence_loss = shifted_sequence_cross_entropy(LABEL_OFFSET)
# w_b = Σ_t [y_bt > 0]; [B, T] -> [B].
shifted_sequence_weight = token_weight
# (Σ_t [y_bt > 0]·[argmax z_bt = y_bt − 1], Σ_t [y_bt > 0]): next-token accuracy.
shifted_sequence_metric = shifted_token_accuracy(LABEL_OFFSET)
