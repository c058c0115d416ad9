"""Every registered algorithm on a per-token task and on a multi-label task (the cross-cutting
check that no algorithm assumes one label per sample or [B, C] outputs): one round and an
evaluation on small clients, with the task's loss and metric (`models/tasks.py`) on a bigram
model (embedding → dense at every position) and TFF's bag-of-words logistic regression for tags.

Checked against hand computations on the same arrays: every client's evaluated `count` is its
scored units (real target tokens; true tags), `loss_count` its real tokens (samples for tags),
and the training loss is finite."""

import flax.linen as nn
import jax
import numpy as np
import pytest

from fedjax_pfl import algorithms, core, models
from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.data.natural import Task
from fedjax_pfl.models import sequence, tasks
from fedjax_pfl.models.layers import Dense

V, T, TAGS, K = 7, 6, 9, 3
SEQ = Task(kind="sequence", inputs="tokens", num_classes=V, vocab_size=V, metric_excluded=(2,))
TAG = Task(kind="multilabel", inputs="tokens", num_classes=TAGS, vocab_size=V, topk=2)
TRAIN, TEST = np.array([5, 3, 7, 4]), np.array([2, 3, 1, 2])


def _data(task):
    rng = np.random.default_rng(0)
    n = int(TRAIN.sum() + TEST.sum())
    x = rng.integers(1, V, (n, T)).astype(np.int32)
    lengths = rng.integers(1, T + 1, n)
    for i, k in enumerate(lengths):
        x[i, k:] = 0
    if task.kind == "sequence":
        y = np.where(x > 0, rng.integers(1, V, (n, T)), 0).astype(np.int32)
    else:
        y = np.full((n, K), -1, np.int32)
        for i in range(n):
            tags = rng.choice(TAGS, rng.integers(0, K + 1), replace=False)
            y[i, :tags.size] = tags
    return FederatedData.from_blocks(x, y, TRAIN, TEST, num_classes=task.num_classes,
                                     name=task.kind, task=task), y


class Bigram(nn.Module):
    """Embedding → Dense to the vocabulary at every position: the smallest per-token model (the
    engine's per-token path is what is checked; the published models have their own tests)."""

    @nn.compact
    def __call__(self, x):
        return Dense(V)(nn.Embed(V, 4)(x))


def _model(task):
    if task.kind == "sequence":
        init, apply, features = sequence.from_flax_tokens(Bigram(), (T,))
        return models.Model(init=init, apply=apply, features=features, name="bigram",
                            **tasks.for_task(task))
    return models.get("tag_logreg", (T,), TAGS, task=task)


# The quick suite keeps a global algorithm on the multi-label task, a personalised one and a
# split-head one on the per-token task (FedRoD's multi-label case is a refusal).
QUICK = {("fedavg", "multilabel"), ("pgfedmo", "per_token"), ("fedrod", "per_token")}
CASES = [pytest.param(name, task, id=f"{name}-{label}",
                      marks=() if (name, label) in QUICK else pytest.mark.slow)
         for name in algorithms.names() for task, label in ((SEQ, "per_token"), (TAG, "multilabel"))]


@pytest.mark.matrix
@pytest.mark.parametrize("name, task", CASES)
def test_every_algorithm_runs_on_every_task(name, task):
    data, y = _data(task)
    hp = {**algorithms.spec(name).test_hparams, "participation": 0.5, "batch_size": 2}
    hp.pop("head", None)                    # the linear test model's pattern; here: the default
    if name == "fedrep":
        hp["local_epochs"] = 2
    if name == "ffa_lora":
        hp["frozen"] = "bias$"              # (the linear model's '^b$'; adapters' lora_A)
    algo = algorithms.get(name, model=_model(task), **hp)
    if name == "fedrod" and task.kind == "multilabel":
        with pytest.raises(ValueError, match="multi-label"):
            core.Program(algo, data, mesh=None).init(jax.random.key(0))
        return
    program = core.Program(algo, data, mesh=None)
    state = program.init(jax.random.key(0))
    state, (metrics,) = program.run_rounds(state, jax.random.key(1), 0, 1)
    assert np.isfinite(np.asarray(metrics["train_loss"])).all()
    evaluation = program.evaluate(state)["client"]
    test = y[int(TRAIN.sum()):]
    per_client = np.split(test, np.cumsum(TEST)[:-1])
    if task.kind == "sequence":
        want_count = [int(((b != 0) & (b != 2)).sum()) for b in per_client]
        want_units = [int((b != 0).sum()) for b in per_client]
    else:
        want_count = [int((b >= 0).sum()) for b in per_client]
        want_units = [len(b) for b in per_client]
    np.testing.assert_array_equal(np.asarray(evaluation.count), want_count)
    np.testing.assert_array_equal(np.asarray(evaluation.loss_count), want_units)
    assert np.all(np.asarray(evaluation.correct) <= np.asarray(evaluation.count))
    assert np.isfinite(np.asarray(evaluation.loss_sum)).all()
