"""The two networks in PyTorch, loaded with the engine's initial weights (pfl and Flower envs).

fedavg_cnn: the FedAvg CNN of the PGFed code (`fedjax_pfl.models.nets.FedAvgCNN`): conv 5×5 32
→ ReLU → max-pool 2 → conv 5×5 64 → ReLU → max-pool 2 → dense 512 → ReLU → dense C.
pfl_simple_cnn: pfl-research's `simple_cnn` (benchmarks/model/pytorch/cnn.py) without its two
dropouts, which is `fedjax_pfl.models.sequence`'s femnist_cnn: conv 3×3 32 → ReLU → conv 3×3 64 →
ReLU → max-pool 2 → dense 128 → ReLU → dense C.

The engine flattens NHWC feature maps, PyTorch NCHW ones: the first dense kernel's rows are
permuted from (h, w, c) to (c, h, w) order when loading, so the networks are the same function;
`check_same_function` compares the logits on the probe images with the engine's.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def build(name: str, shape, num_classes: int) -> nn.Module:
    """The network `name` for NHWC input `shape` (PyTorch sees NCHW)."""
    h, w, c = shape
    if name == "fedavg_cnn":
        side = ((h - 4) // 2 - 4) // 2
        return nn.Sequential(nn.Conv2d(c, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                             nn.Linear(64 * side * side, 512), nn.ReLU(), nn.Linear(512, num_classes))
    if name == "pfl_simple_cnn":
        side = (h - 4) // 2
        return nn.Sequential(nn.Conv2d(c, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Flatten(),
                             nn.Linear(64 * side * side, 128), nn.ReLU(), nn.Linear(128, num_classes))
    raise ValueError(f"unknown torch model {name!r}")


def load_engine_params(module: nn.Module, params: dict, shape) -> None:
    """Copies the engine's parameters (`param/Conv2D_k/kernel` HWIO, `Dense_k/kernel` [in, out])
    into `module`'s Conv2d (OIHW) and Linear ([out, in]) layers, in order."""
    convs = [m for m in module if isinstance(m, nn.Conv2d)]
    denses = [m for m in module if isinstance(m, nn.Linear)]
    with torch.no_grad():
        for k, conv in enumerate(convs):
            conv.weight.copy_(torch.from_numpy(np.transpose(params[f"Conv2D_{k}/kernel"], (3, 2, 0, 1)).copy()))
            conv.bias.copy_(torch.from_numpy(params[f"Conv2D_{k}/bias"]))
        for k, dense in enumerate(denses):
            kernel = params[f"Dense_{k}/kernel"]
            if k == 0:      # rows in the engine's (h, w, c) flatten order -> PyTorch's (c, h, w)
                channels = convs[-1].out_channels
                side = int(round((kernel.shape[0] // channels) ** 0.5))
                kernel = kernel.reshape(side, side, channels, -1).transpose(2, 0, 1, 3).reshape(kernel.shape[0], -1)
            dense.weight.copy_(torch.from_numpy(np.ascontiguousarray(kernel.T)))
            dense.bias.copy_(torch.from_numpy(params[f"Dense_{k}/bias"]))


def check_same_function(module: nn.Module, probe_x: np.ndarray, probe_logits: np.ndarray) -> float:
    """Largest |logit difference| against the engine's on the probe images; raises above 1e-3."""
    with torch.no_grad():
        out = module(torch.from_numpy(np.ascontiguousarray(np.transpose(probe_x, (0, 3, 1, 2))))).numpy()
    err = float(np.max(np.abs(out - probe_logits)))
    if not err <= 1e-3 * max(1.0, float(np.max(np.abs(probe_logits)))):
        raise SystemExit(f"the PyTorch network differs from the engine's: max |Δlogit| = {err:.3g}")
    return err


def make(job) -> nn.Module:
    """The job's network with the engine's initial weights, checked against the engine."""
    shape = tuple(job.meta["shape"])
    module = build(job.meta["torch_model"], shape, job.meta["num_classes"])
    load_engine_params(module, job.params, shape)
    check_same_function(module, job.probe_x, job.probe_logits)
    return module


def probe_logits(module: nn.Module, probe_x: np.ndarray) -> list:
    """The module's logits on the job's probe images (NHWC, normalised), as nested lists: the
    harness compares every side's final model through them."""
    module.eval()
    device = next(module.parameters()).device
    with torch.no_grad():
        x = torch.from_numpy(np.ascontiguousarray(np.transpose(probe_x, (0, 3, 1, 2)))).to(device)
        return module(x).cpu().numpy().astype(float).tolist()


def accuracy(module: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1000) -> tuple[int, int]:
    """(correct, count) of `module` on (x, y), in batches, without gradients."""
    module.eval()
    correct = 0
    with torch.no_grad():
        for j in range(0, len(y), batch):
            correct += int((module(x[j:j + batch]).argmax(1) == y[j:j + batch]).sum())
    return correct, int(len(y))
