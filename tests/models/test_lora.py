"""LoRA as a model transformation (models/lora.py) against NumPy float64 references."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfl import models
from fedjax_pfl.models import lora
from fedjax_pfl.models.model import training_key
from fedjax_pfl.models.tasks import Task

D_IN, HIDDEN, CLASSES = 6, 8, 4


def mlp():
    model = models.get("mlp", (D_IN,), CLASSES, hidden=(HIDDEN,))
    base = model.init(jax.random.key(0))
    return model, base


def transformer(vocab=11, length=7):
    task = Task(kind="sequence", num_classes=vocab, inputs="tokens", vocab_size=vocab)
    model = models.get("transformer", (length,), vocab, task=task,
                       options={"width": 16, "heads": 2, "layers": 2})
    base = model.init(jax.random.key(0))
    x = jnp.asarray(np.random.default_rng(0).integers(1, vocab, (3, length)), jnp.int32)
    return model, base, x


def random_b(adapters, seed=1):
    """The adapters with B drawn at random (B = 0 at initialisation hides every B-term)."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda p, a: jnp.asarray(rng.normal(size=a.shape), jnp.float32)
        if jax.tree_util.keystr(p).endswith("'lora_B']") else a, adapters)


@pytest.mark.slow
def test_the_adapted_model_at_initialisation_is_the_base():
    model, base = mlp()
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, D_IN)), jnp.float32)
    adapted, _ = lora.lora(model, base, x, targets=["all"], rank=2, alpha=4.0)
    adapters = adapted.init(jax.random.key(3))
    np.testing.assert_array_equal(adapted.apply(adapters, x), model.apply(base, x))

    tmodel, tbase, tokens = transformer()
    tadapted, config = lora.lora(tmodel, tbase, tokens, targets=["qkv", "attn_out"], rank=2,
                                 alpha=8.0)
    assert config.targets == ("Block_0/qkv", "Block_0/attn_out", "Block_1/qkv",
                              "Block_1/attn_out")
    np.testing.assert_array_equal(tadapted.apply(tadapted.init(jax.random.key(4)), tokens),
                                  tmodel.apply(tbase, tokens))


@pytest.mark.slow
def test_the_forward_pass_against_numpy():
    """MLP: h = relu(x W0 + b0 + s x A0ᵀ B0ᵀ), out = h W1 + b1 + s h A1ᵀ B1ᵀ, s = α/r."""
    model, base = mlp()
    x = np.random.default_rng(2).normal(size=(5, D_IN))
    r, alpha = 3, 5.0
    adapted, _ = lora.lora(model, base, jnp.asarray(x, jnp.float32), targets=["Dense_0", "Dense_1"],
                           rank=r, alpha=alpha)
    adapters = random_b(adapted.init(jax.random.key(3)))
    f64 = lambda a: np.asarray(a, np.float64)
    s = alpha / r
    w0, b0, w1, b1 = (f64(base["Dense_0"]["kernel"]), f64(base["Dense_0"]["bias"]),
                      f64(base["Dense_1"]["kernel"]), f64(base["Dense_1"]["bias"]))
    a0, bb0 = f64(adapters["Dense_0"]["lora_A"]), f64(adapters["Dense_0"]["lora_B"])
    a1, bb1 = f64(adapters["Dense_1"]["lora_A"]), f64(adapters["Dense_1"]["lora_B"])
    assert a0.shape == (r, D_IN) and bb0.shape == (HIDDEN, r)
    h = np.maximum(x @ w0 + b0 + s * (x @ a0.T) @ bb0.T, 0.0)
    want = h @ w1 + b1 + s * (h @ a1.T) @ bb1.T
    got = adapted.apply(adapters, jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # Only the targeted layer is adapted.
    only0, _ = lora.lora(model, base, jnp.asarray(x, jnp.float32), targets=["Dense_0"],
                         rank=r, alpha=alpha)
    ad0 = random_b(only0.init(jax.random.key(3)))
    h0 = np.maximum(x @ w0 + b0 + s * (x @ f64(ad0["Dense_0"]["lora_A"]).T)
                    @ f64(ad0["Dense_0"]["lora_B"]).T, 0.0)
    np.testing.assert_allclose(only0.apply(ad0, jnp.asarray(x, jnp.float32)), h0 @ w1 + b1,
                               rtol=2e-5, atol=2e-5)
    assert set(ad0) == {"Dense_0"}


@pytest.mark.slow
def test_the_merged_weights_are_w_plus_scaled_ba_and_give_the_same_logits():
    tmodel, tbase, tokens = transformer()
    adapted, config = lora.lora(tmodel, tbase, tokens, targets=["qkv", "mlp_out"], rank=2,
                                alpha=3.0)
    adapters = random_b(adapted.init(jax.random.key(5)))
    merged = lora.merged(tbase, adapters, config)
    for path in config.targets:
        a, b = (np.asarray(t, np.float64) for t in lora.adapter_of(adapters, path))
        w = np.asarray(lora._subtree(tbase, tuple(path.split("/")))["kernel"], np.float64)
        want = w + (3.0 / 2) * (b @ a).T
        np.testing.assert_allclose(lora._subtree(merged, tuple(path.split("/")))["kernel"], want,
                                   rtol=1e-6, atol=1e-6)
    # the base itself is untouched
    assert not np.array_equal(np.asarray(merged["Block_0"]["qkv"]["kernel"]),
                              np.asarray(tbase["Block_0"]["qkv"]["kernel"]))
    np.testing.assert_allclose(tmodel.apply(merged, tokens), adapted.apply(adapters, tokens),
                               rtol=1e-4, atol=1e-4)


def test_peft_default_initialisation():
    """A ~ U(−1/√d_in, 1/√d_in) (kaiming_uniform, a = √5, of [r, d_in]); B = 0; seeded."""
    model = models.get("mlp", (400,), CLASSES, hidden=(300,))
    base = model.init(jax.random.key(0))
    adapted, _ = lora.lora(model, base, jnp.zeros((1, 400)), targets=["Dense_0"], rank=16,
                           alpha=16)
    a = np.asarray(adapted.init(jax.random.key(1))["Dense_0"]["lora_A"], np.float64)
    bound = 1 / np.sqrt(400)
    assert a.shape == (16, 400) and np.abs(a).max() <= bound
    # the uniform's std bound/√3 and mean 0, over 6,400 draws (5 standard errors)
    assert abs(a.std() - bound / np.sqrt(3)) < 5 * bound / np.sqrt(3) / np.sqrt(2 * a.size)
    assert abs(a.mean()) < 5 * bound / np.sqrt(3) / np.sqrt(a.size)
    b = adapted.init(jax.random.key(1))["Dense_0"]["lora_B"]
    assert b.shape == (300, 16) and not np.any(b)
    assert not np.array_equal(a, adapted.init(jax.random.key(2))["Dense_0"]["lora_A"])


@pytest.mark.slow
def test_dropout_is_inverted_and_acts_in_training_only():
    """With a step key bound, each input of the low-rank term is kept w.p. 1 − p and scaled by
    1/(1 − p): over many keys the mean output is the output without dropout; without a key
    (evaluation) it is that output exactly."""
    model, base = mlp()
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, D_IN)), jnp.float32)
    adapted, _ = lora.lora(model, base, x, targets=["Dense_1"], rank=2, alpha=2.0, dropout=0.5)
    plain, _ = lora.lora(model, base, x, targets=["Dense_1"], rank=2, alpha=2.0)
    assert adapted.train_key and not plain.train_key
    adapters = random_b(adapted.init(jax.random.key(3)))
    no_drop = np.asarray(plain.apply(adapters, x), np.float64)
    np.testing.assert_array_equal(adapted.apply(adapters, x), no_drop.astype(np.float32))

    def with_key(k):
        with training_key(k):
            return adapted.apply(adapters, x)

    outs = np.asarray(jax.vmap(with_key)(jax.random.split(jax.random.key(9), 4000)), np.float64)
    assert np.abs(outs - no_drop).max() > 1e-3          # dropout did something
    stderr = outs.std(0) / np.sqrt(len(outs))
    assert np.all(np.abs(outs.mean(0) - no_drop) < 5 * stderr + 1e-6)


