#!/usr/bin/env python
"""The engine against idiomatic PyTorch, interleaved: FedAvg on PGFed's own CNN protocol, and the
character LSTM's client step.

    pip install torch==2.13.0        # benchmark-only; the CPU wheel (also: pip install -e ".[bench]")
    python benchmarks/vs_pytorch.py --split iid
    python benchmarks/vs_pytorch.py --split dirichlet --algos fedavg pgfedmo --repeats 3
    # on a GPU machine (both sides on the GPU; M = 25 and 100 clients per round):
    python benchmarks/vs_pytorch.py --torch-device cuda --torch-data loader resident \
        --engine-args "--participation 1.0 --clients 100"
    python benchmarks/vs_pytorch.py --workload char_lstm                   # M = 1, 10, 50
    python benchmarks/vs_pytorch.py --workload char_lstm --clients 10 50 --steps 3 --calls 2 \
        --torch-python /tmp/torchenv/bin/python                           # torch in its own venv

--workload protocol (the default). Protocol (issue 13; preset pgfed_paper with the FedAvg CNN):
Fashion-MNIST, 25 clients, 75/25 train/test per client, 6 sampled per round, 5 local epochs of
batch 10 with drop_last, SGD lr 0.005 momentum 0.9 with a per-client persistent buffer,
evaluation of all 25 clients every round (the engine's as its runner does it: a personalised
model is evaluated again only once a round has changed it, `core.CachedEvaluation`; PyTorch
FedAvg has none).
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

--workload char_lstm (issue 32). The FedJAX/TFF Shakespeare model on both sides: Embed(90, 8) →
LSTM 256 → LSTM 256 → Dense(90), next-character loss at each of the 80 positions (PAD = 0 never
counts). A client step is one SGD step (--lr) on a batch of --batch sequences of random token ids
in 1..89. Each side runs in its own long-lived process, so nothing is compiled twice and the
sides interleave: every repeat times each side once at each M of --clients, in a rotated order.
  torch   what a researcher writes: `nn.Embedding`, `nn.LSTM(num_layers=2, batch_first=True)`,
          `nn.Linear`, `torch.optim.SGD`, `nn.CrossEntropyLoss(ignore_index=0)`, one model and
          optimizer per client, a loop over the M clients, each taking --steps steps;
          `torch.set_num_threads(--torch-threads)`, OMP_WAIT_POLICY=PASSIVE. It runs under
          --torch-python (default: this interpreter if it imports torch, else
          /tmp/torchenv/bin/python), so a separate CPU-torch venv works; without torch the table
          says so and shows the engine only.
  engine  fedjax_pfl's FedAvg round as `runner.prepare` builds it with N = M clients,
          participation 1, --local-steps = --steps, batch --batch (one XLA:CPU device per core,
          chunked backend, automatic chunk); its time includes sampling, the data gather and
          the aggregation.
Reported per (side, M): client-steps/s = M · steps / seconds of one call, the median of --calls
calls in each repeat; the table gives the median over repeats and their range, and engine ÷
torch per repeat (median, range).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))   # this checkout


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
        places = (train_on, train_on, self.device, self.device)
        self.clients = [tuple(torch.from_numpy(v).to(on) for v, on in zip(c, places))
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


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("protocol", "char_lstm"), default="protocol",
                   help="protocol: FedAvg on PGFed's CNN protocol (default); char_lstm: the "
                        "character LSTM's client step")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repetitions (default 3)")
    p.add_argument("--torch-threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--json", help="append one JSON line per side (char_lstm: per side and M) "
                                  "with the raw timings")
    g = p.add_argument_group("--workload protocol")
    g.add_argument("--split", choices=("iid", "dirichlet"), default="iid",
                   help="iid: 2,100 training samples per client; dirichlet: the preset's Dir(0.3) split (default iid)")
    g.add_argument("--algos", nargs="+", default=["fedavg", "pgfedmo"],
                   help="engine algorithms timed beside PyTorch FedAvg (default fedavg pgfedmo)")
    g.add_argument("--rounds", type=int, default=2, help="timed rounds per side and repetition (default 2)")
    g.add_argument("--engine-args", default="", help="extra run.py flags for the engine, e.g. '--chunk-size 1'")
    g.add_argument("--cpu-devices", type=int, default=None,
                   help="XLA:CPU devices for the engine (default: one per core, as run.py)")
    g.add_argument("--torch-device", default="cpu", choices=("cpu", "cuda"),
                   help="where PyTorch trains (default cpu; the engine uses JAX's default backend)")
    g.add_argument("--torch-data", nargs="+", default=["loader"], choices=("loader", "resident"),
                   help="PyTorch sides: loader = DataLoader on host data, batches moved to the "
                        "device; resident = data on the device, randperm batches (default loader)")
    g = p.add_argument_group("--workload char_lstm")
    g.add_argument("--clients", nargs="+", type=int, default=[1, 10, 50], help="M values (default 1 10 50)")
    g.add_argument("--batch", type=int, default=10, help="sequences a step (default 10)")
    g.add_argument("--steps", type=int, default=4, help="SGD steps per client per call (default 4)")
    g.add_argument("--lr", type=float, default=0.05)
    g.add_argument("--calls", type=int, default=3, help="timed calls per side per repeat (default 3)")
    g.add_argument("--torch-python", default=None, help="an interpreter that imports torch")
    g.add_argument("--no-torch", action="store_true", help="time the engine only")
    g.add_argument("--worker", choices=("engine", "torch"), help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.worker == "torch":
        return _lstm_torch_worker(args.batch, args.steps, args.lr)
    if args.worker == "engine":
        return _lstm_engine_worker(args.batch, args.steps, args.lr)
    if args.workload == "char_lstm":
        return char_lstm(args)
    return protocol(args)


def protocol(args) -> int:
    """PyTorch FedAvg against the engine's algorithms on PGFed's protocol (--workload protocol)."""
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


# --- --workload char_lstm -----------------------------------------------------------------------

VOCAB, EMBED, HIDDEN, SEQ = 90, 8, 256, 80


def _lstm_torch_worker(batch: int, steps: int, lr: float) -> int:
    """The PyTorch side's process: answers setup/time requests (JSON lines on stdin)."""
    import torch
    from torch import nn

    torch.set_num_threads(int(os.environ.get("LSTM_BENCH_THREADS", "2")))
    torch.manual_seed(0)

    class CharLSTM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, EMBED)
            self.lstm = nn.LSTM(EMBED, HIDDEN, num_layers=2, batch_first=True)
            self.out = nn.Linear(HIDDEN, VOCAB)

        def forward(self, x):
            h, _ = self.lstm(self.embed(x))
            return self.out(h)

    clients: dict[int, list] = {}
    loss_fn = nn.CrossEntropyLoss(ignore_index=0)
    rng = np.random.default_rng(0)

    def setup(m: int):
        if m not in clients:
            pool = []
            for _ in range(m):
                model = CharLSTM()
                opt = torch.optim.SGD(model.parameters(), lr=lr)
                x = torch.from_numpy(rng.integers(1, VOCAB, (steps, batch, SEQ + 1)).astype(np.int64))
                pool.append((model, opt, x[:, :, :-1].contiguous(), x[:, :, 1:].contiguous()))
            clients[m] = pool
        return clients[m]

    def one_call(m: int) -> float:
        pool = setup(m)
        t0 = time.perf_counter()
        for model, opt, xs, ys in pool:
            for s in range(steps):
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model(xs[s]).reshape(-1, VOCAB), ys[s].reshape(-1))
                loss.backward()
                opt.step()
        return time.perf_counter() - t0

    return _serve(lambda m: (lambda: one_call(m)),
                  {"torch": torch.__version__, "threads": torch.get_num_threads()})


