"""Per-task losses, unit weights and metrics for natural-client datasets (data/natural.py).

Every function here follows `Model`'s contract (models/model.py), on ONE batch of one client:

* ``loss(outputs, labels) -> [B]``: each example's loss SUMMED over the units it counts (its
  non-PAD tokens for a sequence task; one unit for a classification or a tag example).
* ``weight(labels) -> [B]``: the number of units each example counts (None: one each). The engine's
  mean loss is Σ_b m_b·loss_b / max(Σ_b m_b·weight_b, 1) for the example mask m, so a sequence
  task's loss is the mean over the batch's real tokens, wherever the padding sits.
* ``metric(outputs, labels) -> (hits [B], count [B])``: each example's correct units and scored
  units; accuracy = Σ hits / Σ count (None: argmax == label, one each).

Labels follow data/natural.py: sequence labels y [B, T] with 0 = PAD; multilabel y [B, K] tag ids
padded with −1.

Shifted labels (`Task.label_offset` = k > 0, the pretrained-tokenizer token tasks of
`data/tokenizer.py`, k = 1): a pretrained vocabulary uses every id from 0 (GPT-2's "!" is id 0,
Llama's <unk> is 0), so no token id is free to mean padding. Such a task stores
y_bt = (id of the next token) + k for a scored target and y_bt = 0 (`PAD`) for a target that
is not scored (padding, and the prompt of an instruction example); the class a loss or metric
compares with the logits is y − k where y > 0. With k = 0 (every other task) the labels are the
classes themselves and the functions are the unshifted ones, unchanged.

`Task` (here: the data readers build it, the models read it) says what is
predicted from what; `for_task(task)` returns the triple for a `Task`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax

PAD = 0
KINDS = ("classify", "sequence", "multilabel")
INPUTS = ("image", "tokens", "features")


@dataclasses.dataclass(frozen=True)
class Task:
    """What is predicted from what; hashable (it is static metadata of the jitted programs).

    kind: "classify" | "sequence" | "multilabel" (module docstring).
    num_classes: the output width: classes, output vocabulary (specials included) or tags.
    inputs: "image" | "tokens" | "features".
    vocab_size: for token inputs, the input vocabulary size (specials included); else 0.
    metric_excluded: sequence tasks: labels besides `PAD` that accuracy leaves out.
    topk: multilabel tasks: k of recall@k.
    default_model: the published model of this dataset (models.get name).
    label_offset: sequence tasks: k ≥ 0 added to every scored target (module docstring,
      "Shifted labels"): the class of a label y > 0 is y − k, so labels run 0 … num_classes − 1 + k.
      0 (the default) for every task but the pretrained-tokenizer ones (1).
    """

    kind: str = "classify"
    num_classes: int = 10
    inputs: str = "image"
    vocab_size: int = 0
    metric_excluded: tuple[int, ...] = ()
    topk: int = 5
    default_model: str = ""
    label_offset: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Task.kind must be one of {KINDS}, got {self.kind!r}")
        if self.inputs not in INPUTS:
            raise ValueError(f"Task.inputs must be one of {INPUTS}, got {self.inputs!r}")
        if self.num_classes < 1:
            raise ValueError(f"Task.num_classes must be >= 1, got {self.num_classes}")
        if self.inputs == "tokens" and self.vocab_size < 1:
            raise ValueError("a task with token inputs needs vocab_size >= 1")
        if self.label_offset < 0 or (self.label_offset and self.kind != "sequence"):
            raise ValueError(f"Task.label_offset must be 0, or > 0 for a sequence task; got "
                             f"{self.label_offset} for a {self.kind} task")


__all__ = ["PAD", "KINDS", "INPUTS", "Task", "sequence_cross_entropy", "token_weight", "token_accuracy",
           "shifted_sequence_cross_entropy", "shifted_token_accuracy", "multi_hot",
           "multilabel_sigmoid_loss", "recall_at_k", "for_task"]

Metric = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def sequence_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-sequence SUM of token cross-entropies over the non-PAD targets.

    ℓ_b = Σ_t [y_bt ≠ PAD] · (−log softmax(z_bt)[y_bt]).

    FedJAX's Stack Overflow `train_loss` is this sum ("total loss per sentence"); its
    Shakespeare `train_loss` divides the same masked sum by T (padding included). We return the
    sum and let the engine divide by Σ `token_weight`, i.e. the batch's mean over real tokens
    (TFF's masked `SparseCategoricalCrossentropy` mean), independent of how much padding there is.

    Args:
      logits: [B, T, V].
      labels: [B, T] int, PAD = 0.
    Returns:
      [B] float32; a PAD-only example gives exactly 0 and no gradient.
    """
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    # where, not a product: a PAD position's value (finite or not) never reaches the sum or grad.
    return jnp.sum(jnp.where(labels != PAD, per_token, 0.0), axis=-1)


