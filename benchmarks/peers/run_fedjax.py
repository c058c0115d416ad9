"""Runs a prepared job in fedjax_pfl (the repository's environment) and prints its RESULT line.

    python benchmarks/peers/run_fedjax.py work/pgfed.npz --algo fedavg --rounds 5 [--devices 1]
    python benchmarks/peers/run_fedjax.py work/pgfed.npz --algo fedavg --rounds 5 --device cuda

The Program is the one `experiments/run.py` builds (its flags give the hyperparameters: model,
local epochs, batch, lr, momentum with a buffer reset every round, as the peers' fresh
optimizers have; no drop_last: ⌈n/B⌉ steps an epoch, the last batch partial), on the job's data
(`FederatedData.from_blocks`) and with the job's per-round clients: the algorithm's round is
wrapped so that `core.sample_clients` returns `schedule[state.round]` instead of drawing, and
every round's "sampled" metric is checked against the schedule. Start-up (process start to the
first round: imports, data to device, compile of the round and evaluation, init) is reported
apart from the rounds; the job's accuracy is evaluated once after the last round.

Batch order: the engine's own (`core.local.epoch_permutation` under its keys) unless
`--orders FILE` (orders.py: the file's orders, engine's with a shuffle seed folded in or stored
order; the engine's `epoch_permutation` is patched for the run and every step's positions are
checked against the file) or `--shuffle-seed S` (the engine's permutation, S folded into its
keys). Either adds a host callback per local step: round times are then not comparable.

`--device cpu` (default) runs on XLA:CPU with one device per core (or `--devices`); `--device
cuda` on JAX's GPU backend (JAX_PLATFORMS=cuda, one GPU: the engine's mesh holds the local GPUs).
The job's initial weights were made on XLA:CPU (`prepare.py`); on a GPU the engine's own
initial weights are compared with them (the same draws, computed by another backend)
rather than bit for bit (to 1e-5 relative), and the largest difference is reported.

Memory. The run starts only if its memory plan (`Program.memory_plan`, after compiling: client
state, data, the larger of the round's and the evaluation's working sets) needs at most
--memory-margin of the available memory. PGFedMo keeps a model and an auxiliary vector per
client: on the cifar10 job (1,000 clients) 6.2 GB a device. Its round's working set is 1.2 GB a
device (the same at 250, 500 and 1,000 clients), but its evaluation of every client's
personalised model compiles to 9.3 GB of temporaries a device, 1.5× the client state at 250, 500
and 1,000 clients and the same with chunks of 1, 5 and the automatic size (three copies of every
client's model, likely because the chunked map gathers all its rows in cost order before mapping
them): 31.9 GB planned on 2 devices against 22 GB. `--state-placement auto` (default) then keeps
the client state on the host (`core.Program(state_placement="host")`, the CLI's
`--state-placement host`: a copy-on-write store holding the rows of the clients some round has
written; each round moves its participants' rows to the devices and back, with the same results;
evaluation in groups of 64 clients): planned 5.3 GB for 2 rounds, including 12.4 MB of host rows
per client trained. FedAvg has no client state and stays on the devices. The chosen placement,
the plan and the engine's automatic chunk sizes (clients mapped → chunk; `--chunk-size` fixes
one) are in the result's settings. On host placement the pre-clock evaluation is one group of
clients (its program compiled with the round), not all.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)

import common  # noqa: E402


def scheduled(algo, schedule, round_keys=None):
    """`algo` whose rounds train `schedule[state.round]` (ids [R, M]) instead of sampling.

    The wrapper puts the traced round counter where the patched `core.sample_clients` (called by
    `Engine.sample`, which keeps its device-balancing order) can read it while the round traces.
    With `round_keys` (host state placement) the round is found from the round's key instead,
    `fold_in(round_keys, r)` for r < R: the program then also asks `Algorithm.participants` which
    clients' rows to move to the devices, probing the round with a stand-in state of zeros whose
    counter reads 0 in every round, while the key is the round's own."""
    import jax
    import jax.numpy as jnp

    from fedjax_pfl import core

    table = jnp.asarray(schedule, jnp.int32)
    rounds = table.shape[0]
    keys = None
    if round_keys is not None:
        keys = jnp.stack([jax.random.key_data(jax.random.fold_in(round_keys, r)).reshape(-1)
                          for r in range(rounds)])                            # [R, key words]
    current = {}
    draw = getattr(core.sample_clients, "unpatched", core.sample_clients)   # one patch per process

    def sample_clients(key, num_clients, num_sampled):
        if "round" not in current:
            return draw(key, num_clients, num_sampled)
        if num_sampled != table.shape[1]:
            raise ValueError(f"the engine samples {num_sampled} clients a round, the schedule {table.shape[1]}")
        return table[jnp.minimum(current["round"], rounds - 1)]

    def round_of(state, key):
        if keys is None:
            return state.round
        match = jnp.all(keys == jax.random.key_data(key).reshape(1, -1), axis=1)
        return jnp.where(jnp.any(match), jnp.argmax(match), state.round)

    def round_fn(state, data, key):
        current["round"] = round_of(state, key)
        try:
            return algo.round_fn(state, data, key)
        finally:
            current.pop("round", None)

    sample_clients.unpatched = draw
    core.sample_clients = sample_clients
    return algo._replace(round_fn=round_fn)


