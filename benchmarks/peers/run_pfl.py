"""Runs a prepared job in pfl-research (PyTorch backend; its own venv) and prints its RESULT line.

    .venvs/pfl/bin/python benchmarks/peers/run_pfl.py work/pgfed.npz --rounds 5 --threads 2
    python3 benchmarks/peers/run_pfl.py work/pgfed.npz --rounds 5 --device cuda

pfl's public API as its CIFAR-10 benchmark uses it (benchmarks/image_classification/pytorch/
train.py): a `PyTorchModel` around the network (with the `loss` and `metrics` methods pfl calls),
`torch.optim.SGD` as the local optimizer (created afresh for every client, momentum from the
job) and as the central optimizer with the server learning rate, `FederatedAveraging` run by a
`SimulatedBackend` with `WeightByDatapoints` (the engine's n_i-weighted mean; the CIFAR job's
clients are all of size 50, so pfl's default per-user weighting would be the same), a
`FederatedDataset` whose user sampler returns the job's schedule in order, and
`NNTrainHyperParams(local_num_epochs, local_learning_rate, local_batch_size)`. pfl batches each
user's data in order, the last batch partial: ⌈n/B⌉ steps an epoch; with `--orders FILE`
(orders.py) a user's epoch e of round r visits its samples in the file's order instead (a
`Dataset` whose e-th pass in batches of B is permuted; pfl calls `iter(B)` once an epoch). Steps are counted in `loss`,
which pfl's SGD step calls once a batch. One process (pfl's multi-worker mode needs Horovod or
torch.distributed; not used). A callback times each central iteration; the central model is
evaluated once after the last one on every client's test samples.

`--device` sets pfl's device (`PFL_PYTORCH_DEVICE`, read by `pytorch_ops.get_default_device`;
without it pfl takes a GPU whenever one is visible, so `cpu` is explicit too). On `cuda` the
job's samples are put on the GPU once (resident), so pfl's per-batch `to_tensor` moves nothing,
and the round clock synchronises the GPU. One process per GPU: pfl's PyTorch multi-process mode
is torch.distributed (`torchrun`), whose context takes NCCL whenever a GPU is visible and puts
rank k on `cuda:LOCAL_RANK`; several ranks sharing one GPU were not tried here.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import common  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job")
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="torch.set_num_threads (default: the machine's cores)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="pfl's PyTorch device (default cpu)")
    parser.add_argument("--orders", metavar="FILE",
                        help="batch orders (orders.py): each user's epoch e of round r visits its "
                             "samples in the file's order (default: pfl's, in stored order)")
    args = parser.parse_args(argv)
    t_launch = common.launch_time()
    load_start = common.loadavg()
    os.environ["PFL_PYTORCH_DEVICE"] = args.device         # read by pfl when it places tensors

    import pfl
    import torch  # noqa: F401  (pfl needs it imported before its own torch modules)
    import torch_models
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNTrainHyperParams
    from pfl.internal.ops import pytorch_ops
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    job = common.Job(args.job)
    m = job.meta
    torch.manual_seed(m["seed"])
    x = torch.from_numpy(job.normalised_nchw()).to(device)
    y = torch.from_numpy(job.y).to(device)
    sync()
    steps = [0]

    net = torch_models.make(job)
    cross_entropy = torch.nn.CrossEntropyLoss()

    def loss(self, xb, yb):                    # pfl's train step calls this once per batch
        steps[0] += 1
        self.train()
        return cross_entropy(self(xb), yb)

    def metrics(self, xb, yb, eval=False):     # noqa: A002 (pfl's keyword)
        self.eval()
        with torch.no_grad():
            out = self(xb)
        n = len(yb)
        return {"loss": Weighted(float(cross_entropy(out, yb)) * n, n),
                "accuracy": Weighted(float((out.argmax(1) == yb).sum()), n)}

    net.loss = loss.__get__(net)
    net.metrics = metrics.__get__(net)
    params = [p for p in net.parameters() if p.requires_grad]
    model = PyTorchModel(model=net,
                         local_optimizer_create=functools.partial(torch.optim.SGD, momentum=m["momentum"]),
                         central_optimizer=torch.optim.SGD(params, lr=m["server_lr"]))

    order = iter(job.schedule[:args.rounds].reshape(-1).tolist())
    orders = None
    if args.orders:
        orders = common.Orders(args.orders)
        orders.check_job(job, args.rounds)
    batch = m["batch_size"]
    served = [0]                  # epochs batched in the file's orders (checked at the end)

    class OrderedDataset(Dataset):
        """A user's data whose k-th pass in batches of B (pfl's local training calls `iter(B)`
        once an epoch) visits the samples in the order of epoch k from the orders file; other
        passes (evaluation, with the whole user as one batch) as pfl's Dataset."""

        def __init__(self, raw_data, user_id, perms):
            super().__init__(raw_data=raw_data, user_id=user_id)
            self._perms, self._epoch = perms, 0

        def iter(self, batch_size):  # noqa: A003 (pfl's name)
            if batch_size != batch or len(self) <= batch:   # (n ≤ B: one batch, any order)
                yield from super().iter(batch_size)
                return
            if self._epoch >= len(self._perms):
                raise RuntimeError(f"user {self.user_id}: batched more than {len(self._perms)} epochs")
            perm = self._perms[self._epoch]
            self._epoch += 1
            served[0] += 1
            xs, ys = self.raw_data
            for start in range(0, len(perm), batch):
                idx = perm[start:start + batch]
                yield [xs[idx], ys[idx]]

    trained: list[int] = []       # users pfl asked for, in order (checked against the schedule)
    made = [0]                    # users made so far: the k-th is in round k // M

    def make_user(uid: int) -> Dataset:
        trained.append(int(uid))
        r = made[0] // job.schedule.shape[1]
        made[0] += 1
        rows = job.train_rows(uid)
        if orders is None:
            return Dataset(raw_data=[x[rows], y[rows]], user_id=str(uid))
        perms = [torch.from_numpy(orders.of(r, int(uid), e)).to(device)
                 for e in range(m["local_epochs"])]
        return OrderedDataset([x[rows], y[rows]], str(uid), perms)

    training = FederatedDataset(make_user, lambda: next(order),
                                user_id_to_weight={i: int(c) for i, c in enumerate(job.train_counts)})
    backend = SimulatedBackend(training_data=training, val_data=training,
                               postprocessors=[WeightByDatapoints()])

    class Timer(TrainingProcessCallback):
        def __init__(self):
            self.round_s, self.steps, self.t_ready = [], [], None

        def on_train_begin(self, *, model):
            sync()
            self.t_ready = self.t_prev = time.time()
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            sync()
            now = time.time()
            self.round_s.append(now - self.t_prev)
            self.t_prev = now
            self.steps.append(steps[0])
            steps[0] = 0
            users = sorted(trained)
            trained.clear()
            expected = sorted(int(i) for i in job.schedule[central_iteration])
            if users != expected:
                raise RuntimeError(f"iteration {central_iteration}: pfl trained users {users}, "
                                   f"the schedule says {expected}")
            return False, Metrics()

    timer = Timer()
    algorithm_params = NNAlgorithmParams(central_num_iterations=args.rounds,
                                         evaluation_frequency=args.rounds + 1,
                                         train_cohort_size=m["per_round"], val_cohort_size=0)
    train_params = NNTrainHyperParams(local_learning_rate=m["lr"], local_num_epochs=m["local_epochs"],
                                      local_batch_size=m["batch_size"])
    FederatedAveraging().run(algorithm_params=algorithm_params, backend=backend, model=model,
                             model_train_params=train_params, callbacks=[timer])
    t0 = time.time()
    correct, count = torch_models.accuracy(net, x[job.test_rows()], y[job.test_rows()])
    eval_s = time.time() - t0
    final_logits = torch_models.probe_logits(net, job.probe_x)
    expected = [sum(job.steps_per_client(int(i)) for i in job.schedule[r]) for r in range(args.rounds)]
    if orders is not None:
        want = sum(m["local_epochs"] for r in range(args.rounds) for i in job.schedule[r]
                   if job.train_counts[i] > batch)
        if served[0] != want:
            raise SystemExit(f"--orders: pfl batched {served[0]} user epochs in the file's orders, "
                             f"expected {want}")
    common.emit(dict(framework="pfl-research", algo="fedavg", job=m["job"], rounds=args.rounds,
                     startup_s=timer.t_ready - t_launch, compile_s=0.0, round_s=timer.round_s,
                     steps=timer.steps, expected_steps=expected,
                     accuracy=common.weighted_accuracy(correct, count), eval_s=eval_s,
                     probe_logits=final_logits, load_start=load_start, load_end=common.loadavg(),
                     settings=dict(device=args.device, pfl_device=str(pytorch_ops.get_default_device()),
                                   device_name=(torch.cuda.get_device_name(0) if args.device == "cuda"
                                                else "cpu"), processes_per_gpu=1 if args.device == "cuda" else 0,
                                   batch_order=orders.describe() if orders else "pfl's own (stored order)",
                                   ordered_epochs=served[0],
                                   torch_threads=torch.get_num_threads(), niceness=os.nice(0),
                                   omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", ""),
                                   torch=torch.__version__, version=getattr(pfl, "__version__", "?"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
