"""Data poisoning in local training (`Engine.train` with --attack label_flip / backdoor): a
malicious client trains exactly as the plain trainer does on its data poisoned by hand here in
NumPy (labels flipped, the trigger stamped), bit for bit; every benign client trains on its own
clean data."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import linear_model, make_raw

from fedjax_pfl.algorithms import engine as engine_lib
from fedjax_pfl.algorithms.engine import EngineConfig
from fedjax_pfl.data.federated import FederatedData

COMMON = {"batch_size": 4, "participation": 0.8, "lr": 0.1}
SIZES = [7, 12, 5, 9, 11, 6, 8, 10, 13, 4]
C = 3


def build(x, y, train, test):
    return FederatedData.from_arrays(x, y, train, test, num_classes=C, name="toy")


def poisoned_by_hand(kind, malicious, k=2, target=None):
    x, y, train, test, _, _ = make_raw(SIZES, num_classes=C, feature_dim=5)
    clean = build(x, y, train, test)
    x, y = x.copy(), y.copy()
    for i in np.flatnonzero(malicious):
        rows = train[i]                                     # the TRAIN rows only
        if kind == "label_flip":
            y[rows] = C - 1 - y[rows] if target is None else target
        else:                                               # backdoor on every example
            x[rows, -k:] = 1.0
            y[rows] = 0 if target is None else target
    return clean, build(x, y, train, test)


def params_rows(trained):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(trained.params)]


@pytest.mark.parametrize("kind,extra", [("label_flip", {}), ("label_flip", {"attack_target": 1}),
                                        ("backdoor", {"attack_poison_fraction": 1.0}),
                                        ("backdoor", {"attack_poison_fraction": 1.0,
                                                      "attack_target": 2,
                                                      "attack_trigger_size": 3})])
@pytest.mark.slow
def test_malicious_clients_train_on_their_poisoned_data(kind, extra):
    config = EngineConfig(**COMMON, attack=kind, attack_fraction=0.3, attack_seed=5, **extra)
    malicious = engine_lib.malicious_mask(0.3, 5, len(SIZES))
    clean, dirty = poisoned_by_hand(kind, malicious, k=extra.get("attack_trigger_size", 2),
                                    target=extra.get("attack_target"))
    model = linear_model()
    start = model.init(jax.random.key(0))
    attacked = engine_lib.Engine(model, config)
    plain = engine_lib.Engine(model, EngineConfig(**COMMON))
    key = jax.random.key(3)
    rnd = attacked.begin(clean, key)
    mal = np.asarray(rnd.malicious())
    assert mal.any() and not mal.all()
    got = params_rows(attacked.train(rnd, start, shared_start=True))
    on_dirty = params_rows(plain.train(plain.begin(dirty, key), start, shared_start=True))
    on_clean = params_rows(plain.train(plain.begin(clean, key), start, shared_start=True))
    for g, d, c in zip(got, on_dirty, on_clean, strict=True):
        np.testing.assert_array_equal(g[mal], d[mal])      # poisoned as by hand
        np.testing.assert_array_equal(g[~mal], c[~mal])    # benign: their clean training
        assert not np.array_equal(g[mal], c[mal])          # (and the poison did something)
