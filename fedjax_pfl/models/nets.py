"""The networks of our source papers, as flax.linen modules on NHWC (or flat) float inputs.

BatchNorm: none of these modules keeps running statistics. The ResNets normalise with GroupNorm
(32 groups, or fewer when a layer is narrower), a stateless choice that is standard in FL (BN
statistics do not average well across non-IID clients) and that keeps every model a pure
function of its trainable parameters. So pFedSOP's Δ, cosine and Newton step cover every
trainable parameter, the GroupNorm scale and bias included (docs/algorithms/pfedsop.md#a4), and no
algorithm has to carry or average `batch_stats`. `norm="none"` removes normalisation entirely.
"""

from __future__ import annotations

import functools
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_pfl.models.layers import Conv2D, Dense, max_pool_2x2


class MLP(nn.Module):
    """Flatten → [Dense(h) → ReLU]* → Dense(num_classes).

    hidden=(100,) is the pFedMe/TDPFed DNN (784-100-10 on MNIST); hidden=() is multinomial
    logistic regression (the FedProx Synthetic(α, β) model).
    """

    num_classes: int
    hidden: Sequence[int] = (100,)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[0], -1)
        for width in self.hidden:
            x = nn.relu(Dense(width)(x))
        return Dense(self.num_classes)(x)


class FedAvgCNN(nn.Module):
    """The FedAvg CNN of the PGFed code (docs/algorithms/pgfed.md#model).

    Conv 5×5 (32, valid) → ReLU → MaxPool 2 → Conv 5×5 (64, valid) → ReLU → MaxPool 2 → Flatten
    → Dense 512 → ReLU → Dense num_classes. 878,538 parameters on 32×32×3 with 10 classes.
    `conv` is the convolutions' `impl` (layers.conv2d).
    """

    num_classes: int
    conv: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = max_pool_2x2(nn.relu(Conv2D(32, (5, 5), impl=self.conv)(x)))
        x = max_pool_2x2(nn.relu(Conv2D(64, (5, 5), impl=self.conv)(x)))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(Dense(512)(x))
        return Dense(self.num_classes)(x)


def _norm(kind: str, channels: int) -> nn.Module | None:
    if kind == "none":
        return None
    if kind == "group":
        groups = min(32, channels)
        while channels % groups:
            groups -= 1
        return nn.GroupNorm(num_groups=groups)
    raise ValueError(f"norm must be 'group' or 'none', got {kind!r}")


class ConvNormReLU(nn.Module):
    features: int
    strides: tuple[int, int] = (1, 1)
    norm: str = "group"
    conv: str = "auto"

    @nn.compact
    def __call__(self, x):
        x = Conv2D(self.features, (3, 3), self.strides, "SAME", use_bias=self.norm == "none",
                   impl=self.conv)(x)
        norm = _norm(self.norm, self.features)
        return nn.relu(norm(x) if norm is not None else x)


class ResNet9(nn.Module):
    """ResNet-9 (the DAWNBench CIFAR network), with GroupNorm in place of BatchNorm.

    prep conv(w) → conv(2w), pool, residual[conv(2w), conv(2w)] → conv(4w), pool →
    conv(8w), pool, residual[conv(8w), conv(8w)] → global max pool → Dense. w = 64 by default.
    """

    num_classes: int
    width: int = 64
    norm: str = "group"
    conv: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.width
        block = functools.partial(ConvNormReLU, norm=self.norm, conv=self.conv)
        x = block(w)(x)
        x = max_pool_2x2(block(2 * w)(x))
        x = x + block(2 * w)(block(2 * w)(x))
        x = max_pool_2x2(block(4 * w)(x))
        x = max_pool_2x2(block(8 * w)(x))
        x = x + block(8 * w)(block(8 * w)(x))
        x = jnp.max(x, axis=(1, 2))
        return Dense(self.num_classes)(x)