def _lstm_engine_worker(batch: int, steps: int, lr: float) -> int:
    """The engine side's process: a FedAvg program per M (N = M clients of random token ids)."""
    import fedjax_pfl

    fedjax_pfl.use_cpu_cores()
    import jax

    from fedjax_pfl import runner
    from fedjax_pfl.data import NaturalClients, Task, to_federated
    from fedjax_pfl.data.natural import SourceInfo

    task = Task(kind="sequence", num_classes=VOCAB, inputs="tokens", vocab_size=VOCAB,
                default_model="char_lstm")
    rng = np.random.default_rng(0)

    def build(m: int):
        n_per = steps * batch
        tok = rng.integers(1, VOCAB, (m * (n_per + 1), SEQ + 1)).astype(np.int32)
        x, y = tok[:, :-1], tok[:, 1:]
        train_off = np.arange(m + 1, dtype=np.int64) * n_per
        test_off = np.arange(m + 1, dtype=np.int64)
        nc = NaturalClients(task, SourceInfo("synthetic_shakespeare", "synthetic", ()),
                            np.array([f"c{i}" for i in range(m)]), x[: m * n_per], y[: m * n_per],
                            train_off, x[m * n_per:], y[m * n_per:], test_off)
        cfg = runner.RunConfig(algo="fedavg", model="char_lstm", progress=False, memory_check=False,
                               data_placement="device", state_placement="device",
                               hparams=dict(participation=1.0, local_steps=steps, batch_size=batch,
                                            lr=lr))
        prep = runner.prepare(cfg, data=to_federated(nc))
        prep.program.compile(prep.round_keys)
        state = [jax.block_until_ready(prep.program.init(jax.random.fold_in(prep.root, 0))), 0]

        def call() -> float:
            t0 = time.perf_counter()
            state[0], _ = prep.program.run_rounds(state[0], prep.round_keys, state[1], 1)
            state[1] += 1
            jax.block_until_ready(state[0])
            return time.perf_counter() - t0
        return call

    built: dict = {}

    def calls(m: int):
        if m not in built:
            built[m] = build(m)
        return built[m]

    return _serve(calls, {"jax": jax.__version__, "devices": len(jax.devices())})


