#!/usr/bin/env python
"""core.sum_over_clients / mean_over_clients as a dot with ones against the reduction over axis 0
they used before (XLA:CPU's reduction across rows is 20-80x slower; benchmarks/RESULTS.md §20).

    python benchmarks/client_sums.py feddyn        # or pgfedmo, scaffold, pfedsop

One algorithm's round, MLP, N = 400 synthetic Fashion-MNIST-shaped clients of 60 samples, M = 100,
both variants compiled in one process (the old functions patched in while tracing), 5 interleaved
repeats of 3 rounds; the median (range) of the per-repeat ratios old / new.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fedjax_pfl; fedjax_pfl.use_cpu_cores()
import jax, jax.numpy as jnp, numpy as np, time, statistics
from fedjax_pfl import algorithms, core, models
from fedjax_pfl.core import clients as C
from fedjax_pfl.data.federated import FederatedData
rng = np.random.default_rng(0)
n, s, t = 400, 60, 15
x = rng.integers(0, 256, (n*(s+t), 28, 28, 1), dtype=np.uint8); y = rng.integers(0, 10, n*(s+t)).astype(np.int32)
st = np.arange(n)*(s+t)
data = FederatedData.from_arrays(x, y, [np.arange(a, a+s) for a in st], [np.arange(a+s, a+s+t) for a in st], num_classes=10, input_scale=1/255)
model = models.get("mlp", data.input_shape, 10)
old_sum = lambda tree: jax.tree.map(lambda x: jnp.sum(x, axis=0), tree)
def old_mean(tree, weights=None):
    if weights is None: return jax.tree.map(lambda x: jnp.mean(x, axis=0), tree)
    return NEW_MEAN(tree, weights)
NEW_SUM, NEW_MEAN = core.sum_over_clients, core.mean_over_clients
algo_name = sys.argv[1] if len(sys.argv) > 1 else "feddyn"
progs = {}
for variant, (sm, mn) in (("axis-0 reduce", (old_sum, old_mean)), ("dot", (NEW_SUM, NEW_MEAN))):
    core.sum_over_clients, core.mean_over_clients = sm, mn
    algo = algorithms.get(algo_name, model=model, participation=0.25, batch_size=10)
    p = core.Program(algo, data, mesh=core.client_mesh())
    st_ = p.init(jax.random.key(0)); st_, _ = p.run_rounds(st_, jax.random.key(1), 0, 1); jax.block_until_ready(st_)
    progs[variant] = [p, st_]
core.sum_over_clients, core.mean_over_clients = NEW_SUM, NEW_MEAN
res = {k: [] for k in progs}
for rep in range(5):
    for k, e in progs.items():
        ts = []
        for r in range(3):
            t0 = time.perf_counter(); e[1], _ = e[0].run_rounds(e[1], jax.random.key(1), 1 + rep*3 + r, 1); jax.block_until_ready(e[1]); ts.append(time.perf_counter() - t0)
        res[k].append(statistics.median(ts))
ratios = [a / b for a, b in zip(res["axis-0 reduce"], res["dot"])]
print(algo_name, {k: round(statistics.median(v), 4) for k, v in res.items()}, "old/new median", round(statistics.median(ratios), 2), "range", round(min(ratios), 2), round(max(ratios), 2))
