"""Clients split across several XLA devices give the same results as the one-client loop.

Runs in a subprocess because the device count is fixed when JAX starts.
"""

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import json, os, sys
    sys.path.insert(0, "tests")
    import fedjax_pfl
    assert fedjax_pfl.use_cpu_cores(2) == 2
    import jax, numpy as np
    from fedjax_pfl import algorithms, core
    from helpers import linear_model, make_data
    assert len(jax.devices()) == 2
    data = make_data([7, 23, 12, 1, 9])          # 5 clients: M = 5 and 3 are odd (padding)
    out = {}
    for participation in (1.0, 0.6):
        runs = {}
        for backend in ("loop", "vmap", "chunked"):
            algo = algorithms.get("fedavg", model=linear_model(), backend=backend, chunk_size=2,
                                  participation=participation, local_epochs=2, batch_size=4, lr=0.1,
                                  momentum=0.9, momentum_buffer="persist")
            state = algo.init(jax.random.key(0), data)
            d = data
            if backend != "loop":
                d, state = core.replicate((data, state), core.client_mesh())
            step = algo.round_fn if backend == "loop" else jax.jit(algo.round_fn)
            for r in range(3):
                state, m = step(state, d, jax.random.key(r))
            runs[backend] = (state, m)
        ref = runs["loop"]
        for backend in ("vmap", "chunked"):
            for a, b in zip(jax.tree.leaves(runs[backend][0].params), jax.tree.leaves(ref[0].params)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
            np.testing.assert_allclose(runs[backend][1]["train_loss"], ref[1]["train_loss"], rtol=2e-5)
        out[str(participation)] = int(ref[1]["client_steps"])
    print(json.dumps(out))
''')


def test_sharded_backends_equal_loop_on_two_devices():
    env = {**os.environ, "FEDJAX_PFL_CPU_DEVICES": "2"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = json.loads(proc.stdout.strip().splitlines()[-1])
    # E = 2 epochs of ⌈n/4⌉ steps: all 5 clients take 2·(2 + 6 + 3 + 1 + 3) = 30 steps.
    assert steps["1.0"] == 30