def test_unknown_targets_and_bad_settings_are_one_line():
    model, base = mlp()
    x = jnp.zeros((1, D_IN))
    with pytest.raises(ValueError, match=r"'q_proj' names no dense module; the model's dense "
                                         r"modules are Dense_0, Dense_1"):
        lora.lora(model, base, x, targets=["q_proj"], rank=2, alpha=1)
    with pytest.raises(ValueError, match="--lora-rank must be"):
        lora.lora(model, base, x, targets=["all"], rank=0, alpha=1)
    with pytest.raises(ValueError, match="--lora-rank 5 exceeds Dense_1"):
        lora.lora(model, base, x, targets=["all"], rank=5, alpha=1)
    with pytest.raises(ValueError, match="--lora-dropout"):
        lora.lora(model, base, x, targets=["all"], rank=2, alpha=1, dropout=1.0)


@pytest.mark.slow
def test_adapter_gradients_against_finite_differences():
    """∂loss/∂(A, B) of the adapted model against central differences, in float64 (a
    subprocess with x64 on)."""
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        jax.config.update("jax_enable_x64", True)
        from fedjax_pfl import models
        from fedjax_pfl.models import lora
        model = models.get("mlp", (5,), 3, hidden=(4,))
        base = jax.tree.map(lambda a: a.astype(jnp.float64), model.init(jax.random.key(0)))
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.normal(size=(6, 5)))
        y = jnp.asarray(rng.integers(0, 3, 6))
        adapted, _ = lora.lora(model, base, x, targets=["all"], rank=2, alpha=3.0)
        ad = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape)),
                          adapted.init(jax.random.key(1)))
        loss = lambda p: jnp.mean(adapted.loss(adapted.apply(p, x), y))
        grads = jax.grad(loss)(ad)
        flat, unravel = jax.flatten_util.ravel_pytree(ad)
        g = jax.flatten_util.ravel_pytree(grads)[0]
        assert flat.dtype == jnp.float64 and g.shape == flat.shape
        eps = 1e-6
        fd = np.array([(loss(unravel(flat.at[i].add(eps))) - loss(unravel(flat.at[i].add(-eps))))
                       / (2 * eps) for i in range(flat.size)])
        np.testing.assert_allclose(np.asarray(g), fd, rtol=1e-6, atol=1e-8)
        assert np.abs(fd).max() > 1e-3
        print("ok", flat.size)
    """)
    env = {**os.environ, "JAX_ENABLE_X64": "1"}
    out = subprocess.run([sys.executable, "-c", "import jax.flatten_util\n" + script],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok")
