"""Batch orders shared by every side: the order in which each client visits its training samples.

    python benchmarks/peers/orders.py work/cifar10_r5_s0.npz --batch-order engine --out ORDERS.npz
    python benchmarks/peers/orders.py work/cifar10_r5_s0.npz --batch-order engine --shuffle-seed 1 ...
    python benchmarks/peers/orders.py work/cifar10_r5_s0.npz --batch-order in-order --out ...

Runs in the repository's environment (JAX). Writes, for every scheduled round r, client
schedule[r][j] and local epoch e, the order π_{r,j,e} of 0 … n − 1 in which that client visits its
n training samples in that epoch (batch k = positions π(kB) … π(kB + B − 1), the last batch
partial). `run_fedjax.py --orders` makes the engine use exactly these orders and checks that it
did; `run_pfl.py --orders` and `run_flower.py --orders` batch each client's data in them
(`common.Orders` reads the file with NumPy only).

--batch-order engine: the orders fedjax_pfl's FedAvg draws in that round, i.e. the engine's
  `core.local.epoch_permutation` (a keyed swap-or-not shuffle) under the keys the engine gives
  it: for round r (0-based) of a run seeded s, client i, epoch e,

      round key   = fold_in(fold_in(key(s), 1), r)        (run_fedjax: Program.run_rounds)
      train key   = split(round key)[1]                    (fedavg.round_fn)
      client key  = fold_in(train key, i)                  (algorithms.base.client_keys)
      epoch key   = fold_in(client key, e)                 (LocalTrainer's step)
      π_{r,i,e}   = epoch_permutation(epoch key, n_i, 0 … n_i − 1)

  With --shuffle-seed S the epoch key is folded once more, fold_in(epoch key, S), and
  run_fedjax.py folds S into the engine's epoch keys the same way: another draw of orders,
  independent of the seed that sets the data, the split and the initial weights.
--batch-order in-order: the identity (pfl-research's default: a user's data in stored order).

`patch_engine` (run_fedjax.py) replaces `fedjax_pfl.core.local.epoch_permutation` for the run:
with the fold of S or the identity as asked, and, in every mode, recording through
`jax.debug.callback` the key, positions and order of every call, which `check_recorded` compares
with the file: every step of every scheduled client must have read exactly the file's positions.
The library itself is not changed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)

import common  # noqa: E402

MODES = ("engine", "in-order")


def epoch_keys(seed: int, schedule: np.ndarray, epochs: int):
    """The engine's epoch keys (typed JAX keys) [R, M, E] for the job's schedule (see above)."""
    import jax
    import jax.numpy as jnp

    round_keys = jax.random.fold_in(jax.random.key(seed), 1)
    sched = jnp.asarray(schedule, jnp.int32)

    def one(r, cid, e):
        train_key = jax.random.split(jax.random.fold_in(round_keys, r))[1]
        return jax.random.fold_in(jax.random.fold_in(train_key, cid), e)

    r = jnp.arange(sched.shape[0], dtype=jnp.int32)[:, None, None]
    e = jnp.arange(epochs, dtype=jnp.int32)[None, None, :]
    rr, cc, ee = jnp.broadcast_arrays(r, sched[:, :, None], e)
    return jax.vmap(one)(rr.ravel(), cc.ravel(), ee.ravel()).reshape(rr.shape)


def fold_shuffle(key, shuffle_seed: int | None):
    import jax

    return key if shuffle_seed is None else jax.random.fold_in(key, shuffle_seed)


def compute(job: common.Job, rounds: int, mode: str, shuffle_seed: int | None):
    """(order [Σ E·n] int32, offset [R, M] int64): client schedule[r][j]'s E epochs of orders
    start at offset[r, j], epoch e at offset + e·n."""
    import jax
    import jax.numpy as jnp

    from fedjax_pfl.core.local import epoch_permutation

    schedule = job.schedule[:rounds]
    epochs = int(job.meta["local_epochs"])
    counts = job.train_counts[schedule]                                   # [R, M]
    width = int(counts.max())
    if mode == "engine":
        keys = epoch_keys(int(job.meta["seed"]), schedule, epochs)         # [R, M, E]
        keys = jax.vmap(lambda k: fold_shuffle(k, shuffle_seed))(keys.ravel())
        n = jnp.asarray(np.repeat(counts.ravel(), epochs), jnp.int32)
        perms = jax.jit(jax.vmap(lambda k, c: epoch_permutation(k, c, jnp.arange(width))))(keys, n)
        perms = np.asarray(perms).reshape(*schedule.shape, epochs, width)
    elif mode == "in-order":
        perms = np.broadcast_to(np.arange(width), (*schedule.shape, epochs, width))
    else:
        raise ValueError(f"batch order {mode!r}: one of {MODES}")
    blocks, offset, at = [], np.zeros(schedule.shape, np.int64), 0
    for r in range(schedule.shape[0]):
        for j in range(schedule.shape[1]):
            n = int(counts[r, j])
            block = perms[r, j, :, :n]
            for e in range(epochs):
                if sorted(block[e].tolist()) != list(range(n)):
                    raise SystemExit(f"orders.py: round {r} client {schedule[r, j]} epoch {e}: "
                                     "not a permutation")
            offset[r, j] = at
            at += epochs * n
            blocks.append(block.ravel())
    return np.concatenate(blocks).astype(np.int32), offset


def write(job_path: str, rounds: int, mode: str, shuffle_seed: int | None, out: str) -> str:
    job = common.Job(job_path)
    order, offset = compute(job, rounds, mode, shuffle_seed)
    meta = dict(mode=mode, shuffle_seed=shuffle_seed, seed=int(job.meta["seed"]), rounds=rounds,
                local_epochs=int(job.meta["local_epochs"]), job=os.path.basename(job_path))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    np.savez(out, order=order, offset=offset, schedule=job.schedule[:rounds],
             train_counts=job.train_counts, meta=json.dumps(meta))
    return out


# -- the engine side (run_fedjax.py) ---------------------------------------------------------------

class Recorder:
    """What the patched `epoch_permutation` saw: (key words, n, positions, order) of every call."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __call__(self, key_data, n, positions, order):
        key_data, n = np.asarray(key_data), np.asarray(n)
        positions, order = np.asarray(positions), np.asarray(order)
        if key_data.ndim > 1:                          # batched (vmap without unrolling)
            for i in range(key_data.shape[0]):
                self(key_data[i], n[i] if n.ndim else n, positions[i], order[i])
            return
        self.calls.append((tuple(int(w) for w in key_data.ravel()), int(n), positions.copy(),
                           order.copy()))