class BasicBlock(nn.Module):
    features: int
    strides: tuple[int, int] = (1, 1)
    norm: str = "group"
    conv: str = "auto"

    @nn.compact
    def __call__(self, x):
        bias = self.norm == "none"
        y = Conv2D(self.features, (3, 3), self.strides, "SAME", use_bias=bias, impl=self.conv)(x)
        norm = _norm(self.norm, self.features)
        y = nn.relu(norm(y) if norm is not None else y)
        y = Conv2D(self.features, (3, 3), (1, 1), "SAME", use_bias=bias, impl=self.conv)(y)
        norm = _norm(self.norm, self.features)
        y = norm(y) if norm is not None else y
        if self.strides != (1, 1) or x.shape[-1] != self.features:
            x = Conv2D(self.features, (1, 1), self.strides, "VALID", use_bias=bias)(x)
            norm = _norm(self.norm, self.features)
            x = norm(x) if norm is not None else x
        return nn.relu(x + y)


class ResNet18(nn.Module):
    """ResNet-18 for 32×32 inputs (He et al. 2016, CIFAR stem: 3×3 conv, no max pool).

    Four stages of two basic blocks (w, 2w, 4w, 8w channels; strides 1, 2, 2, 2), global average
    pool, Dense. GroupNorm replaces BatchNorm (see the module docstring).
    """

    num_classes: int
    width: int = 64
    norm: str = "group"
    conv: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = ConvNormReLU(self.width, norm=self.norm, conv=self.conv)(x)
        for stage, mult in enumerate((1, 2, 4, 8)):
            strides = (1, 1) if stage == 0 else (2, 2)
            x = BasicBlock(mult * self.width, strides, self.norm, self.conv)(x)
            x = BasicBlock(mult * self.width, (1, 1), self.norm, self.conv)(x)
        x = jnp.mean(x, axis=(1, 2))
        return Dense(self.num_classes)(x)


class VGG8(nn.Module):
    """VGG8 of TDPFed (Table I; docs/algorithms/tdpfed.md#models): five 3×3 convs 32-64-128-256-256,
    each with SAME padding, ReLU and a 2×2 max pool (32×32 → 1×1, so the flatten is exactly 256),
    then Dense 256 → ReLU → Dense 256 → ReLU → Dense num_classes. No BatchNorm or dropout (the paper
    lists none; Table I counts weights only). 1,112,650 parameters on 32×32×3 with 10 classes."""

    num_classes: int
    conv: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for width in (32, 64, 128, 256, 256):
            x = max_pool_2x2(nn.relu(Conv2D(width, (3, 3), padding="SAME", impl=self.conv)(x)))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(Dense(256)(x))
        x = nn.relu(Dense(256)(x))
        return Dense(self.num_classes)(x)


class FemnistCNN(nn.Module):
    """FedJAX's EMNIST/FEMNIST CNN (`fedjax.models.emnist.create_conv_model`, the model of Reddi et
    al. 2021, "Adaptive Federated Optimization"): Conv 3×3 (32, valid) → ReLU → Conv 3×3 (64, valid)
    → ReLU → MaxPool 2 → Flatten → Dense 128 → ReLU → Dense num_classes.

    1,206,590 parameters on 28×28×1 with 62 classes (FedJAX's emnist_test figure). FedJAX's
    dropout (0.25 after the pool, 0.5 after Dense 128) is omitted: the engine's apply is
    deterministic (no RNG). LEAF's FEMNIST CNN is a different, larger network (5×5 convs 32 and 64
    with SAME padding and pools, Dense 2048; 6,603,710 parameters) and is not this one.
    """

    num_classes: int = 62
    conv: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(Conv2D(32, (3, 3), impl=self.conv)(x))
        x = max_pool_2x2(nn.relu(Conv2D(64, (3, 3), impl=self.conv)(x)))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(Dense(128)(x))
        return Dense(self.num_classes)(x)
