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
user's data in order, the last batch partial: ⌈n/B⌉ steps an epoch. Steps are counted in `loss`,
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
    args = parser.parse_args(argv)
    t_launch = common.launch_time()
    load_start = common.loadavg()
    os.environ["PFL_PYTORCH_DEVICE"] = args.device         # read by pfl when it places tensors

    import numpy as np
    import torch

    import pfl
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNTrainHyperParams
    from pfl.metrics import Metrics, Weighted
    from pfl.internal.ops import pytorch_ops
    from pfl.model.pytorch import PyTorchModel

    import torch_models

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

    trained: list[int] = []       # users pfl asked for, in order (checked against the schedule)

    def make_user(uid: int) -> Dataset:
        trained.append(int(uid))
        rows = job.train_rows(uid)
        return Dataset(raw_data=[x[rows], y[rows]], user_id=str(uid))

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
    expected = [sum(job.steps_per_client(int(i)) for i in job.schedule[r]) for r in range(args.rounds)]
    common.emit(dict(framework="pfl-research", algo="fedavg", job=m["job"], rounds=args.rounds,
                     startup_s=timer.t_ready - t_launch, compile_s=0.0, round_s=timer.round_s,
                     steps=timer.steps, expected_steps=expected,
                     accuracy=common.weighted_accuracy(correct, count), eval_s=eval_s,
                     load_start=load_start, load_end=common.loadavg(),
                     settings=dict(device=args.device, pfl_device=str(pytorch_ops.get_default_device()),
                                   device_name=(torch.cuda.get_device_name(0) if args.device == "cuda"
                                                else "cpu"), processes_per_gpu=1 if args.device == "cuda" else 0,
                                   torch_threads=torch.get_num_threads(), niceness=os.nice(0),
                                   omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", ""),
                                   torch=torch.__version__, version=getattr(pfl, "__version__", "?"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