def recording_chunk_sizes() -> list:
    """(clients mapped, automatic chunk size) of every client map the engine sizes itself
    (`MapperCache.auto_chunk`, the `--chunk-size 0` path), recorded while the program compiles."""
    from fedjax_pfl.core import execution

    seen: list = []
    auto_chunk = execution.MapperCache.auto_chunk

    def recorded(self, fn, key, specs, rows):
        width = auto_chunk(self, fn, key, specs, rows)
        if (rows, width) not in seen:
            seen.append((int(rows), int(width)))
        return width

    execution.MapperCache.auto_chunk = recorded
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job")
    parser.add_argument("--algo", default="fedavg", choices=("fedavg", "pgfedmo"))
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="JAX's backend: XLA:CPU (default) or the GPU")
    parser.add_argument("--devices", type=int, default=None,
                        help="XLA:CPU devices (default: one per core, as run.py; --device cpu only)")
    parser.add_argument("--compile-cache", action="store_true",
                        help="use JAX's persistent compilation cache (default off: a cold start)")
    parser.add_argument("--memory-margin", type=float, default=0.5,
                        help="start only if the memory plan needs at most this share of the "
                             "available memory (default 0.5)")
    parser.add_argument("--state-placement", default="auto", choices=("auto", "device", "host"),
                        help="where the per-client state waits between rounds (core.Program): "
                             "'device' (sharded over the XLA devices), 'host' (a host store; each "
                             "round moves its participants' rows), 'auto' (default): device, "
                             "unless the device plan would exceed --memory-margin and the "
                             "algorithm can keep its client state on the host")
    parser.add_argument("--chunk-size", type=int, default=0,
                        help="clients per vectorised chunk (the CLI's --chunk-size; default 0: the "
                             "engine's automatic size, reported in the result)")
    parser.add_argument("--orders", metavar="FILE",
                        help="batch orders (orders.py): the engine's epoch orders become the "
                             "file's (its mode: engine, with its shuffle seed folded into the keys, "
                             "or in-order), and every step is checked against them (FedAvg only)")
    parser.add_argument("--shuffle-seed", type=int, default=None,
                        help="without --orders: fold this seed into the engine's epoch keys (another "
                             "draw of batch orders; data, split and initial weights unchanged)")
    args = parser.parse_args(argv)
    t_launch = common.launch_time()
    load_start = common.loadavg()

    # Before JAX starts: a GPU that fails to start is an error, not a silent fall-back to the CPU.
    os.environ["JAX_PLATFORMS"] = "cpu" if args.device == "cpu" else "cuda,cpu"
    import fedjax_pfl

    devices = fedjax_pfl.use_cpu_cores(args.devices) if args.device == "cpu" else 1
    if args.compile_cache:
        fedjax_pfl.use_compile_cache()
    import jax
    import numpy as np

    if args.device == "cuda" and jax.devices()[0].platform != "gpu":
        raise SystemExit(f"--device cuda: JAX runs on {jax.devices()[0].platform}")
    from experiments import run as cli
    from fedjax_pfl import algorithms, core, models
    from fedjax_pfl.data.federated import FederatedData

    job = common.Job(args.job)
    m = job.meta
    if args.rounds > job.schedule.shape[0]:
        raise SystemExit(f"the job schedules {job.schedule.shape[0]} rounds, asked for {args.rounds}")
    # Batch order (orders.py): patch the engine's shuffle before anything compiles.
    orders, recorder, batch_order = None, None, "engine's own"
    if args.orders:
        if args.algo != "fedavg":
            raise SystemExit("--orders: the orders are FedAvg's epoch keys; run --algo fedavg")
        import orders as order_files

        orders = common.Orders(args.orders)
        orders.check_job(job, args.rounds)
        recorder = order_files.patch_engine(orders.meta["mode"], orders.meta["shuffle_seed"])
        batch_order = orders.describe()
    elif args.shuffle_seed is not None:
        import orders as order_files

        recorder = order_files.patch_engine("engine", args.shuffle_seed)
        batch_order = f"engine's own, shuffle seed {args.shuffle_seed}"
    flags = ["--algo", args.algo, "--model", m["model"], "--clients", str(job.num_clients),
             "--participation", repr(m["per_round"] / job.num_clients),
             "--local-epochs", str(m["local_epochs"]), "--batch-size", str(m["batch_size"]),
             "--lr", repr(m["lr"]), "--momentum", repr(m["momentum"]), "--momentum-buffer", "reset",
             "--rounds", str(args.rounds), "--seed", str(m["seed"]), "--quiet", "--no-memory-check",
             "--no-compile-cache", "--chunk-size", str(args.chunk_size)]
    if args.algo == "pgfedmo":
        flags += ["--pgfed-mu", "0.1", "--pgfed-alpha-lr", "0.01"]     # the pgfed_paper preset's
    cfg = cli.config_from_args(cli.parse(flags))
    hparams = dict(cfg.validate())
    # PGFed's registered defaults (its paper protocol) include drop_last, which the command line
    # can only switch on: every side here takes ⌈n/B⌉ steps an epoch, the last batch partial.
    hparams["drop_last"] = False
    data = FederatedData.from_blocks(job.x, job.y, job.train_counts, job.test_counts,
                                     num_classes=m["num_classes"], input_scale=m["input_scale"],
                                     input_shift=m["input_shift"], name=m["job"])
    model = models.get(m["model"], data.input_shape, data.num_classes, conv=cfg.model_conv)
    root = jax.random.key(m["seed"])
    round_keys = jax.random.fold_in(root, 1)
    chunks = recording_chunk_sizes()
    # Clients whose rows the host store holds after the run (host placement: copy-on-write).
    written = len(np.unique(job.schedule[:args.rounds]))

    def build(placement):
        algo = scheduled(algorithms.get(args.algo, model=model, **hparams), job.schedule,
                         round_keys if placement == "host" else None)
        return core.Program(algo, data, mesh=core.client_mesh(), jit=True, state_placement=placement)

    def needs(plan):
        """Bytes the run needs from the available memory: the plan, and with host placement the
        store's rows of the clients the run's rounds write (the plan counts only the rows a
        round moves to the devices)."""
        store = written * plan.host_row_bytes if plan.state_placement == "host" else 0
        return plan.total + store

    def too_big(plan):
        return not plan.fits() or (plan.available > 0 and needs(plan) > args.memory_margin * plan.available)

    placement, declined = args.state_placement, []
    program = build("device" if placement == "auto" else placement)
    if placement == "auto":
        # Before compiling the plan has no working set; an evaluation's temporaries can exceed
        # the client state (PGFedMo on the cifar10 job: 9.3 GB a device beside 6.2 GB of state),
        # so count it at least twice here and skip a device compile that would not be used.
        guess = program.memory_plan()
        guess.working_set = guess.client_state_per_device
        host_ok = getattr(program.algo, "host_state", False)
        placement = "host" if host_ok and too_big(guess) else "device"
        if placement == "host":
            program = build("host")
    compile_s = program.compile(round_keys)         # (allocates no state)
    # The plan after compiling: before, it has no working set. PGFedMo on the cifar10 job (1,000
    # clients) was planned before compiling at 13.4 GB of 20.4 GB and peaked at 21.6 GB (killed
    # by the OOM killer on 2026-11-25). XLA's compiler itself holds ~0.8 GB more than the plan
    # (pgfedmo, 300 clients: plan 6.4 GB, growth 7.2 GB), hence the margin.
    plan = program.memory_plan()
    if (args.state_placement == "auto" and placement == "device" and too_big(plan)
            and getattr(program.algo, "host_state", False)):
        declined.append(dict(placement="device", compile_s=compile_s, needs_mb=needs(plan) / 2**20))
        placement = "host"
        program = build("host")
        compile_s = program.compile(round_keys)
        plan = program.memory_plan()
    if too_big(plan):
        common.emit(dict(framework="fedjax_pfl", algo=args.algo, job=m["job"], rounds=args.rounds,
                         skipped=" ".join(plan.describe().split())))
        return 0
    chunk_sizes = ([dict(clients=r, chunk=w) for r, w in chunks] if args.chunk_size == 0
                   else [dict(chunk=args.chunk_size)])
    memory = dict(state_placement=placement, planned_mb=round(needs(plan) / 2**20, 1),
                  available_mb=round(plan.available / 2**20, 1), margin=args.memory_margin,
                  working_set_mb=round(max(plan.working_set, plan.eval_working_set) / 2**20, 1),
                  declined=declined)
    auto_host = placement == "host" and args.state_placement == "auto"
    print(f"fedjax_pfl {args.algo}: client state on the {placement}"
          f"{' (auto: the device plan would not fit)' if auto_host else ''}"
          f"; plan {memory['planned_mb']:,.0f} MB of {memory['available_mb']:,.0f} MB available; "
          f"chunk sizes {chunk_sizes}", flush=True)
    state = program.init(jax.random.fold_in(root, 0))
    init_diff = 0.0
    if args.algo == "fedavg":       # the peers load the same initial weights (prepare.py)
        for name, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]:
            key = "/".join(str(getattr(k, "key", k)) for k in name)
            ours, theirs = np.asarray(leaf), job.params[key]
            init_diff = max(init_diff, float(np.max(np.abs(ours - theirs))) if ours.size else 0.0)
            same = (np.array_equal(ours, theirs) if args.device == "cpu"
                    else ours.shape == theirs.shape and np.allclose(ours, theirs, rtol=1e-5, atol=1e-6))
            if not same:
                raise SystemExit(f"the engine's initial {key} differs from the job's "
                                 f"(max |diff| {init_diff:.3g})")
    # The evaluation runs once before the clock starts (compiled then on device placement). On
    # host placement `compile` has compiled it for one group of clients; one group's evaluation
    # warms the rest (moving the group's rows), where all 1,000 clients' would take ~40 s.
    warm = program.evaluate(state) if placement == "device" else program.evaluate(
        state, np.sort(job.schedule[0]).astype(np.int32))
    jax.block_until_ready(warm)
    jax.block_until_ready(state)
    t_ready = time.time()

    round_s, steps = [], []
    t_prev = t_ready
    for r in range(args.rounds):
        state, metrics = program.run_rounds(state, round_keys, r, 1)
        jax.block_until_ready(state)
        now = time.time()
        round_s.append(now - t_prev)
        t_prev = now
        sampled = sorted(int(i) for i in np.asarray(metrics[0]["sampled"]))
        if sampled != sorted(int(i) for i in job.schedule[r]):
            raise SystemExit(f"round {r}: the engine trained {sampled}, the schedule says {job.schedule[r].tolist()}")
        steps.append(int(metrics[0]["client_steps"]))
    order_check = None
    if orders is not None:
        order_check = order_files.check_recorded(recorder, orders, args.rounds)
    elif recorder is not None:
        order_check = dict(calls=len(recorder.joined()))
    store = getattr(state, "store", None)          # host placement: the rows the rounds wrote
    host_store_mb = round(store.nbytes() / 2**20, 1) if store is not None else 0.0
    t0 = time.time()
    result = program.evaluate(state)["client"]
    correct, count = int(np.sum(result.correct)), int(np.sum(result.count))
    eval_s = time.time() - t0
    final_logits = None         # the global model's logits on the probe images (FedAvg)
    if args.algo == "fedavg" and getattr(state, "params", None) is not None:
        # (one program: the model applied eagerly compiled ~60 small ones, 3 s of the job)
        apply = jax.jit(model.apply)
        final_logits = np.asarray(apply(jax.device_get(state.params), job.probe_x)).astype(float).tolist()
    common.emit(dict(framework="fedjax_pfl", algo=args.algo, job=m["job"], rounds=args.rounds,
                     startup_s=t_ready - t_launch, compile_s=compile_s, round_s=round_s,
                     steps=steps, accuracy=common.weighted_accuracy(correct, count),
                     probe_logits=final_logits, eval_s=eval_s, load_start=load_start,
                     load_end=common.loadavg(),
                     settings=dict(device=args.device, device_kind=jax.devices()[0].device_kind,
                                   xla_devices=len(jax.devices()), requested_devices=devices,
                                   init_max_abs_diff=init_diff, memory=memory,
                                   chunk_sizes=chunk_sizes, host_store_mb=host_store_mb,
                                   batch_order=batch_order, order_check=order_check,
                                   xla_flags=os.environ.get("XLA_FLAGS", ""),
                                   hparams={k: hparams[k] for k in ("lr", "momentum", "momentum_buffer",
                                            "drop_last", "local_epochs", "batch_size") if k in hparams},
                                   jax=jax.__version__, version=fedjax_pfl.__version__)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
