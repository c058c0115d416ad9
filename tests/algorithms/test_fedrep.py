"""FedRep: rounds against a NumPy float64 transcription (per-phase momentum buffers included),
the frozen part bit for bit unchanged in each phase, τ_h = 0 against FedAvg on a body-only model,
backends equal, config errors and --help."""

import functools
import itertools

import chex
import jax
import mlp_reference as ref
import numpy as np
import pytest
from helpers import linear_model, make_data, make_raw, tree_allclose, tree_equal

from fedjax_pfl import algorithms, models
from fedjax_pfl.models import nets
from fedjax_pfl.models import split as split_lib
from fedjax_pfl.models.model import Model

MLP = models.from_flax(nets.MLP(3, hidden=(4,)), (5,))       # Dense_0 (body) → Dense_1 (head)
SIZES = [7, 23, 12, 9]
DATA = make_data(SIZES)
RAW = make_raw(SIZES)
COMMON = dict(lr=0.1, batch_size=4, participation=0.5)


@functools.lru_cache(maxsize=None)
def _run(backend, hp_items, rounds=2):
    hp = COMMON | dict(hp_items)
    algo = algorithms.get("fedrep", model=MLP, backend=backend, **hp)
    state = algo.init(jax.random.key(0), DATA)
    chex.clear_trace_counter()
    step = algo.round_fn if backend == "loop" else jax.jit(chex.assert_max_traces(algo.round_fn, n=1))
    states, metrics = [state], []
    for r in range(rounds):
        state, m = step(state, DATA, jax.random.key(r))
        states.append(state)
        metrics.append(m)
    return states, metrics, algo.evaluate(state, DATA)["client"]


def run(backend="vmap", **hp):
    return _run(backend, tuple(sorted(hp.items())))


def reference_rounds(sampled_per_round, p0, *, tau_h, epochs, lr, momentum):
    """FedRep, literally: per sampled client, τ_h full-batch GD(+momentum) steps on its head,
    then E − τ_h on the body; the body is the n_i-weighted mean. Each client keeps one momentum
    buffer per part across rounds (persist)."""
    n = len(SIZES)
    body = {"Dense_0": p0["Dense_0"]}
    heads = [{"Dense_1": p0["Dense_1"]} for _ in range(n)]
    zero = lambda t: jax.tree.map(np.zeros_like, t)
    buf_head = [zero(heads[0]) for _ in range(n)]
    buf_body = [zero(body) for _ in range(n)]
    out = []
    for S in sampled_per_round:
        bodies = []
        for i in S:
            x, y = ref.client_xy(RAW, i)
            phi, h = body, heads[i]
            for _ in range(tau_h):                                    # head, body frozen
                g = ref.ce_grad(phi | h, x, y)
                buf_head[i] = ref.axpy(momentum, buf_head[i], {"Dense_1": g["Dense_1"]})
                h = ref.axpy(-lr, buf_head[i], h)
            for _ in range(epochs - tau_h):                           # body, head frozen
                g = ref.ce_grad(phi | h, x, y)
                buf_body[i] = ref.axpy(momentum, buf_body[i], {"Dense_0": g["Dense_0"]})
                phi = ref.axpy(-lr, buf_body[i], phi)
            heads[i] = h
            bodies.append(phi)
        body = ref.weighted_mean(bodies, [SIZES[i] for i in S])
        out.append((body, [dict(h) for h in heads]))
    return out


