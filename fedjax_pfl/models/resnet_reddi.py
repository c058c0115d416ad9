"""Reddi et al. 2021's CIFAR-100 ResNet-18 ("Adaptive Federated Optimization", ICLR 2021), as a flax module.

The network is the one `create_resnet18` builds in google-research/federated's
`utils/models/resnet_models.py` (Keras; read for understanding, written anew here): a ResNet v2
(pre-activation; He et al. 2016, "Identity Mappings in Deep Residual Networks", arXiv:1603.05027)
with GroupNorm in place of BatchNorm.

    stem:   conv 7×7/2 (64, SAME, no bias) → GN → ReLU → max pool 3×3/2 (SAME)
    stages: 64, 128, 256, 512 channels, two basic blocks each, all at stride 1
    block:  y = conv3×3(ReLU(GN(x)));  y = conv3×3(ReLU(GN(y)));  out = s(x) + y
            (the very first block skips its first GN → ReLU: the stem has just applied them)
            s(x) = x, or GN(conv1×1(x)) where the channel count changes (stages 2–4, first block)
    head:   GN → ReLU → global average pool → Dense(num_classes) (logits; Keras adds a softmax)

Where it follows the repository as written rather than the textbook ResNet:
  * no stride inside the stages: `create_resnet` calls `_residual_block` with its default
    strides (1, 1), so a 32×32 image is 8×8 from the stem's pool to the head (24×24 crops: 6×6);
  * the shortcut's 1×1 conv reads the block's raw input (not the pre-activated one) and is
    followed by a GroupNorm;
  * GroupNorm is tfa's `GroupNormalization` default: 32 groups, ε = 1e-3, with scale and bias
    (every width here, 64 to 512, is a multiple of 32);
  * initialisation: He normal (truncated, fan-in, scale 2; Keras' `HeNormal`) for every conv,
    N(0, 0.01²) for the Dense kernel and zeros for its bias.
Not applied: the repository's L2 weight decay 1e-4 on every kernel (and the Dense bias), and
its input pipeline's crop to 24×24 (the module accepts any H×W; docs/presets.md reading 8).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_pfl.models.layers import conv2d, matmul_small_batch_grad

GROUPS = 32          # tfa.layers.GroupNormalization's default `groups`
GN_EPSILON = 1e-3    # tfa.layers.GroupNormalization's default `epsilon`
STAGE_WIDTHS = (64, 128, 256, 512)
BLOCKS_PER_STAGE = 2


def group_norm() -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=GROUPS, epsilon=GN_EPSILON)


class HeConv(nn.Module):
    """k×k convolution without bias, He-normal kernel (Keras HeNormal), SAME padding (TF's)."""

    features: int
    kernel_size: int
    strides: int = 1
    conv: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        k = self.kernel_size
        kernel = self.param("kernel", nn.initializers.he_normal(),
                            (k, k, x.shape[-1], self.features), jnp.float32)
        return conv2d(x, kernel, strides=(self.strides, self.strides),
                      padding="SAME" if k > 1 else "VALID", impl=self.conv)


class Head(nn.Module):
    """Dense(num_classes) with Keras' RandomNormal(stddev=0.01) kernel and zero bias."""

    num_classes: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", nn.initializers.normal(0.01),
                            (x.shape[-1], self.num_classes), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (self.num_classes,), jnp.float32)
        return matmul_small_batch_grad(x, kernel) + bias


class PreActBlock(nn.Module):
    """ResNet v2 basic block at stride 1 (the repository's `_basic_block` + `_shortcut`)."""

    features: int
    pre_activate: bool = True
    conv: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = nn.relu(group_norm()(x)) if self.pre_activate else x
        y = HeConv(self.features, 3, conv=self.conv)(y)
        y = HeConv(self.features, 3, conv=self.conv)(nn.relu(group_norm()(y)))
        shortcut = x
        if x.shape[-1] != self.features:   # 1×1 conv + GN only where the shape changes
            shortcut = group_norm()(HeConv(self.features, 1, conv=self.conv)(x))
        return shortcut + y


class ResNet18Reddi(nn.Module):
    """Reddi et al. 2021's CIFAR-100 ResNet-18 (see the module docstring for the layout).

    11,227,812 parameters with 100 classes (the count does not depend on H×W).
    """

    num_classes: int = 100
    conv: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = HeConv(STAGE_WIDTHS[0], 7, strides=2, conv=self.conv)(x)
        x = nn.relu(group_norm()(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for stage, width in enumerate(STAGE_WIDTHS):
            for block in range(BLOCKS_PER_STAGE):
                x = PreActBlock(width, pre_activate=(stage, block) != (0, 0), conv=self.conv)(x)
        x = nn.relu(group_norm()(x))
        x = jnp.mean(x, axis=(1, 2))
        return Head(self.num_classes)(x)
