#!/usr/bin/env python
"""Round throughput of Reddi et al.'s (ICLR 2021) setups: FedAvg, FedAvgM, FedAdam and FedYogi
on the `reddi2021_*` presets, on synthetic clients of the real sets' shapes (issue 57, item 6).

    python benchmarks/reddi_throughput.py                                  # every task, 4 optimisers
    python benchmarks/reddi_throughput.py --tasks emnist shakespeare --rounds 4
    python benchmarks/reddi_throughput.py --tasks stackoverflow_nwp --opts sgd adam --json out.jsonl

The real files (TFF's HDF5 / FedJAX's SQLite) cannot be fetched here, and without them a preset
stops with the reader's line naming them. Each task's preset is read from
`experiments/configs/reddi2021_TASK.json` (model, batch, epochs and the client and server learning
rates of each `--server-opt` row, mapped to the library's names: `server_lr` → `server_opt_lr`, …),
and run on random data generated client by client and converted through the dataset cache as a
real file is (`benchmarks/natural.py`'s `SyntheticReader` and this file's `ShapeReader`):

  emnist             natural.py's femnist shape: 3,400 writers, 28×28×1, 62 classes,
                     lognormal sizes (mean 226), `femnist_cnn`
  shakespeare        natural.py's shakespeare shape: 715 roles, sequences of 80 characters
  stackoverflow_nwp  `--so-clients` (default 5,000; the real set has 342,477, which only the
                     memory of the resident data would notice) users of sentences of 20 tokens
                     over 10,004 ids, sizes lognormal (median 130, σ 1.5: stackoverflow_scale.py's
                     fit of the real sizes) clipped to 1,000 (the preset's `max_client_samples`)
  stackoverflow_tp   the same users' bags of ≤ 64 word ids (10,001 ids) → ≤ 5 of 500 tags
  cifar100           TFF's 500 clients of 100 images 32×32×3, 100 classes, `resnet18`

M (clients a round) is the published count (10, or 50 for NWP), participation = M / N. Each
optimiser's program is compiled, run `--rounds` rounds (the first is warm-up), and reported:
compile s, median steady round s, rounds/s, client-steps/s (the round's local steps over its time).
The optimiser changes only the server step (a few vector operations on the model), so the four
rows of a task should agree within the machine's noise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

TASKS = {   # task -> (clients a round, model)
    "emnist": (10, "femnist_cnn"),
    "shakespeare": (10, "char_lstm"),
    "stackoverflow_nwp": (50, "word_lstm"),
    "stackoverflow_tp": (10, "tag_logreg"),
    "cifar100": (10, "resnet18"),
}
OPTS = ("sgd", "momentum", "adam", "yogi")     # FedAvg, FedAvgM, FedAdam, FedYogi


class ShapeReader:
    """A `NaturalReader` of random Stack Overflow tag-prediction or CIFAR-100 clients."""

    def __init__(self, name: str, train, test, seed: int = 0):
        from fedjax_pfl.data.natural import SourceInfo, Task

        self.name, self.train, self.test, self.seed = name, train, test, seed
        if name == "stackoverflow_tp":
            self._task = Task(kind="multilabel", num_classes=500, inputs="tokens",
                              vocab_size=10001, topk=5, default_model="tag_logreg")
            self._source = SourceInfo("synthetic_so_tp", "synthetic", ())
        else:
            self._task = Task(kind="classify", num_classes=100, inputs="image",
                              default_model="resnet18")
            self._source = SourceInfo("synthetic_cifar100", "synthetic", (), input_scale=1 / 255)

    def task(self):
        return self._task

    def source(self):
        return self._source

    def _split(self, rng, n):
        import numpy as np

        if self.name == "cifar100":
            return (rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8),
                    rng.integers(0, 100, n).astype(np.int32))
        words = rng.integers(1, 10001, (n, 64)).astype(np.int32)
        words[np.arange(64)[None, :] >= rng.integers(5, 65, n)[:, None]] = 0      # 5..64 words
        tags = rng.integers(0, 500, (n, 5)).astype(np.int32)
        tags[np.arange(5)[None, :] >= rng.integers(1, 6, n)[:, None]] = -1       # 1..5 tags
        return words, tags

    def clients(self):
        import numpy as np

        from fedjax_pfl.data.natural import ClientBlock

        for i, (n, k) in enumerate(zip(self.train, self.test)):
            rng = np.random.default_rng((self.seed, i))
            yield ClientBlock(f"{self.name}_{i:06d}", *self._split(rng, int(n)),
                              *self._split(rng, int(k)))


def reader_for(task: str, so_clients: int):
    import natural
    import numpy as np

    if task == "emnist":
        return natural.SyntheticReader("femnist", 3400)
    if task == "shakespeare":
        return natural.SyntheticReader("shakespeare", 715)
    if task == "cifar100":
        return ShapeReader("cifar100", np.full(500, 100), np.full(500, 20))
    # Stack Overflow's users: stackoverflow_scale.py's fit, capped at the presets' 1,000 examples.
    natural.DATASETS["stackoverflow_reddi"] = dict(
        clients=so_clients, model="word_lstm", batch=16, test_frac=0.1,
        median=130.0, sigma=1.5, lo=1, hi=1000, seq=20, vocab=10004)
    if task == "stackoverflow_nwp":
        return natural.SyntheticReader("stackoverflow_reddi", so_clients)
    train, test = natural.client_sizes("stackoverflow_reddi", so_clients)
    return ShapeReader("stackoverflow_tp", train, test)


def preset_hparams(task: str, opt: str) -> dict:
    """The preset's training settings and its `opt` row, by the library's hyperparameter names."""
    with open(os.path.join(ROOT, "experiments", "configs", f"reddi2021_{task}.json")) as f:
        preset = json.load(f)
    hp = {"batch_size": preset["batch_size"], "local_epochs": preset["local_epochs"],
          "server_opt": opt}
    for key, value in preset["rows"][opt].items():
        hp[key if key == "lr" else key.replace("server_", "server_opt_")] = value
    return hp


def run_task(task: str, opts, rounds: int, so_clients: int, cache_root: str,
             json_path: str | None = None) -> list[dict]:
    import fedjax_pfl

    fedjax_pfl.use_cpu_cores()
    import jax
    import numpy as np

    from fedjax_pfl import runner
    from fedjax_pfl.data import cache, formats

    m, model = TASKS[task]
    cache_dir = os.path.join(cache_root, f"reddi_{task}_{so_clients}")
    if not os.path.exists(os.path.join(cache_dir, "meta.json")):
        cache.build(reader_for(task, so_clients), cache_dir)
    data = formats.to_federated(cache.open(cache_dir))
    n = data.num_real_clients
    rows = []
    for opt in opts:
        hp = preset_hparams(task, opt) | {"participation": m / n}
        prep = runner.prepare(runner.RunConfig(algo="fedavg", model=model, hparams=hp,
                                               progress=False, memory_check=False,
                                               data_placement="device",
                                               state_placement="device"), data=data)
        program, keys = prep.program, prep.round_keys
        compile_s = program.compile(keys)
        state = program.init(jax.random.fold_in(prep.root, 0))
        times, steps = [], []
        for r in range(rounds):
            t0 = time.perf_counter()
            state, metrics = program.run_rounds(state, keys, r, 1)
            jax.block_until_ready(state)
            times.append(time.perf_counter() - t0)
            steps.append(int(metrics[0]["client_steps"]))
        timed, tsteps = (times[1:], steps[1:]) if rounds > 1 else (times, steps)
        med = float(np.median(timed))
        row = dict(task=task, server_opt=opt, clients=n, clients_per_round=m, model=model,
                   hparams=hp, compile_s=compile_s, first_round_s=times[0], round_s=med,
                   round_s_range=[min(timed), max(timed)], rounds_per_s=1 / med,
                   client_steps_per_round=tsteps,
                   client_steps_per_s=float(np.median([s / t for s, t in zip(tsteps, timed)])),
                   devices=len(jax.devices()))
        print(f"{task:18s} {opt:9s} compile {compile_s:6.1f} s  round {med:7.3f} s "
              f"({row['rounds_per_s']:.3g} rounds/s)  {row['client_steps_per_s']:8.1f} client-steps/s",
              flush=True)
        if json_path:                  # each row as it is measured (a long task may be stopped)
            with open(json_path, "a") as f:
                f.write(json.dumps(row) + "\n")
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--opts", nargs="+", default=list(OPTS), choices=list(OPTS))
    p.add_argument("--rounds", type=int, default=3, help="rounds per optimiser; the first is warm-up")
    p.add_argument("--so-clients", type=int, default=5000,
                   help="Stack Overflow users generated (the round samples 50 or 10 of them)")
    p.add_argument("--cache-root", default=os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                        "fedjax_pfl_bench_natural"))
    p.add_argument("--json", default=None, help="append one JSON line per configuration here")
    a = p.parse_args()
    for task in a.tasks:
        run_task(task, a.opts, a.rounds, a.so_clients, a.cache_root, a.json)


if __name__ == "__main__":
    main()
