"""A sweep's runs as one algorithm: V runs of N clients are one program of V·N clients.

Runs that differ only in their seed (model initialisation and client sampling) and in scalar
hyperparameters that the algorithm uses only in arithmetic (`AlgorithmSpec.traceable`: lr, μ,
λ, β, …) share every shape. `stack` builds ONE `Algorithm` of them, which `core.Program` runs
like any other, with every placement (data on the devices, the host or sharded; client state
on the devices or the host) and `rounds_per_call`:

  * clients: run v's client i is client v·N + i of a dataset whose client table is the runs'
    one tiled V times (`tiled`: the samples are not copied). The algorithm declares
    `client_blocks` = V: host state keeps each run's rows apart and starts each run from its
    own initial rows, and host data stages each run's participants (M per run, run by run);
  * state (`RunsState`): the runs' per-client leaves with that [V·N] leading axis (what a state
    placement places), every other leaf and the traced hyperparameters with a leading [V] axis
    (`SPLIT_FIELDS`: with several devices each device holds whole runs);
  * keys: one per run, and `core.program.round_key` folds the round into each: run v uses the
    keys of a plain run with seed v (init fold_in(key(seed), 0), rounds fold_in(key(seed), 1)
    folded with the round), so each run reproduces `runner.run` with its seed;
  * a round: `vmap` of the algorithm's round over the runs, the traced hyperparameters entering
    as arrays (`spec.build(model, {…, "lr": <tracer>})`); on several devices inside a
    `shard_map` over them, each device training its own whole runs with no communication;
  * evaluation: every run at once (vmapped), or, where a program evaluates in groups of
    clients (client state or data off the devices), run by run, a group of one run's clients
    at a time.

The data (partition) is shared by all runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from fedjax_pfl import algorithms, core
from fedjax_pfl.core import layout
from fedjax_pfl.core.rows import ClientRows
from fedjax_pfl.errors import OptionError, arg, marked

Params = Any


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of a group: its seed and the values of the traced hyperparameters."""

    seed: int
    traced: tuple[tuple[str, float], ...] = ()

    @property
    def label(self) -> str:
        hp = " ".join(f"{k}={v:g}" for k, v in self.traced)
        return f"{hp} seed={self.seed}".strip()


class RunsState(NamedTuple):
    """The state of V stacked runs (module docstring); the lists hold the leaves of one run's
    state in its flattened order, split by kind (`_Kinds`)."""

    rows: list          # per-client leaves (host rows under host state placement), [V·N, ...]
    device_rows: list   # per-client leaves that stay on the devices (DEVICE_CLIENT_FIELDS)
    shared: list        # every other leaf, [V, ...]
    hp: dict            # the traced hyperparameters, [V] each
    CLIENT_FIELDS = ("rows", "device_rows")
    DEVICE_CLIENT_FIELDS = ("device_rows",)
    SPLIT_FIELDS = ("shared", "hp")


class _Kinds:
    """Which leaves of one run's state are per-client host rows, per-client device rows or
    shared, and how the leaves go back together."""

    def __init__(self, abstract: Params, num_clients: int):
        mask = layout.client_mask(abstract, num_clients)
        host = layout.host_mask(abstract, mask)
        self.treedef = jax.tree.structure(abstract)
        self.kind = [0 if h else 1 if c else 2
                     for c, h in zip(jax.tree.leaves(mask), jax.tree.leaves(host))]

    def split(self, state: Params) -> tuple[list, list, list]:
        leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, ClientRows))
        return tuple([a for a, k in zip(leaves, self.kind) if k == j] for j in range(3))

    def join(self, rows: list, device_rows: list, shared: list) -> Params:
        parts = [iter(rows), iter(device_rows), iter(shared)]
        return self.treedef.unflatten([next(parts[k]) for k in self.kind])


def tiled(data, runs: int):
    """`data` with its client table tiled `runs` times (run v's client i at v·N + i; x and y
    shared, not copied). Its padding clients are those after the last run's real clients: the
    earlier runs' padding clients sit inside, and only this module reads them."""
    n, real = data.num_clients, data.num_real_clients
    tile = lambda a: np.tile(a, runs) if isinstance(a, np.ndarray) else jnp.tile(a, runs)
    return dataclasses.replace(data, clients=jax.tree.map(tile, data.clients),
                               real_clients=(runs - 1) * n + real)


def _by_run(tree, runs: int):
    """Leaves [V·k, ...] as [V, k, ...]."""
    return jax.tree.map(lambda a: a.reshape((runs, -1) + a.shape[1:]), tree)


def _flat(tree):
    """Leaves [V, k, ...] as [V·k, ...]."""
    return jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), tree)


def _run_keys(key: jax.Array, runs: int) -> jax.Array:
    """One key per run: the given [V] keys, or a single key split into V."""
    return jax.random.split(key, runs) if key.ndim == 0 else key


