"""Runs a prepared job in Flower's simulation engine (Ray; its own venv); prints its RESULT line.

    FLWR_TELEMETRY_ENABLED=0 RAY_USAGE_STATS_ENABLED=0 \
        .venvs/flower/bin/python benchmarks/peers/run_flower.py work/pgfed.npz --rounds 5
        ... run_flower.py work/pgfed.npz --rounds 5 --device cuda --client-gpus 0.25

Flower's public Message API (flwr 1.2x-1.4x): a `ServerApp` whose main runs the built-in
`flwr.serverapp.strategy.FedAvg` (weighted by "num-examples", as the engine's n_i-weighted
mean) for R rounds, a `ClientApp` with a `@train()` function, and `flwr.simulation.
run_simulation` with one virtual SuperNode per client. The strategy's `configure_train` is
overridden to send round r's messages to the job's clients `schedule[r]`: client p is always
the p-th SuperNode (node ids sorted), and the message's config names p, whose data the client
trains on. The client builds the network, loads the received arrays, and trains E epochs of
batch B with a fresh `torch.optim.SGD` (lr, momentum from the job) over its data shuffled each
epoch (`torch.randperm`, seeded by the job's seed or `--shuffle-seed`, the round and the client;
with `--orders FILE` the file's order of that round, client and epoch: orders.py), the last
batch partial (⌈n/B⌉ steps), and returns its arrays, "num-examples" and the
steps it took. Federated evaluation is off (fraction_evaluate 0); the final arrays are evaluated
once after the last round on every client's test samples.

Ray: `--client-cpus` is each client's `num_cpus` (Flower's default 2: on a 2-core machine one
actor at a time, torch with 2 threads in it); each actor reports its torch threads and niceness
(Ray starts its workers at niceness 15 unless RAY_worker_niceness says otherwise).

GPU (`--device cuda`): Flower's fractional GPUs, `client_resources` `num_gpus` = `--client-gpus`
(default 0.25: up to four client actors share the GPU, as many as `--client-cpus` allows); each
worker keeps the job's samples on the GPU (loaded once per worker), trains there and returns
its arrays on the CPU; the final evaluation runs in the driver on the CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import common  # noqa: E402


def client_train(msg, context):
    """The ClientApp's train function: E local epochs on the partition the config names."""
    import torch
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    config = msg.content["config"]
    if str(config["peers_dir"]) not in sys.path:
        sys.path.insert(0, str(config["peers_dir"]))
    import common as c  # by name: its cache lives as long as the Ray worker
    import torch_models

    device = str(config["device"])
    job, x, y = c.cached_tensors(str(config["job"]), device)

    threads = int(config["threads"])
    if threads > 0:
        torch.set_num_threads(threads)
    m = job.meta
    p = int(config["partition"])
    rows = job.train_rows(p)
    xs, ys = x[rows], y[rows]
    net = torch_models.build(m["torch_model"], tuple(m["shape"]), m["num_classes"])
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    net.to(device)
    net.train()
    opt = torch.optim.SGD(net.parameters(), lr=m["lr"], momentum=m["momentum"])
    loss_fn = torch.nn.CrossEntropyLoss()
    steps = 0
    gen = torch.Generator().manual_seed(int(config["seed"]))
    orders = c.cached_orders(str(config["orders"])) if str(config["orders"]) else None
    for epoch in range(m["local_epochs"]):
        if orders is None:
            order = torch.randperm(len(ys), generator=gen).to(device)
        else:           # the orders file's: round r = server round − 1
            order = torch.from_numpy(orders.of(int(config["server-round"]) - 1, p, epoch)).to(device)
        for j in range(0, len(ys), m["batch_size"]):
            idx = order[j:j + m["batch_size"]]
            opt.zero_grad()
            loss_fn(net(xs[idx]), ys[idx]).backward()
            opt.step()
            steps += 1
    metrics = MetricRecord({"num-examples": len(ys), "local-steps": steps, "data-loads": len(c._TENSORS),
                            "ordered-epochs": m["local_epochs"] if orders is not None else 0,
                            "torch-threads": torch.get_num_threads(), "niceness": os.nice(0),
                            "pid": os.getpid(), "on-gpu": int(xs.is_cuda)})
    arrays = {k: v.detach().cpu() for k, v in net.state_dict().items()}
    return Message(RecordDict({"arrays": ArrayRecord(arrays), "metrics": metrics}),
                   reply_to=msg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job")
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--client-cpus", type=float, default=2.0,
                        help="Ray num_cpus per client (default 2, Flower's default)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the clients train (default cpu)")
    parser.add_argument("--client-gpus", type=float, default=0.25,
                        help="Ray num_gpus per client with --device cuda (default 0.25)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch.set_num_threads in each client (default: the client's CPUs)")
    parser.add_argument("--orders", metavar="FILE",
                        help="batch orders (orders.py): client i's epoch e of round r visits its "
                             "samples in the file's order (default: torch.randperm each epoch)")
    parser.add_argument("--shuffle-seed", type=int, default=None,
                        help="without --orders: mix this seed into the clients' randperm seeds "
                             "(another draw of batch orders; data and initial weights unchanged)")
    args = parser.parse_args(argv)
    t_launch = common.launch_time()
    load_start = common.loadavg()

    import flwr
    import torch
    import torch_models
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    job = common.Job(os.path.abspath(args.job))
    m = job.meta
    orders_path = os.path.abspath(args.orders) if args.orders else ""
    if orders_path:
        orders = common.Orders(orders_path)
        orders.check_job(job, args.rounds)
        batch_order = orders.describe()
    else:
        batch_order = "Flower client's own (torch.randperm each epoch" + (
            f", shuffle seed {args.shuffle_seed})" if args.shuffle_seed is not None else ")")
    # torch.Generator seed of client p's epochs in round t: the run's seed, or the shuffle seed.
    shuffle_base = m["seed"] if args.shuffle_seed is None else 7_919 * (args.shuffle_seed + 1)
    threads = args.threads or max(1, int(args.client_cpus))
    out: dict = {"round_s": [], "steps": [], "workers": set(), "ordered_epochs": 0}

    class ScheduledFedAvg(FedAvg):
        """FedAvg whose round r trains the job's clients schedule[r − 1] (server rounds from 1)."""

        def configure_train(self, server_round, arrays, config, grid):
            now = time.time()
            if "t_ready" not in out:
                out["t_ready"] = out["t_prev"] = now
            while len(nodes := sorted(grid.get_node_ids())) < job.num_clients:
                time.sleep(0.05)        # the SuperNodes register (only before round 1)
            messages = []
            for p in job.schedule[server_round - 1]:
                cfg = ConfigRecord({"partition": int(p), "job": job_path, "peers_dir": HERE,
                                    "device": args.device,
                                    "threads": threads, "server-round": server_round,
                                    "orders": orders_path,
                                    "seed": int(shuffle_base * 1_000_003 + server_round * 10_007 + p)})
                messages.append(Message(RecordDict({"arrays": arrays, "config": cfg}),
                                        message_type="train", dst_node_id=nodes[int(p)]))
            return messages

        def aggregate_train(self, server_round, replies):
            replies = list(replies)
            failed = [r for r in replies if r.has_error()]
            if failed:
                raise RuntimeError(f"round {server_round}: {failed[0].error.reason}")
            result = super().aggregate_train(server_round, replies)
            metrics = [r.content["metrics"] for r in replies]
            out["steps"].append(int(sum(mm["local-steps"] for mm in metrics)))
            out["ordered_epochs"] += int(sum(mm["ordered-epochs"] for mm in metrics))
            out["workers"].update((int(mm["pid"]), int(mm["torch-threads"]), int(mm["niceness"]),
                                   int(mm["on-gpu"])) for mm in metrics)
            now = time.time()
            out["round_s"].append(now - out["t_prev"])
            out["t_prev"] = now
            return result

    job_path = os.path.abspath(args.job)
    net = torch_models.make(job)
    server = ServerApp()

    @server.main()
    def server_main(grid: Grid, context: Context) -> None:
        strategy = ScheduledFedAvg(fraction_train=1.0, fraction_evaluate=0.0,
                                   min_available_nodes=job.num_clients)
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()),
                                num_rounds=args.rounds)
        out["final"] = result.arrays

    client = ClientApp()
    client.train()(client_train)

    torch.set_num_threads(os.cpu_count())       # the driver's threads: the final evaluation
    gpus = args.client_gpus if args.device == "cuda" else 0.0
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU")
    init_args = {"num_cpus": os.cpu_count(), "log_to_driver": True}
    if args.device == "cuda":
        init_args["num_gpus"] = torch.cuda.device_count()
    run_simulation(server_app=server, client_app=client, num_supernodes=job.num_clients,
                   backend_config={"client_resources": {"num_cpus": args.client_cpus, "num_gpus": gpus},
                                   "init_args": init_args})
    if "final" not in out or len(out["round_s"]) != args.rounds:
        raise SystemExit(f"Flower finished {len(out['round_s'])} of {args.rounds} rounds")
    net.load_state_dict(out["final"].to_torch_state_dict())
    t0 = time.time()
    x = torch.from_numpy(job.normalised_nchw()[job.test_rows()])
    y = torch.from_numpy(job.y[job.test_rows()])
    correct, count = torch_models.accuracy(net, x, y)
    eval_s = time.time() - t0
    final_logits = torch_models.probe_logits(net, job.probe_x)
    expected = [sum(job.steps_per_client(int(i)) for i in job.schedule[r]) for r in range(args.rounds)]
    workers = sorted(out["workers"])
    if orders_path and out["ordered_epochs"] != m["local_epochs"] * args.rounds * job.schedule.shape[1]:
        raise SystemExit(f"--orders: the clients batched {out['ordered_epochs']} epochs in the "
                         "file's orders, expected every scheduled client's every epoch")
    common.emit(dict(framework="flower", algo="fedavg", job=m["job"], rounds=args.rounds,
                     startup_s=out["t_ready"] - t_launch, compile_s=0.0, round_s=out["round_s"],
                     steps=out["steps"], expected_steps=expected,
                     accuracy=common.weighted_accuracy(correct, count), eval_s=eval_s,
                     probe_logits=final_logits, load_start=load_start, load_end=common.loadavg(),
                     settings=dict(device=args.device, client_gpus=gpus,
                                   device_name=(torch.cuda.get_device_name(0) if args.device == "cuda"
                                                else "cpu"),
                                   batch_order=batch_order, ordered_epochs=out["ordered_epochs"],
                                   client_cpus=args.client_cpus, ray_workers=len({w[0] for w in workers}),
                                   worker_torch_threads=sorted({w[1] for w in workers}),
                                   worker_niceness=sorted({w[2] for w in workers}),
                                   workers_on_gpu=sorted({w[3] for w in workers}),
                                   ray_worker_niceness_env=os.environ.get("RAY_worker_niceness", ""),
                                   omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", ""),
                                   telemetry=os.environ.get("FLWR_TELEMETRY_ENABLED", ""),
                                   torch=torch.__version__, version=flwr.__version__)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
