#!/usr/bin/env python
"""The character LSTM's client step: fedjax_pfl (M clients vmapped in one jitted program) against
an idiomatic PyTorch loop over the M clients (issue 32, item 6).

    python benchmarks/lstm_torch.py                                  # M = 1, 10, 50; 3 repeats
    python benchmarks/lstm_torch.py --clients 10 --batch 4 --repeats 5 --variants engine vmap hoist
    python benchmarks/lstm_torch.py --check                          # the prototype's gradient
    python benchmarks/lstm_torch.py --micro --clients 1 10 50        # matmul rates in the scan
    python benchmarks/lstm_torch.py --torch-python /tmp/torchenv/bin/python --json out.jsonl

Model (both sides): the FedJAX/TFF Shakespeare model, Embed(90, 8) → LSTM 256 → LSTM 256 →
Dense(90), next-character loss at each of the 80 positions (mean over real tokens; PAD = 0 never
counts). A client step is one SGD step (lr 0.05) on a batch of B sequences of length 80. Data:
random token ids in 1..89 (no padding), a fresh batch each step, from a per-client pool.

Sides, each in its own long-lived process (so nothing is compiled twice and the sides can be
interleaved: every repeat times each side once at each M, in a rotated order):

  torch    what a researcher writes: `nn.Embedding`, `nn.LSTM(num_layers=2, batch_first=True)`,
           `nn.Linear`, `torch.optim.SGD`, `nn.CrossEntropyLoss(ignore_index=0)`, one model and
           optimizer per client, looping over the M clients, each taking `--steps` steps;
           `torch.set_num_threads(2)`, OMP_WAIT_POLICY=PASSIVE. Runs under `--torch-python`
           (default: this interpreter if it imports torch, else /tmp/torchenv/bin/python), so a
           separate CPU-torch venv works; without torch the table says so and shows JAX only.
  engine   fedjax_pfl's own round: `fedavg` `core.Program` with N = M clients, participation 1,
           `--local-steps` = `--steps`, batch B (the runner's program: 2 XLA:CPU devices via
           `use_cpu_cores`, chunked backend, automatic chunk). Its time includes sampling, the
           data gather, aggregation.
           Since 2026-11-25 the library's LSTM (`models/sequence.py:lstm_recurrence`) has a
           hand-written `custom_jvp` whose transpose computes the recurrent kernel's gradient
           as one matmul after the backward scan (the `hoist` idea, forward mode kept).
  vmap     the library's CharLSTM (`models.get("char_lstm")`) and the engine's per-step loss
           (`core.local.masked_mean_loss`), one jitted `vmap` over M clients of `--steps` SGD
           steps (`lax.scan` over steps); one device. The pure client step.
  plain    our re-implementation of the same LSTM in this file (scan over time, input projection
           hoisted out of the scan as in the library, autodiff through the scan), to check that
           it times as `vmap` does before changing it; `plain_u4`: the same with
           `lax.scan(unroll=4)`.
  hoist    prototype: the same LSTM with a `jax.custom_vjp` recurrence whose backward scan
           carries only (dh, dc) and computes the recurrent kernel's gradient ΣU_t h_{t-1}ᵀ dz_t
           as ONE [H, T·B] × [T·B, 4H] matmul after the scan, instead of autodiff's per-step
           accumulation into a [H, 4H] carry (a read and write of 1 MiB per client per time
           step); `--check` compares its gradient with autodiff's. `hoist_u4`: with unroll=4.
  engine_hoist  `engine` with the prototype as its model (`models.Model` of our LSTM with the
           hoisted backward and the task's loss/weight/metric).
  engine_plain  `engine` with `plain` as its model: autodiff through the scan, i.e. the
           library's LSTM before the custom_jvp (the baseline of `engine`, interleaved).

Reported per (side, M): client-steps/s = M · steps / seconds of one call, the median of
`--calls` calls in each repeat; the table gives the median over repeats and the range
(min–max of the repeats' medians), and JAX ÷ torch per repeat (median, range).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB, EMBED, HIDDEN, SEQ = 90, 8, 256, 80
JAX_VARIANTS = ("engine", "engine_hoist", "engine_plain", "vmap", "plain", "plain_u4", "hoist",
                "hoist_u4")


# ---------------------------------------------------------------------------------------------
# PyTorch worker (imports torch only)


def _torch_worker(batch: int, steps: int, lr: float) -> None:
    import numpy as np
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

    info = {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "mkldnn": bool(torch.backends.mkldnn.is_available())}
    print(json.dumps({"ready": True, **info}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        m = cmd["M"]
        if cmd["cmd"] == "setup":
            t0 = time.perf_counter()
            one_call(m)
            print(json.dumps({"setup_s": time.perf_counter() - t0}), flush=True)
        else:
            print(json.dumps({"times": [one_call(m) for _ in range(cmd["calls"])]}), flush=True)


# ---------------------------------------------------------------------------------------------
# JAX side


def _plain_lstm_params(key):
    import jax
    import jax.numpy as jnp

    ks = jax.random.split(key, 8)
    g = lambda k, shape: jax.random.normal(k, shape, jnp.float32) * (1.0 / shape[0]) ** 0.5
    layer = lambda k1, k2, d: {"w": g(k1, (d, 4 * HIDDEN)), "u": g(k2, (HIDDEN, 4 * HIDDEN)),
                               "b": jnp.zeros((4 * HIDDEN,), jnp.float32)}
    return {"embed": jax.random.normal(ks[0], (VOCAB, EMBED)), "l1": layer(ks[1], ks[2], EMBED),
            "l2": layer(ks[3], ks[4], HIDDEN), "out_w": g(ks[5], (HIDDEN, VOCAB)),
            "out_b": jnp.zeros((VOCAB,), jnp.float32)}


def _gates(z):
    import jax
    import jax.numpy as jnp

    i, f, g, o = jnp.split(z, 4, axis=-1)
    return jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)


def _rec_autodiff(xp, u, m, unroll):
    """h_t of the LSTM recurrence from the input projection xp [T, B, 4H] (autodiff backward);
    at m_t = 0 the state is carried unchanged (the library's masking)."""
    import jax
    import jax.numpy as jnp

    b = xp.shape[1]
    zeros = jnp.zeros((b, HIDDEN), xp.dtype)

    def step(carry, inp):
        c, h = carry
        x, mt = inp
        si, sf, tg, so = _gates(x + h @ u)
        c_new = sf * c + si * tg
        h_new = so * jnp.tanh(c_new)
        mt = mt[:, None] > 0
        carry = (jnp.where(mt, c_new, c), jnp.where(mt, h_new, h))
        return carry, carry[1]

    return jax.lax.scan(step, (zeros, zeros), (xp, m), unroll=unroll)[1]


def _make_rec_hoisted(unroll: int):
    """The same recurrence with a hand-written backward: the scan carries (dh, dc) only, and the
    recurrent kernel's gradient Σ_t h_{t-1}ᵀ dz_t is one matmul over all T·B rows after it."""
    import jax
    import jax.numpy as jnp

    def forward(xp, u, m):
        b = xp.shape[1]
        zeros = jnp.zeros((b, HIDDEN), xp.dtype)

        def step(carry, inp):
            c, h = carry
            x, mt = inp
            si, sf, tg, so = _gates(x + h @ u)
            c_new = sf * c + si * tg
            tc = jnp.tanh(c_new)
            h_new = so * tc
            k = mt[:, None] > 0
            carry = (jnp.where(k, c_new, c), jnp.where(k, h_new, h))
            return carry, (carry[1], h, c, jnp.concatenate([si, sf, tg, so], -1), tc)

        _, (hs, h_prev, c_prev, gates, tcs) = jax.lax.scan(step, (zeros, zeros), (xp, m),
                                                          unroll=unroll)
        return hs, (h_prev, c_prev, gates, tcs, u, m)

    @jax.custom_vjp
    def rec(xp, u, m):
        return forward(xp, u, m)[0]

    def fwd(xp, u, m):
        return forward(xp, u, m)

    def bwd(res, dhs):
        h_prev, c_prev, gates, tcs, u, m = res
        b = dhs.shape[1]
        zeros = jnp.zeros((b, HIDDEN), dhs.dtype)
        ut = u.T

        def step(carry, inp):
            dh, dc = carry                          # cotangents of (h_t, c_t)
            dh_out, cp, g, tc, mt = inp
            si, sf, tg, so = jnp.split(g, 4, axis=-1)
            dh_t = dh + dh_out
            dc_t = dc + dh_t * so * (1 - tc * tc)
            dz = jnp.concatenate([dc_t * tg * si * (1 - si), dc_t * cp * sf * (1 - sf),
                                  dc_t * si * (1 - tg * tg), dh_t * tc * so * (1 - so)], -1)
            k = mt[:, None] > 0
            dz = jnp.where(k, dz, 0.0)
            dh_prev = jnp.where(k, dz @ ut, dh_t)
            dc_prev = jnp.where(k, dc_t * sf, dc)
            return (dh_prev, dc_prev), dz

        _, dzs = jax.lax.scan(step, (zeros, zeros), (dhs, c_prev, gates, tcs, m), reverse=True,
                              unroll=unroll)
        t, b4 = dzs.shape[0] * dzs.shape[1], dzs.shape[-1]
        du = h_prev.reshape(t, HIDDEN).T @ dzs.reshape(t, b4)
        return dzs, du, jnp.zeros_like(m)

    rec.defvjp(fwd, bwd)
    return rec


def _plain_apply(rec, unroll):
    """(params, x [B, T] int) -> logits [B, T, V] of our LSTM with recurrence `rec`."""
    import jax.numpy as jnp

    def apply(params, x):
        x = x.astype(jnp.int32)
        m = jnp.swapaxes((x != 0).astype(jnp.float32), 0, 1)             # [T, B]
        h = jnp.swapaxes(params["embed"][x], 0, 1)                         # [T, B, E]
        for name in ("l1", "l2"):
            p = params[name]
            xp = h @ p["w"] + p["b"]
            h = rec(xp, p["u"], m) if unroll is None else rec(xp, p["u"], m, unroll)
        return jnp.swapaxes(h, 0, 1) @ params["out_w"] + params["out_b"]  # [B, T, V]

    return apply


def _plain_loss(rec, unroll):
    import jax
    import jax.numpy as jnp

    apply = _plain_apply(rec, unroll)

    def loss(params, x, y):
        logits = apply(params, x)
        ll = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(ll, y[..., None], -1)[..., 0]
        real = y != 0
        return jnp.sum(jnp.where(real, nll, 0.0)) / jnp.maximum(jnp.sum(real), 1)

    return loss


def _jax_worker(batch: int, steps: int, lr: float, variants: list[str]) -> None:
    import fedjax_pfl

    fedjax_pfl.use_cpu_cores()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fedjax_pfl import algorithms, core, models
    from fedjax_pfl.core.local import masked_mean_loss
    from fedjax_pfl.data import formats
    from fedjax_pfl.data.natural import NaturalClients, SourceInfo, Task

    task = Task(kind="sequence", num_classes=VOCAB, inputs="tokens", vocab_size=VOCAB,
                default_model="char_lstm")
    model = models.get("char_lstm", (SEQ,), VOCAB, task=task)
    rng = np.random.default_rng(0)
    built: dict = {}

    def data(m):
        tok = rng.integers(1, VOCAB, (steps, m, batch, SEQ + 1)).astype(np.int32)
        return jnp.asarray(tok[..., :-1]), jnp.asarray(tok[..., 1:])

    def vmapped(loss_fn, init_one, m):
        grad = jax.value_and_grad(loss_fn)

        def client_steps(params, xs, ys):                   # one client, xs [S, B, T]
            def step(p, xy):
                loss, g = grad(p, *xy)
                return jax.tree.map(lambda a, b: a - lr * b, p, g), loss
            return jax.lax.scan(step, params, (xs, ys))

        run = jax.jit(jax.vmap(client_steps, in_axes=(0, 1, 1)))
        params = jax.vmap(init_one)(jax.random.split(jax.random.key(0), m))
        xs, ys = data(m)
        return lambda: jax.block_until_ready(run(params, xs, ys))

    # the prototype as an engine model: our LSTM with the hoisted backward, the task's own
    # per-token loss, weight and metric (models/tasks.py)
    from fedjax_pfl.models import tasks
    task_fns = {k: v for k, v in tasks.for_task(task).items() if k in ("loss", "weight", "metric")}
    hoisted_model = models.Model(init=_plain_lstm_params,
                                 apply=_plain_apply(_make_rec_hoisted(1), None),
                                 name="char_lstm_hoisted", **task_fns)
    plain_model = models.Model(init=_plain_lstm_params, apply=_plain_apply(_rec_autodiff, 1),
                               name="char_lstm_autodiff", **task_fns)

    def build(variant, m):
        if variant.startswith("engine"):
            n_per = steps * batch
            tok = rng.integers(1, VOCAB, (m * (n_per + 1), SEQ + 1)).astype(np.int32)
            x, y = tok[:, :-1], tok[:, 1:]
            train_off = np.arange(m + 1, dtype=np.int64) * n_per
            test_off = np.arange(m + 1, dtype=np.int64)
            nc = NaturalClients(task, SourceInfo("synthetic_shakespeare", "synthetic", ()),
                                np.array([f"c{i}" for i in range(m)]), x[: m * n_per],
                                y[: m * n_per], train_off, x[m * n_per:], y[m * n_per:], test_off)
            fd = formats.to_federated(nc)
            algo = algorithms.get("fedavg", model={"engine_hoist": hoisted_model,
                                                   "engine_plain": plain_model}.get(variant, model),
                                  participation=1.0, local_steps=steps, batch_size=batch, lr=lr)
            mesh = core.client_mesh()
            program = core.Program(algo, fd, mesh=mesh)
            keys = jax.random.key(1)
            program.compile(keys)
            state = [jax.block_until_ready(program.init(jax.random.key(0))), 0]

            def call():
                state[0], _ = program.run_rounds(state[0], keys, state[1], 1)
                state[1] += 1
                jax.block_until_ready(state[0])
            return call
        if variant == "vmap":
            ones = jnp.ones((batch,), bool)
            loss = lambda p, x, y: masked_mean_loss(model, p, x, y, ones)
            return vmapped(loss, model.init, m)
        unroll = 4 if variant.endswith("_u4") else 1
        if variant.startswith("plain"):
            return vmapped(_plain_loss(_rec_autodiff, unroll), _plain_lstm_params, m)
        if variant.startswith("hoist"):
            return vmapped(_plain_loss(_make_rec_hoisted(unroll), None), _plain_lstm_params, m)
        raise ValueError(variant)

    print(json.dumps({"ready": True, "jax": jax.__version__, "devices": len(jax.devices())}),
          flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        key = (cmd["variant"], cmd["M"])
        if cmd["cmd"] == "setup":
            t0 = time.perf_counter()
            built[key] = build(*key)
            built[key]()                                   # compile + first call
            print(json.dumps({"setup_s": time.perf_counter() - t0}), flush=True)
        else:
            times = []
            for _ in range(cmd["calls"]):
                t0 = time.perf_counter()
                built[key]()
                times.append(time.perf_counter() - t0)
            print(json.dumps({"times": times}), flush=True)


def _micro(batch: int, ms: list[int], repeats: int = 5) -> None:
    """GFLOP/s of the recurrence's matmuls as XLA:CPU runs them inside a 80-step scan, per M:
    `shared` h [M·B, H] @ U [H, 4H] (one weight for all rows: what one client's step would be
    with M·B rows), `per_client` [M, B, H] @ [M, H, 4H] (the vmapped step: each client its own
    U), `accum` the autodiff backward's per-step weight gradient acc[M] += h[M]ᵀ dz[M] into a
    [M, H, 4H] carry, and `hoisted` the same gradient as one [M, H, T·B] @ [M, T·B, 4H] matmul
    after the scan."""
    import fedjax_pfl

    fedjax_pfl.use_cpu_cores()
    import jax
    import jax.numpy as jnp

    t, h4 = SEQ, 4 * HIDDEN
    flop_step = 2 * batch * HIDDEN * h4                       # one client, one time step
    key = jax.random.key(0)

    def timed(fn, *a):
        fn = jax.jit(fn)
        jax.block_until_ready(fn(*a))
        best = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            best.append(time.perf_counter() - t0)
        return sorted(best)[len(best) // 2]

    for m in ms:
        hs = jax.random.normal(key, (t, m, batch, HIDDEN))
        u = jax.random.normal(key, (m, HIDDEN, h4)) * 0.01
        dz = jax.random.normal(key, (t, m, batch, h4))

        def shared(hs, u):
            return jax.lax.scan(lambda c, x: (c + x.reshape(-1, HIDDEN) @ u[0], None),
                                jnp.zeros((m * batch, h4)), hs)[0]

        def per_client(hs, u):
            return jax.lax.scan(lambda c, x: (c + jnp.einsum("mbh,mhg->mbg", x, u), None),
                                jnp.zeros((m, batch, h4)), hs)[0]

        def accum(hs, dz):
            return jax.lax.scan(lambda c, x: (c + jnp.einsum("mbh,mbg->mhg", *x), None),
                                jnp.zeros((m, HIDDEN, h4)), (hs, dz))[0]

        def hoisted(hs, dz):
            return jnp.einsum("tmbh,tmbg->mhg", hs, dz)

        row = {"M": m}
        for name, fn, a in (("shared", shared, (hs, u)), ("per_client", per_client, (hs, u)),
                            ("accum", accum, (hs, dz)), ("hoisted", hoisted, (hs, dz))):
            row[name] = round(t * m * flop_step / timed(fn, *a) / 1e9, 1)
        print(json.dumps({"gflop_per_s": row, "load": os.getloadavg()[0]}), flush=True)


def _check(batch: int) -> None:
    """The hoisted backward against autodiff through the scan (float32; max relative error),
    with a padded tail so the masking is exercised."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    params = _plain_lstm_params(jax.random.key(3))
    tok = np.random.default_rng(1).integers(1, VOCAB, (batch, SEQ + 1)).astype(np.int32)
    tok[0, 60:] = 0
    x, y = jnp.asarray(tok[:, :-1]), jnp.asarray(tok[:, 1:])
    la, ga = jax.value_and_grad(_plain_loss(_rec_autodiff, 1))(params, x, y)
    lb, gb = jax.value_and_grad(_plain_loss(_make_rec_hoisted(1), None))(params, x, y)
    errs = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(a)) + 1e-30)),
                        ga, gb)
    print(json.dumps({"loss_autodiff": float(la), "loss_hoisted": float(lb),
                      "max_rel_grad_err": errs}))


# ---------------------------------------------------------------------------------------------
# driver


class _Worker:
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
    import statistics

    return statistics.median(values), min(values), max(values)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", nargs="+", type=int, default=[1, 10, 50], help="M values")
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--steps", type=int, default=4, help="SGD steps per client per call")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--calls", type=int, default=3, help="timed calls per side per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=["engine", "vmap", "hoist"],
                   choices=JAX_VARIANTS)
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--torch-python", default=None)
    p.add_argument("--torch-threads", type=int, default=2)
    p.add_argument("--json", default=None, help="append one JSON line per (side, M) here")
    p.add_argument("--check", action="store_true", help="only compare the prototype's gradient")
    p.add_argument("--micro", action="store_true",
                   help="only the recurrence's matmul rates (GFLOP/s) at each --clients M")
    p.add_argument("--worker", choices=("jax", "torch"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker == "torch":
        return _torch_worker(args.batch, args.steps, args.lr)
    if args.worker == "jax":
        return _jax_worker(args.batch, args.steps, args.lr, args.variants)
    if args.check:
        return _check(args.batch)
    if args.micro:
        return _micro(args.batch, args.clients)

    common = ["--batch", str(args.batch), "--steps", str(args.steps), "--lr", str(args.lr)]
    workers: dict[str, _Worker] = {}
    sides = list(args.variants)
    tpy = None if args.no_torch else _torch_python(args.torch_python)
    if tpy is None:
        print("# PyTorch: unavailable (" + ("--no-torch" if args.no_torch else
              "no interpreter imports torch: pip install torch, or --torch-python") + "); JAX only")
    else:
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS=str(args.torch_threads),
                   LSTM_BENCH_THREADS=str(args.torch_threads))
        workers["torch"] = _Worker([tpy, __file__, "--worker", "torch"] + common, env)
        sides = ["torch"] + sides
    workers["jax"] = _Worker([sys.executable, __file__, "--worker", "jax"] + common
                             + ["--variants"] + args.variants)
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S')}; load {os.getloadavg()}; B={args.batch}, "
          f"T={SEQ}, {args.steps} steps/client/call, {args.calls} calls x {args.repeats} repeats; "
          f"workers: {json.dumps({k: w.info for k, w in workers.items()})}", flush=True)
    worker_of = lambda side: workers["torch" if side == "torch" else "jax"]
    setup = {}
    for m in args.clients:
        for side in sides:
            r = worker_of(side).ask(cmd="setup", M=m, variant=side)
            setup[(side, m)] = r["setup_s"]
            print(f"# setup {side} M={m}: {r['setup_s']:.1f} s (compile + first call)", flush=True)
    rates = {(s, m): [] for s in sides for m in args.clients}
    loads = []
    for rep in range(args.repeats):
        loads.append(os.getloadavg()[0])
        for m in args.clients:
            order = sides[rep % len(sides):] + sides[: rep % len(sides)]
            for side in order:
                times = worker_of(side).ask(cmd="time", M=m, variant=side, calls=args.calls)["times"]
                t = sorted(times)[len(times) // 2]
                rates[(side, m)].append(m * args.steps / t)
        print(f"# repeat {rep + 1}: " + ", ".join(f"{s}@{m}={rates[(s, m)][-1]:.1f}"
                                                  for m in args.clients for s in sides), flush=True)
    for w in workers.values():
        w.close()
    print(f"\nclient-steps/s, median over {args.repeats} repeats (range); load 1-min during "
          f"timing {min(loads):.2f}-{max(loads):.2f}")
    print("| side | " + " | ".join(f"M = {m}" for m in args.clients) + " |")
    print("|---|" + "---|" * len(args.clients))
    for side in sides:
        cells = []
        for m in args.clients:
            med, lo, hi = _summary(rates[(side, m)])
            cell = f"{med:.1f} ({lo:.1f}–{hi:.1f})"
            if side != "torch" and "torch" in sides:
                ratios = [a / b for a, b in zip(rates[(side, m)], rates[("torch", m)])]
                rmed, rlo, rhi = _summary(ratios)
                cell += f", {rmed:.2f}× ({rlo:.2f}–{rhi:.2f})"
            cells.append(cell)
        print(f"| {side} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "a") as f:
            for (side, m), vals in rates.items():
                f.write(json.dumps({"side": side, "M": m, "batch": args.batch, "steps": args.steps,
                                    "client_steps_per_s": vals, "setup_s": setup[(side, m)],
                                    "date": time.strftime("%Y-%m-%d %H:%M"), "loads": loads}) + "\n")


if __name__ == "__main__":
    main()