def token_weight(labels: jax.Array) -> jax.Array:
    """The number of non-PAD targets of each sequence: w_b = Σ_t [y_bt ≠ PAD]; [B, T] -> [B]."""
    return jnp.sum(labels != PAD, axis=-1).astype(jnp.float32)


def token_accuracy(excluded: tuple[int, ...] = ()) -> Metric:
    """Token accuracy over the targets that are neither PAD nor in `excluded`.

    hits_b = Σ_t [y_bt ∉ E] · [argmax_v z_btv = y_bt],  count_b = Σ_t [y_bt ∉ E],
    E = {PAD} ∪ excluded. The prediction is the plain argmax over every output (a predicted
    out-of-vocabulary or special token counts as wrong). FedJAX's `accuracy_no_eos`
    (SequenceTokenAccuracy with masked_target_values=(pad, eos)) is `excluded=(eos,)`; its
    `accuracy_in_vocab` additionally removes PAD/BOS/EOS/OOV from the argmax (not offered here).
    `Task.metric_excluded` supplies `excluded`.
    """
    excluded = tuple(int(e) for e in excluded)

    def metric(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
        scored = labels != PAD
        for e in excluded:
            scored = scored & (labels != e)
        correct = jnp.argmax(logits, axis=-1) == labels
        hits = jnp.sum(scored & correct, axis=-1).astype(jnp.float32)
        return hits, jnp.sum(scored, axis=-1).astype(jnp.float32)

    return metric


def shifted_sequence_cross_entropy(label_offset: int) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """`sequence_cross_entropy` for labels shifted by k = `label_offset` (module docstring).

    ℓ_b = Σ_t [y_bt ≠ PAD] · (−log softmax(z_bt)[y_bt − k]): the class of a scored target is
    y − k (so a next token of id 0 is y = k, scored), and a target y = PAD = 0 counts nothing.
    Returns the loss function (logits [B, T, V], labels [B, T]) -> [B].
    """
    k = int(label_offset)

    def loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
        scored = labels != PAD
        per_token = optax.softmax_cross_entropy_with_integer_labels(
            logits, jnp.where(scored, labels - k, 0))
        return jnp.sum(jnp.where(scored, per_token, 0.0), axis=-1)

    return loss


def shifted_token_accuracy(label_offset: int, excluded: tuple[int, ...] = ()) -> Metric:
    """`token_accuracy` for labels shifted by k = `label_offset`: hits_b = Σ_t [y_bt ∉ E] ·
    [argmax_v z_btv = y_bt − k], count_b = Σ_t [y_bt ∉ E], E = {PAD} ∪ excluded (`excluded` in
    the stored, shifted label values)."""
    k = int(label_offset)
    excluded = tuple(int(e) for e in excluded)

    def metric(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
        scored = labels != PAD
        for e in excluded:
            scored = scored & (labels != e)
        correct = jnp.argmax(logits, axis=-1) == labels - k
        hits = jnp.sum(scored & correct, axis=-1).astype(jnp.float32)
        return hits, jnp.sum(scored, axis=-1).astype(jnp.float32)

    return metric


def multi_hot(labels: jax.Array, num_classes: int) -> jax.Array:
    """Tag ids [B, K] padded with −1 → multi-hot [B, C] float32 (a repeated id counts once)."""
    # one_hot of −1 is the zero row; max (not sum) keeps a repeated id at 1, as TFF's tag set.
    return jnp.max(jax.nn.one_hot(labels, num_classes, dtype=jnp.float32), axis=-2)


def multilabel_sigmoid_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Sigmoid cross-entropy summed over the C tags: ℓ_b = Σ_c [softplus(z_bc) − y_bc·z_bc].

    With y = multi_hot(labels) and p = σ(z), softplus(z) − y·z = −y·log p − (1 − y)·log(1 − p),
    computed from the logits (stable for any |z|). Reduction: SUM over tags, one unit per
    example (weight None). TFF's tag-prediction task (Dense(500, sigmoid) and
    `BinaryCrossentropy(from_logits=False, reduction=SUM)`) uses Keras's per-example MEAN over the
    C tags (with probabilities clipped to [1e-7, 1 − 1e-7]) and sums over the batch; so our
    per-example loss is C × TFF's, and TFF's loss value is ours / C. In SGD the factor C
    (500 for Stack Overflow) is a learning-rate rescaling.

    Args:
      logits: [B, C].
      labels: [B, K] int tag ids in [0, C), padded with −1.
    Returns:
      [B] float32.
    """
    y = multi_hot(labels, logits.shape[-1])
    return jnp.sum(jax.nn.softplus(logits) - y * logits, axis=-1)


def recall_at_k(k: int) -> Metric:
    """Micro recall@k: hits_b = |top_k(z_b) ∩ T_b|, count_b = |T_b| for the true tag set T_b.

    Σ hits / Σ count is Keras's `tf.keras.metrics.Recall(top_k=k)` as TFF's tag-prediction task
    reports it (`recall_at_5`): with top_k set, Keras sets the threshold to −∞, so exactly the k
    highest scores are predicted positive, and accumulates true positives and false negatives over
    the whole dataset (micro-average). Ties go to the lower tag index (`jax.lax.top_k`, like
    `tf.math.top_k`). An example without tags counts nothing.
    """
    k = int(k)
    if k < 1:
        raise ValueError(f"recall_at_k needs k >= 1, got {k}")

    def metric(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
        num_classes = logits.shape[-1]
        y = multi_hot(labels, num_classes)
        _, top = jax.lax.top_k(logits, min(k, num_classes))
        predicted = jnp.max(jax.nn.one_hot(top, num_classes, dtype=jnp.float32), axis=-2)
        return jnp.sum(y * predicted, axis=-1), jnp.sum(y, axis=-1)

    return metric


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-example cross-entropy −log softmax(logits)[label]; [B, C], [B] -> [B]."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def for_task(task: Task) -> dict:
    """The (loss, weight, metric) of a natural `Task`, as keyword arguments of `Model`.

    classify:   softmax cross-entropy; weight None; metric None (argmax == label).
    sequence:   `sequence_cross_entropy`, `token_weight`, `token_accuracy(task.metric_excluded)`;
                with `task.label_offset` k > 0, `shifted_sequence_cross_entropy(k)`, `token_weight`,
                `shifted_token_accuracy(k, task.metric_excluded)`.
    multilabel: `multilabel_sigmoid_loss`, weight None, `recall_at_k(task.topk)`.
    """
    if task.kind == "classify":
        return dict(loss=softmax_cross_entropy, weight=None, metric=None)
    if task.kind == "sequence" and task.label_offset:
        k = task.label_offset
        return dict(loss=shifted_sequence_cross_entropy(k), weight=token_weight,
                    metric=shifted_token_accuracy(k, tuple(task.metric_excluded)))
    if task.kind == "sequence":
        return dict(loss=sequence_cross_entropy, weight=token_weight,
                    metric=token_accuracy(tuple(task.metric_excluded)))
    if task.kind == "multilabel":
        return dict(loss=multilabel_sigmoid_loss, weight=None, metric=recall_at_k(task.topk))
    raise ValueError(f"unknown task kind {task.kind!r}")
