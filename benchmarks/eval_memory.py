"""Memory and time of evaluating every client's personal model (benchmarks/RESULTS.md §7).

A full evaluation of a personalised algorithm reads all N client models. This prints the compiled
evaluation's temporaries (XLA's memory analysis) beside the client state and the round's
temporaries, and the evaluation's median time, on synthetic Fashion-MNIST-shaped clients (5–39
training and 1–29 test samples each, seeded) with the 784-100-10 MLP:

    python benchmarks/eval_memory.py --algo ditto --clients 1000            # the machine's cores
    FEDJAX_PFL_CPU_DEVICES=1 python benchmarks/eval_memory.py --algo ditto --clients 1000
    python benchmarks/eval_memory.py --algo ditto --clients 1000 --skewed   # unequal devices

Run it from two checkouts (PYTHONPATH=...) to compare code versions; the printed sums of correct
predictions and losses must agree.
"""

import argparse
import time

import fedjax_pfl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algo", default="ditto")
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--participation", type=float, default=0.05)
    parser.add_argument("--chunk-size", type=int, default=0, help="0: automatic")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skewed", action="store_true",
                        help="test splits growing with the client id (1 to 59 samples): the "
                             "last devices' clients hold the most test samples")
    args = parser.parse_args()
    fedjax_pfl.use_cpu_cores()
    import jax
    import numpy as np

    from fedjax_pfl import algorithms, core, models
    from fedjax_pfl.data.federated import FederatedData

    rng = np.random.default_rng(0)
    train, test = rng.integers(5, 40, args.clients), rng.integers(1, 30, args.clients)
    if args.skewed:
        test = np.linspace(1, 59, args.clients).astype(int)
    n = int(train.sum() + test.sum())
    x = rng.normal(size=(n, 28, 28, 1)).astype(np.float32)
    y = rng.integers(0, 10, n).astype(np.int32)
    data = FederatedData.from_blocks(x, y, train, test, num_classes=10, name="synthetic")
    model = models.get("mlp", (28, 28, 1), 10)
    algo = algorithms.get(args.algo, model=model, participation=args.participation, batch_size=10,
                          chunk_size=args.chunk_size)
    mesh = core.client_mesh()
    data = core.prepare_data(data, mesh)
    program = core.Program(algo, data, mesh=mesh)
    state = program.init(jax.random.key(0))
    evaluate = jax.jit(lambda s: program.algo.evaluate(s, program.data))
    compiled = evaluate.lower(state).compile()
    round_fn = jax.jit(lambda s, k: program.algo.round_fn(s, program.data, k))
    round_temp = round_fn.lower(state, jax.random.key(1)).compile().memory_analysis().temp_size_in_bytes
    out = jax.block_until_ready(evaluate(state))
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(evaluate(state))
        times.append(time.perf_counter() - start)
    client = out["client"]
    mb = lambda b: f"{b / 2**20:,.0f} MB"
    print(f"{args.algo}, N = {args.clients}, {mesh.size if mesh is not None else 1} device(s): "
          f"client state {mb(sum(leaf.nbytes for leaf in jax.tree.leaves(state)))}, "
          f"evaluation temporaries {mb(compiled.memory_analysis().temp_size_in_bytes)}, "
          f"round temporaries {mb(round_temp)}; evaluation {np.median(times):.3f} s "
          f"(median of {args.repeats}, range {min(times):.3f}–{max(times):.3f}); "
          f"Σ correct {float(np.sum(np.asarray(client.correct))):.0f}, "
          f"Σ loss {float(np.sum(np.asarray(client.loss_sum))):.4f}")


if __name__ == "__main__":
    main()
