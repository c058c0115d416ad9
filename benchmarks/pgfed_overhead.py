#!/usr/bin/env python
"""Where PGFedMo's time over FedAvg goes on PGFed's CNN protocol, and the floor that the
faithful full-data gradient pass puts under it (issue 13's "PGFed within 15 % of FedAvg").

    python benchmarks/pgfed_overhead.py --split iid --repeats 2
    python benchmarks/pgfed_overhead.py --split dirichlet --repeats 2 --batches 8 16 32 64

Per repetition, back to back on the same machine: one engine FedAvg round and one PGFedMo round
of the protocol (vs_pytorch.py's: preset pgfed_paper, the FedAvg CNN, 6 of 25 clients, 5 epochs
of batch 10; both algorithms sample the same clients), then PGFed's full-data pass alone
(`core.local.FullPass`, Algorithm 1 line C10, docs/algorithms/pgfed.md#a10) over the clients
PGFedMo just trained, at their final models, at each batch size of --batches. The round's PGFedMo
time splits into FedAvg's training, that pass, and the rest (the α step and auxiliary gradient on
every local step, the server's α/ḡ bookkeeping).

The floor: PGFedMo's round does FedAvg's training plus one forward and backward pass over every
sample a client holds, so its overhead is at least

    (samples in the full pass / samples trained) × (full pass's cost per sample / training's)

where a sample of the pass costs a forward and backward pass without the optimizer update (which
training shares among the samples of a batch). The last line prints that floor at the cheapest
batch measured.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vs_pytorch import _engine  # noqa: E402  (the protocol's run.py flags, one definition)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=("iid", "dirichlet"), default="iid")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved repetitions (one round each)")
    parser.add_argument("--batches", type=int, nargs="+", default=[0, 16, 32, 64],
                        help="full-pass batch sizes to time (0: the engine's automatic one)")
    parser.add_argument("--engine-args", default="", help="extra run.py flags for both algorithms")
    args = parser.parse_args(argv)

    import fedjax_pfl

    fedjax_pfl.use_cpu_cores()                       # as run.py: one XLA device per core
    import jax

    from fedjax_pfl import core, models
    from fedjax_pfl.core.local import FullPass

    extra = args.engine_args.split()
    preps = {algo: _engine(algo, args.split, extra) for algo in ("fedavg", "pgfedmo")}
    states = {}
    for algo, prep in preps.items():
        prep.program.compile(prep.round_keys)
        states[algo] = prep.program.init(jax.random.fold_in(prep.root, 0))
    pg = preps["pgfedmo"]
    model = models.get(pg.model_name, pg.data.input_shape, pg.data.num_classes,
                       cr=pg.cfg.model_cr, conv=pg.cfg.model_conv)
    passes = {b: FullPass(model, batch_size=b, mapper=core.client_mapper("chunked", 0)) for b in args.batches}
    batch = pg.hparams["batch_size"]

    rows = []
    for r in range(args.repeats + 1):                 # round 0 warms every program up
        times, sampled = {}, {}
        for algo, prep in preps.items():
            t0 = time.perf_counter()
            states[algo], metrics = prep.program.run_rounds(states[algo], prep.round_keys, r, 1)
            jax.block_until_ready(states[algo])
            times[algo] = time.perf_counter() - t0
            sampled[algo] = np.asarray(metrics[0]["sampled"])
            steps = int(np.sum(metrics[0]["client_steps"]))
        assert np.array_equal(np.sort(sampled["fedavg"]), np.sort(sampled["pgfedmo"]))
        idx = jax.numpy.asarray(sampled["pgfedmo"])
        theta = core.gather(states["pgfedmo"].clients.theta, idx)
        clients = core.gather(pg.data.clients, idx)
        full = {}
        for b, full_pass in passes.items():     # (compiled in round 0, which is not reported)
            t0 = time.perf_counter()
            jax.block_until_ready(full_pass(pg.data, theta, clients))
            full[b] = time.perf_counter() - t0
        n_full = int(np.sum(np.asarray(clients.train_count)))
        if r:
            rows.append((times["fedavg"], times["pgfedmo"], full, steps * batch, n_full))
            print(f"round {r}: fedavg {times['fedavg']:.2f} s, pgfedmo {times['pgfedmo']:.2f} s "
                  f"({steps} steps, {steps * batch} samples trained); full pass over {n_full} "
                  "samples: " + ", ".join(f"batch {b or 'auto'} {t:.2f} s" for b, t in full.items()),
                  flush=True)

    # Per round, then medians: on the Dirichlet split every round trains other clients.
    med = lambda values: float(np.median(list(values)))
    fed, pgf = med(row[0] for row in rows), med(row[1] for row in rows)
    overhead = med(row[1] / row[0] - 1 for row in rows)
    share = {b: med(row[2][b] / row[0] for row in rows) for b in args.batches}
    per_sample = {b: med((row[2][b] / row[4]) / (row[0] / row[3]) for row in rows) for b in args.batches}
    auto = args.batches[0]
    print(f"\n{args.split}, {jax.device_count()} device(s), medians of {len(rows)} rounds:")
    print(f"  FedAvg round {fed:.2f} s, PGFedMo {pgf:.2f} s: overhead {100 * overhead:+.1f} %")
    print(f"  of which the full pass (batch {auto or 'auto'}) {100 * share[auto]:.1f} % and the rest "
          f"(α steps, auxiliary gradient, server bookkeeping) {100 * (overhead - share[auto]):+.1f} %")
    for b in args.batches:
        print(f"  full pass at batch {b or 'auto'}: {100 * share[b]:.1f} % of FedAvg's round; a sample "
              f"costs {per_sample[b]:.2f} × a trained sample")
    ratio = med(row[4] / row[3] for row in rows)
    best = min(args.batches, key=share.get)
    print(f"  floor from the full pass alone (batch {best or 'auto'}): {ratio:.3f} samples per trained "
          f"sample × {per_sample[best]:.2f} = {100 * ratio * per_sample[best]:.1f} % over FedAvg")


if __name__ == "__main__":
    main()