def patch_engine(mode: str, shuffle_seed: int | None) -> Recorder:
    """Replaces `fedjax_pfl.core.local.epoch_permutation` (what LocalTrainer's step calls) for
    this process: `mode` engine folds `shuffle_seed` (if any) into the key, in-order returns the
    positions themselves; every call is recorded (key as the engine gave it)."""
    import jax
    import jax.numpy as jnp

    from fedjax_pfl.core import local

    original = getattr(local.epoch_permutation, "unpatched", local.epoch_permutation)
    recorder = Recorder()

    def epoch_permutation(key, n, positions, unroll=None):
        if mode == "engine":
            out = original(fold_shuffle(key, shuffle_seed), n, positions, unroll)
        elif mode == "in-order":
            x = jnp.asarray(positions, jnp.int32)
            inside = (x >= 0) & (x < jnp.maximum(jnp.asarray(n, jnp.int32), 1))
            out = jnp.where(inside, x, 0)
        else:
            raise ValueError(f"batch order {mode!r}: one of {MODES}")
        jax.debug.callback(recorder, jax.random.key_data(key), jnp.asarray(n, jnp.int32),
                           jnp.asarray(positions, jnp.int32), out)
        return out

    epoch_permutation.unpatched = original
    local.epoch_permutation = epoch_permutation
    return recorder


def check_recorded(recorder: Recorder, orders: "common.Orders", rounds: int) -> dict:
    """Every scheduled client's every epoch must have been read, position by position, in the
    file's order. Returns counts; raises SystemExit on a difference."""
    import jax

    jax.effects_barrier()
    schedule = orders.schedule[:rounds]
    epochs = orders.meta["local_epochs"]
    keys = np.asarray(jax.random.key_data(epoch_keys(orders.meta["seed"], schedule, epochs)))
    where = {}
    for r in range(schedule.shape[0]):
        for j in range(schedule.shape[1]):
            for e in range(epochs):
                where[tuple(int(w) for w in keys[r, j, e].ravel())] = (r, j, e)
    seen: dict = {}
    unknown = 0
    for key, n, positions, order in recorder.calls:
        if key not in where:
            unknown += 1
            continue
        r, j, e = where[key]
        cid = int(schedule[r, j])
        expected = orders.of(r, cid, e)
        if n != expected.size:
            raise SystemExit(f"orders: round {r} client {cid}: the engine's n = {n}, the file's {expected.size}")
        inside = (positions >= 0) & (positions < n)
        if not np.array_equal(order[inside], expected[positions[inside]]):
            raise SystemExit(f"orders: round {r} client {cid} epoch {e}: the engine read "
                             f"{order[inside].tolist()} at positions {positions[inside].tolist()}, "
                             f"the file says {expected[positions[inside]].tolist()}")
        seen.setdefault((r, j, e), set()).update(int(p) for p in positions[inside])
    missing = [(r, j, e) for (r, j, e) in where.values()
               if seen.get((r, j, e), set()) != set(range(int(orders.train_counts[schedule[r, j]])))]
    if missing:
        r, j, e = missing[0]
        raise SystemExit(f"orders: {len(missing)} (round, client, epoch) not read in full by the "
                         f"engine, e.g. round {r} client {schedule[r, j]} epoch {e}")
    return dict(epochs_checked=len(where), calls=len(recorder.calls), calls_other_keys=unknown)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job")
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--batch-order", required=True, choices=MODES)
    parser.add_argument("--shuffle-seed", type=int, default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    write(args.job, args.rounds, args.batch_order, args.shuffle_seed, args.out)
    print(f"orders: {args.batch_order}, shuffle seed {args.shuffle_seed}, {args.rounds} rounds -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