@pytest.mark.parametrize("momentum,buffer", [(0.0, "reset"),
                                             pytest.param(0.9, "persist", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_rounds_match_numpy_transcription(x64, momentum, buffer):
    algo = algorithms.get("fedrep", model=ref.TWO_LAYER, lr=0.3, batch_size=32, participation=0.5,
                          local_epochs=3, head_epochs=1, momentum=momentum, momentum_buffer=buffer)
    state = algo.init(jax.random.key(0), DATA)
    p0 = ref.to_numpy(ref.TWO_LAYER.init(jax.random.key(0)))
    sampled, states = [], []
    for r in range(3):
        state, m = jax.jit(algo.round_fn)(state, DATA, jax.random.key(r))
        sampled.append(np.asarray(m["sampled"]).tolist())
        states.append(state)
        assert int(m["client_steps"]) == 2 * 3              # 2 clients × E full-batch steps
    assert len({tuple(s) for s in sampled}) > 1             # clients come back in later rounds
    expected = reference_rounds(sampled, p0, tau_h=1, epochs=3, lr=0.3, momentum=momentum)
    for st, (body, heads) in zip(states, expected):
        tree_allclose(st.body["Dense_0"], body["Dense_0"], rtol=1e-10, atol=1e-12)
        for i in range(len(SIZES)):
            got = jax.tree.map(lambda a: a[i], st.heads["Dense_1"])
            tree_allclose(got, heads[i]["Dense_1"], rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_body_phase_freezes_the_head_bit_for_bit():
    # τ_h = 0: only the body trains; every head stays at its initialisation.
    states, _, _ = run(local_epochs=1, head_epochs=0)
    tree_equal(states[2].heads, states[0].heads)
    assert not np.array_equal(states[1].body["Dense_0"]["kernel"], states[0].body["Dense_0"]["kernel"])
    # τ_h = 1 of E = 2 or of E = 3: the same head phase (same keys), then one or two body
    # epochs: the heads after the round are equal bit for bit (the body phase leaves them).
    longer, _, _ = run(local_epochs=3, head_epochs=1)
    both, both_metrics, _ = run(local_epochs=2, head_epochs=1)
    assert not np.array_equal(both[1].body["Dense_0"]["kernel"], longer[1].body["Dense_0"]["kernel"])
    tree_equal(both[1].heads, longer[1].heads)
    sampled = set(np.asarray(both_metrics[0]["sampled"]).tolist())
    for i in range(len(SIZES)):                    # sampled heads trained, the others untouched
        row = lambda t: jax.tree.map(lambda a: np.asarray(a[i]), t)["Dense_1"]["kernel"]
        assert np.array_equal(row(both[1].heads), row(both[0].heads)) == (i not in sampled)


def body_only_model(model, params0, mask):
    """The model as a function of its body alone, the head fixed at params0's (FedAvg on it is
    FedRep with τ_h = 0: every client's head is the same constant)."""
    _, head0 = split_lib.split(params0, mask)
    return Model(init=lambda key: split_lib.split(model.init(key), mask)[0],
                 apply=lambda body, x: model.apply(split_lib.merge(body, head0, mask), x),
                 loss=model.loss, name="body_only")


@pytest.mark.slow
def test_no_head_epochs_is_fedavg_on_the_body_with_a_fixed_head():
    params0 = MLP.init(jax.random.key(0))
    mask = split_lib.personal_mask(params0, "head")
    fedavg = algorithms.get("fedavg", model=body_only_model(MLP, params0, mask), **COMMON)
    s_avg = fedavg.init(jax.random.key(0), DATA)
    states, metrics, _ = run(local_epochs=1, head_epochs=0)
    for r in range(2):
        s_avg, m_avg = jax.jit(fedavg.round_fn)(s_avg, DATA, jax.random.key(r))
        np.testing.assert_array_equal(metrics[r]["sampled"], m_avg["sampled"])
        tree_allclose(states[r + 1].body["Dense_0"], s_avg.params["Dense_0"], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(metrics[r]["train_loss"], m_avg["train_loss"], rtol=1e-6)


@pytest.mark.slow      # the loop backend runs the round eagerly
def test_backends_agree_and_round_fn_compiles_once():
    ref_states, _, ref_eval = run("loop", local_epochs=2, head_epochs=1, momentum=0.5,
                                  momentum_buffer="persist")
    for backend in ("vmap", "chunked"):
        extra = {"chunk_size": 1} if backend == "chunked" else {}
        states, _, ev = run(backend, local_epochs=2, head_epochs=1, momentum=0.5,
                            momentum_buffer="persist", **extra)
        tree_allclose(states[-1], ref_states[-1], rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(ev.correct, ref_eval.correct)


def test_config_errors():
    with pytest.raises(ValueError, match=r"--fedrep-head-epochs must be < --local-epochs \(2\)"):
        algorithms.get("fedrep", model=MLP, head_epochs=2)
    with pytest.raises(ValueError, match="--local-steps"):
        algorithms.get("fedrep", model=MLP, local_steps=5)
    with pytest.raises(ValueError, match="--fedrep-head-epochs must be >= 0"):
        algorithms.get("fedrep", model=MLP, head_epochs=-1)


def test_help_explains_the_flags():
    import run as cli

    text = " ".join(cli.build_parser().format_help().split())
    assert "--fedrep-head-epochs" in text and "the first τ_h train the head with the body frozen" in text
    assert "--fedrep-head" in text and "fedrep: FedRep:" in text

# -- Guard for FedRep (issue 30, item 10): the head phase and the body phase draw their own batch ----


GUARD_SIZES = [4, 4, 4]
FEATURES, CLASSES, LR = 3, 3, 0.8


def _error(w, b, x, y):
    logits = x @ w + b
    p = np.exp(logits - logits.max())
    return p / p.sum() - np.eye(CLASSES)[y]


def _head_after(order, w, b, x, y):
    for j in order:
        b = b - LR * _error(w, b, x[j], y[j])
    return b


def _body_after(order, w, b, x, y):
    for j in order:
        w = w - LR * np.outer(x[j], _error(w, b, x[j], y[j]))
    return w


def _unique_order(simulate, got):
    """The one permutation whose simulation gives `got`; the runner-up must be far off."""
    dist = sorted((np.abs(simulate(order) - got).max(), order)
                  for order in itertools.permutations(range(GUARD_SIZES[0])))
    (best, order), (second, _) = dist[0], dist[1]
    assert best < 1e-10 and second > 1e-8, (best, second)
    return order


@pytest.mark.slow
def test_the_head_phase_does_not_reuse_the_body_phases_batch_order(x64):
    data = make_data(GUARD_SIZES, num_classes=CLASSES, feature_dim=FEATURES, seed=4)
    x_raw, y_raw, train, _, _, _ = make_raw(GUARD_SIZES, num_classes=CLASSES, feature_dim=FEATURES, seed=4)
    algo = algorithms.get("fedrep", model=linear_model(FEATURES, CLASSES), head="^b$",
                          head_epochs=1, local_epochs=2, batch_size=1, lr=LR, momentum=0.0,
                          participation=1 / len(GUARD_SIZES))
    state = algo.init(jax.random.key(0), data)
    step = jax.jit(algo.round_fn)
    same = []
    for r in range(8):
        new, metrics = step(state, data, jax.random.key(r))
        (i,) = np.asarray(metrics["sampled"]).tolist()
        x = np.asarray(x_raw[train[i]], np.float64)
        y = y_raw[train[i]]
        w0 = np.asarray(state.body["w"], np.float64)
        b0 = np.asarray(state.heads["b"][i], np.float64)
        b1 = np.asarray(new.heads["b"][i], np.float64)
        w1 = np.asarray(new.body["w"], np.float64)
        head_order = _unique_order(lambda o: _head_after(o, w0, b0, x, y), b1)
        body_order = _unique_order(lambda o: _body_after(o, w0, b1, x, y), w1)
        same.append(head_order == body_order)
        state = new
    assert not all(same), "the head phase visited the samples in the body phase's order every round"
    assert sum(same) <= 2, same         # 8 rounds at 1/24 each: more than 2 has probability < 1 %