def _serve(call_of, info: dict) -> int:
    """A worker's loop: {"cmd": "setup" | "time", "M": m[, "calls": k]} in, JSON out;
    `call_of(m)` is a function timing one call at M = m (seconds)."""
    print(json.dumps({"ready": True, **info}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        t0 = time.perf_counter()
        call = call_of(cmd["M"])                # (the engine builds and compiles its program here)
        if cmd["cmd"] == "setup":               # and a first call
            call()
            print(json.dumps({"setup_s": time.perf_counter() - t0}), flush=True)
        else:
            times = [call() for _ in range(cmd["calls"])]
            print(json.dumps({"times": times}), flush=True)
    return 0


class _Worker:
    """A side's process, asked over its stdin and answering on its stdout."""

    def __init__(self, argv, env=None):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, bufsize=1)
        self.info = self._read()

    def _read(self):
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"worker {self.proc.args[:3]} exited (rc {self.proc.poll()})")
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self):
        try:
            self.proc.stdin.write('{"cmd": "quit"}\n')
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        self.proc.wait(timeout=60)


def _torch_python(given: str | None) -> str | None:
    candidates = [given] if given else [sys.executable, "/tmp/torchenv/bin/python"]
    for py in candidates:
        if py and os.path.exists(py) and subprocess.run(
                [py, "-c", "import torch"], capture_output=True).returncode == 0:
            return py
    return None


def _summary(values):
    return statistics.median(values), min(values), max(values)


def char_lstm(args) -> int:
    """The character LSTM's client step, PyTorch against the engine (--workload char_lstm)."""
    common = ["--batch", str(args.batch), "--steps", str(args.steps), "--lr", str(args.lr)]
    workers: dict[str, _Worker] = {}
    sides = ["engine"]
    tpy = None if args.no_torch else _torch_python(args.torch_python)
    if tpy is None:
        print("# PyTorch: unavailable (" + ("--no-torch" if args.no_torch else
              "no interpreter imports torch: pip install torch, or --torch-python") + "); engine only")
    else:
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS=str(args.torch_threads),
                   LSTM_BENCH_THREADS=str(args.torch_threads))
        workers["torch"] = _Worker([tpy, __file__, "--worker", "torch"] + common, env)
        sides = ["torch"] + sides
    workers["engine"] = _Worker([sys.executable, __file__, "--worker", "engine"] + common)
    print(f"# load {os.getloadavg()}; B={args.batch}, T={SEQ}, {args.steps} steps/client/call, "
          f"{args.calls} calls x {args.repeats} repeats; workers: "
          f"{json.dumps({k: w.info for k, w in workers.items()})}", flush=True)
    setup = {}
    for m in args.clients:
        for side in sides:
            setup[(side, m)] = workers[side].ask(cmd="setup", M=m)["setup_s"]
            print(f"# setup {side} M={m}: {setup[(side, m)]:.1f} s (compile + first call)", flush=True)
    rates = {(s, m): [] for s in sides for m in args.clients}
    loads = []
    for rep in range(args.repeats):
        loads.append(os.getloadavg()[0])
        for m in args.clients:
            for side in sides[rep % len(sides):] + sides[: rep % len(sides)]:     # rotated
                times = workers[side].ask(cmd="time", M=m, calls=args.calls)["times"]
                rates[(side, m)].append(m * args.steps / sorted(times)[len(times) // 2])
        print(f"# repeat {rep + 1}: " + ", ".join(f"{s}@{m}={rates[(s, m)][-1]:.1f}"
                                                  for m in args.clients for s in sides), flush=True)
    for w in workers.values():
        w.close()
    print(f"\nclient-steps/s, median over {args.repeats} repeats (range); 1-min load during "
          f"timing {min(loads):.2f}-{max(loads):.2f}")
    print("| side | " + " | ".join(f"M = {m}" for m in args.clients) + " |")
    print("|---|" + "---|" * len(args.clients))
    for side in sides:
        cells = []
        for m in args.clients:
            med, lo, hi = _summary(rates[(side, m)])
            cell = f"{med:.1f} ({lo:.1f}–{hi:.1f})"
            if side != "torch" and "torch" in sides:
                rmed, rlo, rhi = _summary([a / b for a, b in zip(rates[(side, m)], rates[("torch", m)])])
                cell += f", {rmed:.2f}× ({rlo:.2f}–{rhi:.2f})"
            cells.append(cell)
        print(f"| {side} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "a") as f:
            for (side, m), vals in rates.items():
                f.write(json.dumps({"workload": "char_lstm", "side": side, "M": m, "batch": args.batch,
                                    "steps": args.steps, "client_steps_per_s": vals,
                                    "setup_s": setup[(side, m)], "loads": loads}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
