"""The engine against an idiomatic PyTorch FedAvg loop on PGFed's own protocol, interleaved.

    pip install torch==2.13.0        # benchmark-only; the CPU wheel (also: pip install -e ".[bench]")
    python benchmarks/vs_pytorch.py --split iid
    python benchmarks/vs_pytorch.py --split dirichlet --algos fedavg pgfedmo --repeats 3
    # on a GPU machine (both sides on the GPU; M = 25 and 100 clients per round):
    python benchmarks/vs_pytorch.py --torch-device cuda --torch-data loader resident \
        --engine-args "--participation 1.0 --clients 100"

Protocol (issue 13; preset pgfed_paper with the FedAvg CNN): Fashion-MNIST, 25 clients, 75/25
train/test per client, 6 sampled per round, 5 local epochs of batch 10 with drop_last, SGD lr
0.005 momentum 0.9 with a per-client persistent buffer, evaluation of all 25 clients every round
(the engine's as its runner does it: a personalised model is evaluated again only once a round
has changed it, `core.CachedEvaluation`; PyTorch FedAvg has none).
`--split iid` gives every client 2,100 training samples; `--split dirichlet` is the preset's
class-wise Dir(0.3) split (574-3,430). Both sides get the identical client data and the same
sampled clients (the engine's).

PyTorch side: what a researcher writes — a DataLoader per client (shuffle, drop_last), one model
and one torch.optim.SGD per client (kept across rounds, so momentum persists as in the preset),
weighted averaging of state_dicts, evaluation in batches of 256 under no_grad;
`torch.set_num_threads(--torch-threads)`. With `--torch-device cuda` the models and optimizers
live on the GPU and each batch is moved there (`--torch-data loader`, the tutorial pattern), or
the client data is moved once and batches are drawn on the GPU with `torch.randperm`
(`--torch-data resident`, what a researcher tuning for a GPU writes); both can be timed in one
run. Engine side: the same Program `experiments/run.py`
builds for `--preset pgfed_paper --model cnn --algo A` (2 XLA:CPU devices by default), compiled
once before timing. `--engine-args` changes the protocol for both sides, e.g. `--clients 100
--participation 1.0` for M = 100 clients per round (700 samples per client on Fashion-MNIST's 70,000).

Each repetition times `--rounds` rounds of every side back to back (PyTorch, then each engine
algorithm), so slow phases of the machine hit all sides alike; the table reports medians over
repetitions: ms per local step (training time / steps), training and evaluation seconds per round.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def protocol_program(algo: str, split: str, extra: list[str]):
    """`runner.prepare` of the protocol's run.py flags for `algo` (then `extra`, which win): the
    program `python experiments/run.py --preset pgfed_paper --dataset fashion_mnist --model cnn`
    builds; `split` "iid" adds `--partition iid`."""
    from experiments import run as cli
    from fedjax_pfl import runner

    argv = ["--algo", algo, "--preset", "pgfed_paper", "--dataset", "fashion_mnist", "--model", "cnn",
            "--quiet", "--no-memory-check"] + (["--partition", "iid"] if split == "iid" else []) + extra
    return runner.prepare(cli.config_from_args(cli.parse(argv)))


def warm_evaluation(program, state):
    """The runner's evaluation (`core.CachedEvaluation`: personalised models only where a round
    changed them) with its programs compiled (its first call evaluates everyone with them)."""
    import jax

    from fedjax_pfl import core

    # The compiled round returns every leaf strongly typed, while init leaves Python-scalar
    # fills weak (PGFed's α): warm on the round's types, or round 1 would compile again.
    state = jax.tree.map(lambda x: jax.lax.convert_element_type(x, x.dtype)
                         if getattr(x, "weak_type", False) else x, state)
    evaluate = core.CachedEvaluation(program)
    jax.block_until_ready(evaluate(state))
    return evaluate


def _client_arrays(data):
    """Per-client (x_train, y_train, x_test, y_test) as float32 NCHW numpy, normalised as the
    engine's model sees them."""
    x = np.asarray(data.x, np.float32) * data.input_scale + data.input_shift
    x = np.transpose(x, (0, 3, 1, 2))
    y = np.asarray(data.y, np.int64)
    c = data.clients
    out = []
    for i in range(data.num_real_clients):
        tr = slice(int(c.train_start[i]), int(c.train_start[i] + c.train_count[i]))
        te = slice(int(c.test_start[i]), int(c.test_start[i] + c.test_count[i]))
        out.append((x[tr], y[tr], x[te], y[te]))
    return out


