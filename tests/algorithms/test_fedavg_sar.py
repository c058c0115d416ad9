"""Guard for FedAvg (s.a.r.) (issue 30, item 10): the uplink draws its OWN random mask, a fresh
one independent of the downlink's (module docstring: "m'_i another fresh mask").

Setting: one client, mask_fill="zero", and a model whose loss is identically 0, so local
training returns exactly the model it received. The round then gives the server

    w_new = m' ⊙ (m ⊙ w),

so w_new equals w on the coordinates both masks kept and is 0 elsewhere. With independent masks
each coordinate survives with probability 1/CR² (closed form; "fixed" masks: the overlap of two
independent random subsets of size d/CR, mean (d/CR)²/d); an uplink that reuses the downlink's
mask keeps 1/CR of them, and one that sends the complement keeps none."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_data

from fedjax_pfl import algorithms
from fedjax_pfl.models.model import Model

FEATURES, CLASSES = 20, 10           # d = 20·10 + 10 = 210 coordinates


def _frozen_linear_model():
    """Softmax-regression shapes with a loss that is identically zero: training moves nothing."""

    def init(key):
        kw, kb = jax.random.split(key)
        # Entries bounded away from 0, so a kept coordinate is never mistaken for a dropped one.
        sign = lambda k, shape: jnp.where(jax.random.bernoulli(k, 0.5, shape), 1.0, -1.0)
        return {"w": sign(kw, (FEATURES, CLASSES)) * (1.0 + jax.random.uniform(kw, (FEATURES, CLASSES))),
                "b": sign(kb, (CLASSES,)) * 1.5}

    return Model(init=init, apply=lambda p, x: x.reshape(x.shape[0], -1) @ p["w"] + p["b"],
                 loss=lambda out, y: 0.0 * jnp.sum(out, axis=-1), name="frozen")


@pytest.mark.parametrize("mask", ["fixed", "bernoulli"])
def test_the_uplink_mask_is_drawn_independently_of_the_downlink_mask(mask):
    cr, rounds = 2.0, 24
    data = make_data([12], num_classes=CLASSES, feature_dim=FEATURES)
    algo = algorithms.get("fedavg_sar", model=_frozen_linear_model(), cr=cr, mask_fill="zero",
                          mask=mask, participation=1.0, lr=0.1, batch_size=4)
    state = algo.init(jax.random.key(0), data)
    w = np.concatenate([np.ravel(state.params["w"]), np.ravel(state.params["b"])])
    d = w.size
    step = jax.jit(algo.round_fn)
    kept_fractions, up_floats, down_floats = [], [], []
    for r in range(rounds):                       # each round from the same state, fresh keys
        new, metrics = step(state, data, jax.random.key(100 + r))
        got = np.concatenate([np.ravel(new.params["w"]), np.ravel(new.params["b"])])
        kept = got != 0
        # The value: exactly w where kept (the one client's weight is 1), exactly 0 elsewhere.
        np.testing.assert_array_equal(got[kept], w[kept])
        kept_fractions.append(kept.mean())
        up_floats.append(float(metrics["comm_up_floats"]))
        down_floats.append(float(metrics["comm_down_floats"]))
    if mask == "fixed":               # each transmission sends exactly round(d/CR) values
        np.testing.assert_array_equal(up_floats, round(d / cr))
        np.testing.assert_array_equal(down_floats, round(d / cr))
    # Independent masks: E[kept] = 1/CR² = 0.25 (fixed: 105²/210/210 = 0.25 as well). The mean
    # of 24 rounds has standard deviation ≈ 0.006, so 0.25 ± 0.04 is > 6σ; a reused mask gives
    # 0.5, a complementary one 0.
    assert abs(np.mean(kept_fractions) - 1 / cr**2) < 0.04, np.mean(kept_fractions)
    # And within a round the two masks are not tied either: no round keeps all of the 1/CR sent.
    assert max(kept_fractions) < 0.4, kept_fractions