def _over_runs(fn: Callable, split_args: tuple, whole_args: tuple):
    """fn(*split, *whole) for the runs: `split_args` lead with the runs' axis (or a multiple of
    it: [V·k]), `whole_args` are every run's. Without a mesh in the trace's context, fn sees
    every run; with one, `shard_map` gives each device its own whole runs (the clients axis is
    then split by hand, so the algorithm's client mapper runs on one device:
    `layout.context_mesh`) and fn's outputs (leading with the local runs) are put together."""
    mesh = layout.context_mesh()
    if mesh is None:
        return fn(*split_args, *whole_args)
    runs, whole = P(layout.AXIS), P()
    specs = (jax.tree.map(lambda _: runs, split_args), jax.tree.map(lambda _: whole, whole_args))
    return jax.shard_map(lambda s, w: fn(*s, *w), mesh=mesh, in_specs=specs, out_specs=runs,
                         check_vma=False)(split_args, whole_args)


def stack(algo_name: str, model, data, static_hparams: dict, runs: Sequence[RunSpec],
          blocks: int = 1):
    """(the runs' algorithm, the tiled dataset it runs on, [V'] seeds, V'): the `runs` of
    `algo_name` on `data` as one algorithm (module docstring), V' = len(runs) padded to a
    multiple of `blocks` (the devices: each holds whole runs) with copies of the last run whose
    results are dropped. ValueError for what cannot vary inside one program."""
    spec = algorithms.spec(algo_name)
    traced_names = sorted({k for r in runs for k, _ in r.traced})
    for r in runs:
        if sorted(k for k, _ in r.traced) != traced_names:
            raise ValueError("every run of a group must set the same traced hyperparameters")
    bad = [k for k in traced_names if k not in spec.traceable]
    if bad:
        raise ValueError(f"{algo_name} cannot vary {bad} inside one program (traceable: "
                         f"{list(spec.traceable)}); run those values one after another")
    for r in runs:          # every concrete combination is validated like a normal run
        try:
            resolved = spec.resolve({**static_hparams, **dict(r.traced)})
        except ValueError as e:
            # Which run of the group: its seed and traced values (the check's own message
            # names the value at fault).
            raise OptionError(f"run {r.label} of {algo_name}: {marked(e)}") from None
    if resolved["backend"] in core.EAGER_BACKENDS:
        raise OptionError(f"a vectorised sweep needs {arg('backend')} chunked or vmap")
    static = {k: v for k, v in resolved.items() if k not in traced_names}
    first = spec.build(model, {**static, **dict(runs[0].traced)})
    # (Poisson-sampled rounds fill their unused slots with an empty padding client.)
    data = data.pad_clients(1, minimum=int(resolved["sampling"] == "poisson"))
    n = data.num_clients
    try:
        abstract = jax.eval_shape(first.init, jax.eval_shape(lambda: jax.random.key(0)), data)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
            jax.errors.TracerBoolConversionError, jax.errors.TracerIntegerConversionError):
        raise ValueError(f"{algo_name}'s init needs concrete data (its state's shapes depend on "
                         "it), so its runs cannot share one vmapped program: run the seeds one "
                         "by one") from None
    kinds = _Kinds(abstract, n)
    count = -(-len(runs) // blocks) * blocks
    order = list(range(len(runs))) + [len(runs) - 1] * (count - len(runs))
    seeds = np.asarray([runs[i].seed for i in order], np.uint32)
    hp = {k: jnp.asarray([dict(runs[i].traced)[k] for i in order], jnp.float32)
          for k in traced_names}
    name = f"{algo_name} ({count} runs)"
    real = data.num_real_clients

    def _run_data(data, clients):
        """One run's view of the tiled dataset: its own block of the client table."""
        return dataclasses.replace(data, clients=clients, real_clients=real)

    def build(hp_v: dict) -> algorithms.Algorithm:
        """The algorithm with one run's traced hyperparameters (inside the trace)."""
        return spec.build(model, {**static, **hp_v})

    def state_of(state_v: Params, hp_v: dict) -> RunsState:
        return RunsState(*kinds.split(state_v), hp_v)

    def init(key, data):
        keys = _run_keys(key, count)

        def local(keys, hp, clients, x, y):
            d = dataclasses.replace(data, x=x, y=y)

            def one(k, hp_v, clients_v):
                return tuple(kinds.split(build(hp_v).init(k, _run_data(d, clients_v))))
            rows, dev, shared = jax.vmap(one)(keys, hp, _by_run(clients, keys.shape[0]))
            return _flat(rows), _flat(dev), shared, hp

        rows, dev, shared, hp_out = _over_runs(local, (keys, hp, data.clients), (data.x, data.y))
        return RunsState(rows, dev, shared, hp_out)

    def unpack_rows(rows: list, runs_here: int):
        """Per-client host rows as per-run arrays: ClientRows of a call's world (B blocks, one
        per run: `core.world`) as (ids [V, W], rows [V, W, ...]); arrays as [V, N, ...]."""
        if rows and isinstance(rows[0], ClientRows):
            ids = rows[0].ids
            return _by_run(ids, runs_here), [_by_run(r.rows, runs_here) for r in rows]
        return None, _by_run(rows, runs_here)

    def round_fn(state: RunsState, data, key):
        keys = _run_keys(key, count)
        world = state.rows[0] if state.rows and isinstance(state.rows[0], ClientRows) else None
        ids_arg = world.ids if world is not None else jnp.zeros(count, jnp.int32)
        rows_arg = [r.rows for r in state.rows] if world is not None else state.rows
        run_index = jnp.arange(count, dtype=jnp.int32)

        def local(run_index, keys, ids, rows, dev, shared, hp, clients, x, y):
            v_here = keys.shape[0]
            d = dataclasses.replace(data, x=x, y=y)

            def one(v, k, ids_v, rows_v, dev_v, shared_v, hp_v, clients_v):
                if world is not None:     # this run's block of the world, in its own ids
                    rows_v = [ClientRows(ids_v - v * n, r) for r in rows_v]
                s = kinds.join(rows_v, dev_v, shared_v)
                (s, m), found = core.checks.checked(build(hp_v).round_fn)(
                    s, _run_data(d, clients_v), k)
                rows_v, dev_v, shared_v = kinds.split(s)
                if world is not None:
                    rows_v = [r.rows for r in rows_v]
                return (rows_v, dev_v, shared_v, m, jnp.asarray(m["sampled"]) + v * n), found

            ids_v = _by_run(ids, v_here) if world is not None else ids
            (rows, dev, shared, m, sampled), found = jax.vmap(one)(
                run_index, keys, ids_v, _by_run(rows, v_here), _by_run(dev, v_here), shared, hp,
                _by_run(clients, v_here))
            return _flat(rows), _flat(dev), shared, m, sampled, found

        rows, dev, shared, m, sampled, found = _over_runs(
            local, (run_index, keys, ids_arg, rows_arg, state.device_rows, state.shared,
                    state.hp, data.clients), (data.x, data.y))
        core.checks.note_each(found)
        if world is not None:
            rows = [ClientRows(world.ids, r, world.mesh) for r in rows]
        return RunsState(rows, dev, shared, state.hp), {"runs": m, "sampled": jnp.ravel(sampled)}

    def participants(data, key):
        keys = _run_keys(key, count)

        def local(run_index, keys, hp, clients):
            def one(v, k, hp_v, clients_v):
                return build(hp_v).participants(_run_data(data, clients_v), k) + v * n
            return jax.vmap(one)(run_index, keys, hp, _by_run(clients, keys.shape[0]))

        ids = _over_runs(local, (jnp.arange(count, dtype=jnp.int32), keys, hp, data.clients), ())
        return jnp.ravel(ids)

    def evaluate(state: RunsState, data, ids=None):
        if ids is None:
            return _evaluate_all(state, data)
        return _evaluate_group(state, data, jnp.asarray(ids, jnp.int32))

    def _evaluate_all(state: RunsState, data):
        def local(rows, dev, shared, hp, clients, x, y):
            v_here = clients.train_count.shape[0] // n
            d = dataclasses.replace(data, x=x, y=y)

            def one(rows_v, dev_v, shared_v, hp_v, clients_v):
                s = kinds.join(rows_v, dev_v, shared_v)
                return build(hp_v).evaluate(s, _run_data(d, clients_v))
            out = jax.vmap(one)(_by_run(rows, v_here), _by_run(dev, v_here), shared, hp,
                                _by_run(clients, v_here))
            return _flat(out)

        return _over_runs(local, (state.rows, state.device_rows, state.shared, state.hp,
                                  data.clients), (data.x, data.y))

    def _evaluate_group(state: RunsState, data, ids):
        """Clients `ids`, all of one run (`VectorProgram.evaluate` asks run by run)."""
        v = ids[0] // n
        lo = v * n
        block = lambda a: jax.lax.dynamic_slice_in_dim(a, lo, n)
        if state.rows and isinstance(state.rows[0], ClientRows):
            rows = [ClientRows(r.ids - lo, r.rows, r.mesh) for r in state.rows]
        else:
            rows = [block(a) for a in state.rows]
        s = kinds.join(rows, [block(a) for a in state.device_rows],
                       [a[v] for a in state.shared])
        hp_v = {k: a[v] for k, a in state.hp.items()}
        clients = jax.tree.map(block, data.clients)
        return build(hp_v).evaluate(s, _run_data(data, clients), ids - lo)

    algo = algorithms.Algorithm(
        name=name, init=init, round_fn=round_fn, evaluate=evaluate,
        hparams=resolved,
        host_state=first.host_state, data_blocks=False,
        participants=participants if first.participants is not None else None,
        client_blocks=count, frozen=first.frozen)   # (one base shared by every run)
    return algo, tiled(data, count), seeds, count
