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
      client key  = fold_in(train key, i)                  (algorithms.engine.client_keys)
      epoch key   = fold_in(client key, e)                 (LocalTrainer, as the client starts)
      π_{r,i,e}   = epoch_permutation(epoch key, n_i, 0 … n_i − 1)

  With --shuffle-seed S the epoch key is folded once more, fold_in(epoch key, S), and
  run_fedjax.py folds S into the engine's epoch keys the same way: another draw of orders,
  independent of the seed that sets the data, the split and the initial weights.
--batch-order in-order: the identity (pfl-research's default: a user's data in stored order).

`patch_engine` (run_fedjax.py) replaces the two halves of `fedjax_pfl.core.local.epoch_permutation`
for the run: `shuffle_draws` (an epoch key's random draws; LocalTrainer makes every epoch's as a
client starts) with the fold of S, and `shuffled` (the permutation from the draws, at each step)
with the identity where asked. In every mode it records through `jax.debug.callback` each draw's
key and each step's draws, positions and order, which `check_recorded` compares with the file:
every step of every scheduled client must have read exactly the file's positions. The library
itself is not changed.
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
    """What the patched halves of `epoch_permutation` saw: the key of every draw, and the draws,
    n, positions and order of every step (joined by the draws, which name their key)."""

    def __init__(self):
        self.keys: dict[bytes, tuple] = {}     # draws -> the key words they came from
        self._steps: list[tuple] = []

    @staticmethod
    def _name(pair, bits) -> bytes:
        return np.asarray(pair, np.int32).tobytes() + np.asarray(bits, np.uint32).tobytes()

    def draw(self, key_data, pair, bits):
        key_data, pair, bits = np.asarray(key_data), np.asarray(pair), np.asarray(bits)
        if key_data.ndim > 1:                          # batched (vmap over clients, epochs)
            for i in range(key_data.shape[0]):
                self.draw(key_data[i], pair[i], bits[i])
            return
        self.keys[self._name(pair, bits)] = tuple(int(w) for w in key_data.ravel())

    def step(self, pair, bits, n, positions, order):
        pair, bits, n = np.asarray(pair), np.asarray(bits), np.asarray(n)
        positions, order = np.asarray(positions), np.asarray(order)
        if pair.ndim > 1:                              # batched
            for i in range(pair.shape[0]):
                self.step(pair[i], bits[i], n[i] if n.ndim else n,
                          positions[i] if positions.ndim > 1 else positions, order[i])
            return
        self._steps.append((self._name(pair, bits), int(n), positions.copy(), order.copy()))

    def joined(self) -> list[tuple]:
        """(key words or None, n, positions, order) of every step recorded."""
        return [(self.keys.get(name), n, positions, order)
                for name, n, positions, order in self._steps]


def patch_engine(mode: str, shuffle_seed: int | None) -> Recorder:
    """Replaces `fedjax_pfl.core.local.shuffle_draws` and `shuffled` (what LocalTrainer and
    `epoch_permutation` call) for this process: `mode` engine folds `shuffle_seed` (if any) into
    the epoch key, in-order returns the positions themselves; every draw and step is recorded
    (the key as the engine gave it)."""
    import jax
    import jax.numpy as jnp

    from fedjax_pfl.core import local

    draws_of = getattr(local.shuffle_draws, "unpatched", local.shuffle_draws)
    shuffled = getattr(local.shuffled, "unpatched", local.shuffled)
    if mode not in MODES:
        raise ValueError(f"batch order {mode!r}: one of {MODES}")
    recorder = Recorder()

    def shuffle_draws(key, n):
        draws = draws_of(fold_shuffle(key, shuffle_seed) if mode == "engine" else key, n)
        jax.debug.callback(recorder.draw, jax.random.key_data(key), draws.pair, draws.bits)
        return draws

    def patched_shuffled(draws, n, positions, unroll=None):
        if mode == "engine":
            out = shuffled(draws, n, positions, unroll)
        else:
            x = jnp.asarray(positions, jnp.int32)
            inside = (x >= 0) & (x < jnp.maximum(jnp.asarray(n, jnp.int32), 1))
            out = jnp.where(inside, x, 0)
        jax.debug.callback(recorder.step, draws.pair, draws.bits, jnp.asarray(n, jnp.int32),
                           jnp.asarray(positions, jnp.int32), out)
        return out

    shuffle_draws.unpatched, patched_shuffled.unpatched = draws_of, shuffled
    local.shuffle_draws, local.shuffled = shuffle_draws, patched_shuffled
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
    calls = recorder.joined()
    for key, n, positions, order in calls:
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
    return dict(epochs_checked=len(where), calls=len(calls), calls_other_keys=unknown)


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
