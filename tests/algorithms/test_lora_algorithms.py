"""Algorithms on LoRA adapters (models/lora.py): they train a tiny adapted model a few rounds
through `core.Program` with the base frozen; FFA-LoRA's A never moves; FedSA's split; FedDPA's
mixture against NumPy; privacy and server optimisers on adapters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_data

from fedjax_pfl import algorithms, core, models
from fedjax_pfl.algorithms import feddpa as feddpa_lib
from fedjax_pfl.models import lora
from fedjax_pfl.models import split as split_lib

F, HIDDEN, C = 6, 16, 3


def adapted_mlp(targets=("all",), rank=2, alpha=4.0):
    model = models.get("mlp", (F,), C, hidden=(HIDDEN,))
    base = model.init(jax.random.key(11))
    adapted, config = lora.lora(model, base, jnp.zeros((1, F)), targets=targets, rank=rank,
                                alpha=alpha)
    return adapted, base, config


def data():
    return make_data([30, 24, 40, 18, 26, 34], num_classes=C, feature_dim=F, seed=3)


def run(name, rounds=6, **hparams):
    adapted, base, _ = adapted_mlp()
    base_copy = jax.tree.map(np.array, base)
    hp = {"participation": 0.5, "batch_size": 8, "lr": 0.2, "local_epochs": 2, **hparams}
    algo = algorithms.get(name, model=adapted, **hp)
    program = core.Program(algo, data(), mesh=None)
    state = program.init(jax.random.key(0))
    # (host copies: the program donates a state's buffers to the next round)
    host = lambda st: jax.tree.map(
        lambda a: np.array(jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key)
                           else a), st)
    states, losses = [host(state)], []
    keys = jax.random.key(7)
    for r in range(rounds):
        state, metrics = program.run_rounds(state, keys, r, 1)
        states.append(host(state))
        losses.append(float(np.mean(metrics[0]["train_loss"])))
    for a, b in zip(jax.tree.leaves(base_copy), jax.tree.leaves(adapted.frozen.value),
                    strict=True):
        np.testing.assert_array_equal(a, b)                   # the base never changes
    for a, b in zip(jax.tree.leaves(base_copy),
                    jax.tree.leaves(program._frozen[adapted.frozen.key]), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    return program, states, losses, state


ADAPTER_ALGORITHMS = {
    "fedavg": {}, "fedprox": {"mu": 0.01}, "ditto": {}, "fedper": {}, "fedrep": {},
    "pfedsop": {}, "pgfed": {}, "ffa_lora": {}, "feddpa": {},
}


@pytest.mark.parametrize("name", sorted(ADAPTER_ALGORITHMS))
@pytest.mark.slow
def test_every_adapter_capable_algorithm_trains_the_adapters(name):
    program, states, losses, last = run(name, **ADAPTER_ALGORITHMS[name])
    assert losses[-1] < losses[0], losses
    # Nothing of the base's shapes is in the state: the base's kernels are [6, 16] and
    # [16, 3]; the adapters' leaves are [2, 6], [16, 2], [2, 16], [3, 2] (per client [N, ...]).
    shapes = {tuple(np.shape(a))[-2:] for a in jax.tree.leaves(states[-1])}
    assert (F, HIDDEN) not in shapes and (HIDDEN, C) not in shapes
    ev = program.evaluate(last)["client"]
    assert np.isfinite(np.asarray(ev.loss_sum)).all()


@pytest.mark.slow
def test_ffa_lora_keeps_a_at_its_initialisation_and_trains_b():
    _, states, _, _ = run("ffa_lora")
    first, last = states[0].params, states[-1].params
    for layer in ("Dense_0", "Dense_1"):
        np.testing.assert_array_equal(np.asarray(first[layer]["lora_A"]),
                                      np.asarray(last[layer]["lora_A"]))
        assert not np.any(np.asarray(first[layer]["lora_B"]))        # B starts at 0 ...
        assert np.abs(np.asarray(last[layer]["lora_B"])).max() > 0   # ... and is trained


@pytest.mark.slow
def test_fedsa_split_shares_a_and_keeps_b_per_client():
    adapted, _, _ = adapted_mlp()
    template = jax.eval_shape(adapted.init, jax.random.key(0))
    assert split_lib.head_pattern(template) == r"(^|/)lora_B$"
    mask = split_lib.personal_mask(template, "head")
    paths = split_lib.leaf_paths(template)
    assert [p for p, m in zip(paths, jax.tree.leaves(mask)) if m] == ["Dense_0/lora_B",
                                                                       "Dense_1/lora_B"]
    _, states, _, _ = run("fedper")
    heads = states[-1].heads
    assert heads["Dense_0"]["lora_A"] is None and heads["Dense_0"]["lora_B"].shape[0] == 6
    # B differs between the clients a round trained; A is one shared matrix.
    b = np.asarray(heads["Dense_1"]["lora_B"])
    assert len({b[i].tobytes() for i in range(len(b))}) > 1
    assert states[-1].body["Dense_1"]["lora_A"].ndim == 2


def test_feddpa_mixes_the_two_adapters_outputs_against_numpy():
    """One adapted layer (the head): logits = h W1 + b1 + (α/r)((1−λ) h A_gᵀ B_gᵀ + λ h A_lᵀ
    B_lᵀ), h = relu(x W0 + b0)."""
    adapted, base, config = adapted_mlp(targets=("Dense_1",), rank=2, alpha=3.0)
    rng = np.random.default_rng(0)
    g = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), jnp.float32),
                     adapted.init(jax.random.key(1)))
    loc = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), jnp.float32), g)
    lam = 0.3
    mixed = feddpa_lib.mixture(adapted, lam)
    x = rng.normal(size=(4, F))
    got = mixed.apply({"global": g, "local": loc}, jnp.asarray(x, jnp.float32))
    f = lambda a: np.asarray(a, np.float64)
    h = np.maximum(x @ f(base["Dense_0"]["kernel"]) + f(base["Dense_0"]["bias"]), 0)
    s = 3.0 / 2
    term = lambda ad: s * (h @ f(ad["Dense_1"]["lora_A"]).T) @ f(ad["Dense_1"]["lora_B"]).T
    want = (h @ f(base["Dense_1"]["kernel"]) + f(base["Dense_1"]["bias"])
            + (1 - lam) * term(g) + lam * term(loc))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def _np_feddpa_logits(base, g, loc, x, lam, s):
    """The adapted MLP (both layers adapted) with the adapters mixed at per-example λ [B]."""
    f = lambda a: np.asarray(a, np.float64)
    lam = np.asarray(lam, np.float64).reshape(-1, 1)

    def layer(h, name, weights):
        out = h @ f(base[name]["kernel"]) + f(base[name]["bias"])
        for w, ad in weights:
            out = out + w * s * (h @ f(ad[name]["lora_A"]).T) @ f(ad[name]["lora_B"]).T
        return out

    h = np.maximum(layer(x, "Dense_0", [(1 - lam, g), (lam, loc)]), 0)
    return layer(h, "Dense_1", [(1 - lam, g), (lam, loc)])


@pytest.mark.slow
def test_feddpa_evaluates_each_instance_at_its_similarity_to_the_clients_data_against_numpy():
    """--feddpa-weighting instance: client i's test input x is scored by the mixture at
    λ(x) = clip(w · mean_j cos(h_l(x), h_l(x_j)), 0, 1), h_l the hidden layer (the MLP's
    features) under the local adapter alone, x_j its K training inputs at positions ⌊j·n/K⌋."""
    program, _, _, state = run("feddpa", rounds=2, refs=3, scale=0.9)
    adapted, base, _ = adapted_mlp()
    d = data()
    ev = program.evaluate(state)["client"]
    f = lambda a: np.asarray(a, np.float64)
    g = jax.tree.map(f, state.params)
    x_all, y_all = f(d.x), np.asarray(d.y)
    s = 4.0 / 2
    lams = []
    for i in range(d.num_clients):
        loc = jax.tree.map(lambda a: f(a)[i], state.local)
        hidden = lambda x: np.maximum(
            x @ f(base["Dense_0"]["kernel"]) + f(base["Dense_0"]["bias"])
            + s * (x @ f(loc["Dense_0"]["lora_A"]).T) @ f(loc["Dense_0"]["lora_B"]).T, 0)
        unit = lambda h: h / np.linalg.norm(h, axis=1, keepdims=True)
        n, start = int(d.clients.train_count[i]), int(d.clients.train_start[i])
        refs = x_all[start + np.array([j * n // 3 for j in range(3)])]
        c = unit(hidden(refs)).mean(axis=0)
        t0, m = int(d.clients.test_start[i]), int(d.clients.test_count[i])
        x, y = x_all[t0:t0 + m], y_all[t0:t0 + m]
        lam = np.clip(0.9 * unit(hidden(x)) @ c, 0, 1)
        lams.append(lam)
        logits = _np_feddpa_logits(base, g, loc, x, lam, s)
        assert int(ev.correct[i]) == int((logits.argmax(1) == y).sum()), i
        lp = logits - logits.max(1, keepdims=True)
        lp = lp - np.log(np.exp(lp).sum(1, keepdims=True))
        np.testing.assert_allclose(float(ev.loss_sum[i]), -lp[np.arange(m), y].sum(), rtol=1e-4)
    lams = np.concatenate(lams)
    assert 0 < lams.min() < lams.max() < 1, (lams.min(), lams.max())   # really per instance


@pytest.mark.slow
def test_feddpa_fixed_weighting_evaluates_at_lambda():
    program, _, _, state = run("feddpa", rounds=1, weighting="fixed", lam=0.3)
    _, base, _ = adapted_mlp()
    d = data()
    ev = program.evaluate(state)["client"]
    f = lambda a: np.asarray(a, np.float64)
    g = jax.tree.map(f, state.params)
    for i in range(d.num_clients):
        loc = jax.tree.map(lambda a: f(a)[i], state.local)
        t0, m = int(d.clients.test_start[i]), int(d.clients.test_count[i])
        logits = _np_feddpa_logits(base, g, loc, f(d.x)[t0:t0 + m], np.full(m, 0.3), 4.0 / 2)
        assert int(ev.correct[i]) == int((logits.argmax(1) == np.asarray(d.y)[t0:t0 + m]).sum())


@pytest.mark.slow
def test_feddpa_keeps_a_local_adapter_per_client_and_averages_the_global_one():
    _, states, _, _ = run("feddpa")
    local = np.asarray(states[-1].local["Dense_1"]["lora_B"])
    trained = [i for i in range(6) if np.abs(local[i]).max() > 0]
    assert len(trained) >= 2 and len({local[i].tobytes() for i in trained}) == len(trained)
    assert np.abs(np.asarray(states[-1].params["Dense_1"]["lora_B"])).max() > 0


@pytest.mark.slow
def test_a_private_round_clips_the_adapter_update():
    """DP-FedAvg on adapters without noise: the server's step is the mean of the clients'
    updates each clipped to ‖·‖ ≤ C, so its norm is at most C."""
    clip = 0.05
    _, states, _, _ = run("fedavg", rounds=2, dp_clip=clip, dp_noise_multiplier=0.0)
    for before, after in zip(states[:-1], states[1:]):
        step = jax.tree.map(lambda a, b: np.asarray(b, np.float64) - np.asarray(a, np.float64),
                            before.params, after.params)
        norm = np.sqrt(sum(np.sum(v ** 2) for v in jax.tree.leaves(step)))
        assert 0 < norm <= clip * (1 + 1e-5)


@pytest.mark.slow
def test_a_server_optimiser_steps_the_adapters():
    """FedAvgM's server momentum lives on the adapters' shapes (never the base's)."""
    _, states, losses, _ = run("fedavg", rounds=6, server_opt="momentum", server_opt_lr=0.5)
    assert losses[-1] < losses[0]
    shapes = sorted(tuple(np.shape(a)) for a in jax.tree.leaves(states[-1].server))
    assert shapes and set(shapes) <= {(2, F), (HIDDEN, 2), (2, HIDDEN), (C, 2), ()}


def test_ffa_lora_round_against_numpy_gradient_descent_on_b_with_a_fixed():
    """One round, three full-batch local steps (lr η) on the head's adapter: each sampled client
    runs B ← B − η ∇_B L_i three times with A = A_0 fixed (A's own gradient s Bᵀ(P − Y)ᵀH/n
    is 0 at B = 0, so a trained A would first move at step 2 and show at step 3),
    ∇_B L_i = (α/r) (P − Y)ᵀ (H A_0ᵀ) / n_i for the frozen features H = relu(X W0 + b0),
    P = softmax(H W1 + b1 + (α/r) H A_0ᵀ Bᵀ);
    the server's B is Σ n_i B_i / Σ n_i. In float64 NumPy."""
    adapted, base, config = adapted_mlp(targets=("Dense_1",), rank=2, alpha=3.0)
    fed = data()
    lr = 0.5
    algo = algorithms.get("ffa_lora", model=adapted, participation=0.5, batch_size=64, lr=lr,
                          local_steps=3)
    program = core.Program(algo, fed, mesh=None)
    state = program.init(jax.random.key(0))
    a0 = np.asarray(state.params["Dense_1"]["lora_A"], np.float64)
    state, metrics = program.run_rounds(state, jax.random.key(7), 0, 1)
    f = lambda v: np.asarray(v, np.float64)
    w0, b0 = f(base["Dense_0"]["kernel"]), f(base["Dense_0"]["bias"])
    w1, b1 = f(base["Dense_1"]["kernel"]), f(base["Dense_1"]["bias"])
    s = config.scale
    x, y = f(fed.x), np.asarray(fed.y)
    total, weighted = 0, np.zeros((C, 2))
    for i in np.asarray(metrics[0]["sampled"]):
        start, n = int(fed.clients.train_start[i]), int(fed.clients.train_count[i])
        h = np.maximum(x[start:start + n] @ w0 + b0, 0)
        onehot = np.eye(C)[y[start:start + n]]
        b = np.zeros((C, 2))
        for _ in range(3):
            logits = h @ w1 + b1 + s * (h @ a0.T) @ b.T
            p = np.exp(logits - logits.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            b = b - lr * s * (p - onehot).T @ (h @ a0.T) / n
        weighted += n * b
        total += n
    np.testing.assert_allclose(state.params["Dense_1"]["lora_B"], weighted / total, rtol=2e-4,
                               atol=1e-6)
    np.testing.assert_array_equal(np.asarray(state.params["Dense_1"]["lora_A"]), a0)