class TorchFedAvg:
    """Idiomatic PyTorch FedAvg with the preset's hyperparameters."""

    def __init__(self, clients, lr, momentum, epochs, batch, threads, seed=0, device="cpu",
                 resident=False):
        import torch
        from torch import nn

        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.torch, self.nn = torch, nn
        self.device = torch.device(device)
        self.resident = resident
        # Training data stays on the host for the DataLoader (moved batch by batch); resident data
        # and the test data live on the training device.
        train_on = self.device if resident else torch.device("cpu")
        self.clients = [tuple(torch.from_numpy(v).to(on) for v, on in zip(c, (train_on, train_on, self.device, self.device)))
                        for c in clients]
        self.epochs, self.batch = epochs, batch
        self.global_model = self._cnn(clients[0][0].shape[1], 10).to(self.device)
        self.models = [self._cnn(clients[0][0].shape[1], 10).to(self.device) for _ in clients]
        self.opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum) for m in self.models]

    def sync(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def _batches(self, x, y):
        torch = self.torch
        if self.resident:
            order = torch.randperm(len(y), device=self.device)
            for j in range(0, len(y) - self.batch + 1, self.batch):    # drop_last
                idx = order[j:j + self.batch]
                yield x[idx], y[idx]
            return
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                             batch_size=self.batch, shuffle=True, drop_last=True)
        for xb, yb in loader:
            yield xb.to(self.device, non_blocking=True), yb.to(self.device, non_blocking=True)

    def _cnn(self, channels, classes):
        nn = self.nn
        return nn.Sequential(nn.Conv2d(channels, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                             nn.Linear(64 * 4 * 4, 512), nn.ReLU(), nn.Linear(512, classes))

    def train_round(self, sampled) -> int:
        loss_fn = self.nn.CrossEntropyLoss()
        states, weights, steps = [], [], 0
        for i in sampled:
            model, opt = self.models[i], self.opts[i]
            model.load_state_dict(self.global_model.state_dict())
            x, y = self.clients[i][0], self.clients[i][1]
            model.train()
            for _ in range(self.epochs):
                for xb, yb in self._batches(x, y):
                    opt.zero_grad()
                    loss_fn(model(xb), yb).backward()
                    opt.step()
                    steps += 1
            states.append(model.state_dict())
            weights.append(len(y))
        total = float(sum(weights))
        avg = {k: sum(s[k] * (w / total) for s, w in zip(states, weights)) for k in states[0]}
        self.global_model.load_state_dict(avg)
        self.sync()
        return steps

    def evaluate(self) -> float:
        torch = self.torch
        correct = count = 0
        self.global_model.eval()
        with torch.no_grad():
            for _, _, x, y in self.clients:
                for j in range(0, len(y), 256):
                    correct += int((self.global_model(x[j:j + 256]).argmax(1) == y[j:j + 256]).sum())
                    count += len(y[j:j + 256])
        self.sync()
        return correct / max(count, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=("iid", "dirichlet"), default="iid",
                        help="iid: 2,100 training samples per client; dirichlet: the preset's Dir(0.3) split (default iid)")
    parser.add_argument("--algos", nargs="+", default=["fedavg", "pgfedmo"],
                        help="engine algorithms timed beside PyTorch FedAvg (default fedavg pgfedmo)")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per side and repetition (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions (default 3)")
    parser.add_argument("--torch-threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--engine-args", default="", help="extra run.py flags for the engine, e.g. '--chunk-size 1'")
    parser.add_argument("--cpu-devices", type=int, default=None,
                        help="XLA:CPU devices for the engine (default: one per core, as run.py)")
    parser.add_argument("--torch-device", default="cpu", choices=("cpu", "cuda"),
                        help="where PyTorch trains (default cpu; the engine uses JAX's default backend)")
    parser.add_argument("--torch-data", nargs="+", default=["loader"], choices=("loader", "resident"),
                        help="PyTorch sides: loader = DataLoader on host data, batches moved to the "
                             "device; resident = data on the device, randperm batches (default loader)")
    parser.add_argument("--json", help="append one JSON line per side with the raw timings")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("vs_pytorch.py: error: needs PyTorch: pip install torch==2.13.0 (the CPU wheel)", file=sys.stderr)
        return 2
    if args.torch_device == "cuda" and not torch.cuda.is_available():
        print("vs_pytorch.py: error: --torch-device cuda but PyTorch sees no CUDA device", file=sys.stderr)
        return 2

    import fedjax_pfl

    fedjax_pfl.use_cpu_cores(args.cpu_devices)     # as run.py: one XLA device per core
    import jax

    preps = {a: protocol_program(a, args.split, args.engine_args.split()) for a in args.algos}
    first = next(iter(preps.values()))
    hp = first.hparams
    clients = _client_arrays(first.data)
    sizes = [len(c[1]) for c in clients]
    print(f"{args.split}: {len(clients)} clients, participation {hp.get('participation')}, "
          f"train sizes {min(sizes)}-{max(sizes)}, {len(jax.devices())} engine devices "
          f"({jax.devices()[0].device_kind}), B={hp['batch_size']}, E={hp['local_epochs']}, "
          f"torch on {args.torch_device}, threads {args.torch_threads}")
    torch_sides = {f"pytorch fedavg{'' if data == 'loader' else ' (resident)'}":
                   TorchFedAvg(clients, hp["lr"], hp["momentum"], hp["local_epochs"], hp["batch_size"],
                               args.torch_threads, device=args.torch_device, resident=data == "resident")
                   for data in args.torch_data}
    engines = {}
    for name, prep in preps.items():
        t = prep.program.compile(prep.round_keys)
        state = prep.program.init(jax.random.fold_in(prep.root, 0))
        engines[name] = [prep, state, 0, warm_evaluation(prep.program, state)]
        print(f"engine {name}: compiled in {t:.1f}s")

    rows = {side: [] for side in list(torch_sides) + [f"engine {a}" for a in args.algos]}
    for rep in range(args.repeats):
        # The sampled clients of the engine's first algorithm, so PyTorch does the same work.
        for r in range(args.rounds):
            for name, entry in engines.items():
                prep, state, done, evaluate = entry
                t0 = time.perf_counter()
                state, metrics = prep.program.run_rounds(state, prep.round_keys, done, 1)
                jax.block_until_ready(state)
                train = time.perf_counter() - t0
                t1 = time.perf_counter()
                evaluate.changed(metrics[0]["sampled"])       # as the runner evaluates
                evaluate(state)
                evaluation = time.perf_counter() - t1
                entry[1], entry[2] = state, done + 1
                steps = int(metrics[0]["client_steps"])
                rows[f"engine {name}"].append((train, evaluation, steps))
                if name == args.algos[0]:
                    sampled = np.asarray(metrics[0]["sampled"])
            for side, torch_side in torch_sides.items():
                torch_side.sync()
                t0 = time.perf_counter()
                steps = torch_side.train_round([int(i) for i in sampled])
                train = time.perf_counter() - t0
                t1 = time.perf_counter()
                torch_side.evaluate()
                rows[side].append((train, time.perf_counter() - t1, steps))
        print(f"repetition {rep + 1}/{args.repeats} done ({len(sampled)} clients per round)", flush=True)

    base = None
    print("\n| side | ms per local step | training s per round | evaluation s per round | vs PyTorch FedAvg |")
    print("|---|---|---|---|---|")
    for side, samples in rows.items():
        ms = np.median([t / s * 1e3 for t, _, s in samples])
        base = ms if base is None else base
        print(f"| {side} | {ms:.2f} | {np.median([t for t, _, _ in samples]):.1f} | "
              f"{np.median([e for _, e, _ in samples]):.2f} | {base / ms:.2f}x |")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"split": args.split, "side": side, "engine_args": args.engine_args,
                                    "device": jax.devices()[0].device_kind, "torch_device": args.torch_device,
                                    "samples": samples, "ms_per_step": ms}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
