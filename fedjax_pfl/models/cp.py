"""CP-decomposed models: factor pytrees, the CPDense / CPConv layers, CP-DNN and CP-VGG8.

TDPFed (Wang et al., arXiv:2208.12959, Section IV-B; docs/algorithms/tdpfed.md#layers) replaces
every weight tensor of a network by rank-R CP factors: a dense kernel [I_in, I_out] by
A_in [I_in, R] and A_out [I_out, R], a conv kernel (HWIO) [I_d, I_d, I_S, I_T] by A^(1) [I_d, R]
(rows), A^(2) [I_d, R] (columns), A^(3) [I_S, R] (input channels), A^(4) [I_T, R] (output
channels). Biases are not decomposed (docs/algorithms/tdpfed.md#a17).

A "CP parameter tree" is the dense parameter tree with each decomposed kernel replaced by a
`CPFactors` node holding the factors in the kernel's axis order, so `reconstruct(tree)` is the
dense tree and `model.apply(reconstruct(tree), x)` the CP network ("reconstruct then dense").
The CPDense / CPConv layers below compute the same outputs from the factors directly (the
paper's factored forward, eqs. 4 and 7–10), and CP-DNN / CP-VGG8 use them with parameter paths
equal to their dense counterparts'. Note the layout: the paper writes W ∈ R^{I_out×I_in} with
A^(1) the output factor; our dense kernels are [I_in, I_out] (flax), so the input factor comes
first. Counts are unaffected.

Compression rate CR = 1 means no decomposition (the identity parameterisation): the tree is the
dense tree itself.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfl.models.layers import conv2d, max_pool_2x2, torch_default_bias_init
from fedjax_pfl.ops.cp import cp_rank_for_compression, cp_reconstruct

Params = Any


@jax.tree_util.register_pytree_node_class
class CPFactors:
    """The CP factors of one tensor, in its axis order (a pytree node with N array children)."""

    def __init__(self, factors: Sequence[jax.Array]):
        self.factors = tuple(factors)

    @property
    def rank(self) -> int:
        return int(self.factors[0].shape[-1])

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the reconstructed tensor."""
        return tuple(int(f.shape[-2]) for f in self.factors)

    def tree_flatten(self):
        return self.factors, None

    @classmethod
    def tree_unflatten(cls, aux, children):
        del aux
        return cls(children)

    def __repr__(self) -> str:
        return f"CPFactors(shape={self.shape}, rank={self.rank})"


def is_cp(x: Any) -> bool:
    return isinstance(x, CPFactors)


def reconstruct(tree: Params) -> Params:
    """The dense tree: every CPFactors node replaced by ⟦factors⟧, other leaves unchanged."""
    return jax.tree.map(lambda x: cp_reconstruct(x.factors) if is_cp(x) else x, tree, is_leaf=is_cp)


def num_floats(tree: Params) -> int:
    """Floats stored (and communicated) for the tree: Σ R·Σ I_n over factors + dense leaves."""
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))


def dense_num_floats(tree: Params) -> int:
    """Floats of the dense tree the CP tree reconstructs to."""
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree, is_leaf=is_cp)))


def ranks(tree: Params) -> dict[str, int]:
    """{'Dense_0/kernel': R, …} for every decomposed tensor."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_cp)[0]:
        if is_cp(x):
            out["/".join(str(getattr(k, "key", k)) for k in path)] = x.rank
    return out


def cp_init_like(key: jax.Array, dense: Params, cr: float, *, min_ndim: int = 2) -> Params:
    """Random rank-R factors for every leaf of `dense` with ndim ≥ min_ndim; other leaves kept.

    R per tensor from TDPFed's rule (ops.cp_rank_for_compression). The paper leaves the factor
    initialisation unspecified (docs/algorithms/tdpfed.md#a26); we draw each factor entry from
    N(0, s²) with R·s^{2N} = Var(dense leaf), so ⟦A⟧ has the variance of the model's own
    initialisation of that tensor (entries of a sum of R products of N independent factors).
    CR = 1 returns `dense` itself (no decomposition).
    """
    if cr == 1:
        return dense
    leaves, treedef = jax.tree.flatten(dense)
    keys = jax.random.split(key, len(leaves))
    out = []
    for k, leaf in zip(keys, leaves):
        if leaf.ndim < min_ndim:
            out.append(leaf)
            continue
        rank = cp_rank_for_compression(leaf.shape, cr)
        variance = jnp.maximum(jnp.var(leaf), 1e-12)
        scale = (variance / rank) ** (1.0 / (2 * leaf.ndim))
        factor_keys = jax.random.split(k, leaf.ndim)
        out.append(CPFactors([scale * jax.random.normal(fk, (n, rank), leaf.dtype)
                              for fk, n in zip(factor_keys, leaf.shape)]))
    return jax.tree.unflatten(treedef, out)


# ----------------------------------------------------------------------------------------------
# Layers


def _cp_kernel_init(fan_in: int, rank: int):
    """Factors whose reconstruction has PyTorch's default kernel variance 1/(3·fan_in)."""

    def init(key, shape, dtype=jnp.float32):
        scale = (1.0 / (3.0 * fan_in) / rank) ** (1.0 / (2 * len(shape)))
        keys = jax.random.split(key, len(shape))
        return CPFactors([scale * jax.random.normal(k, (n, rank), dtype) for k, n in zip(keys, shape)])

    return init


class CPDense(nn.Module):
    """y = x ⟦A_in, A_out⟧ + b (TDPFed eq. 4), with the kernel held as rank-R CP factors.

    factored=True computes (x A_in) A_outᵀ: R·(I_in + I_out) multiply-adds per sample;
    factored=False reconstructs the [I_in, I_out] kernel first and does one dense matmul.
    Both give the same outputs; the parameter tree is {'kernel': CPFactors, 'bias'} either way.
    """

    features: int
    rank: int
    use_bias: bool = True
    factored: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        fan_in = x.shape[-1]
        kernel = self.param("kernel", _cp_kernel_init(fan_in, self.rank), (fan_in, self.features))
        a_in, a_out = kernel.factors
        y = (x @ a_in) @ a_out.T if self.factored else x @ cp_reconstruct(kernel.factors)
        if self.use_bias:
            y = y + self.param("bias", torch_default_bias_init(fan_in), (self.features,))
        return y


def _pads(padding, spatial, window, strides):
    if isinstance(padding, str):
        return jax.lax.padtype_to_pads(spatial, window, strides, padding)
    return tuple(tuple(p) for p in padding)


def cp_conv_factored(x: jax.Array, factors: Sequence[jax.Array], *, strides=(1, 1),
                     padding="VALID") -> jax.Array:
    """The four-stage CP convolution of TDPFed eqs. (7)–(10) on NHWC input.

      1. 1×1 conv I_S → R with A^(3):             u[b,h,w,r] = Σ_s x[b,h,w,s] A^(3)[s,r]
      2. depthwise conv along the width with A^(2): v[b,h,j,r] = Σ_q u[b,h,s_w·j+q,r] A^(2)[q,r]
      3. depthwise conv along the height with A^(1): w[b,i,j,r] = Σ_p v[b,s_h·i+p,j,r] A^(1)[p,r]
      4. 1×1 conv R → I_T with A^(4):              y[b,i,j,t] = Σ_r w[b,i,j,r] A^(4)[t,r]

    Equal to the cross-correlation of x with the HWIO kernel ⟦A^(1), A^(2), A^(3), A^(4)⟧. Zero
    padding is applied after stage 1 (the 1×1 conv maps zeros to zeros); a bias belongs after stage
    4 only (docs/algorithms/tdpfed.md#layers). The depthwise stages are shifted slices times
    per-channel weights, which stay elementwise under vmap over clients (no grouped convolution).
    """
    a_rows, a_cols, a_in, a_out = factors
    kh, kw = a_rows.shape[0], a_cols.shape[0]
    sh, sw = strides
    pads = _pads(padding, x.shape[1:3], (kh, kw), strides)
    u = x @ a_in                                                              # stage 1
    if any(p != (0, 0) for p in pads):
        u = jnp.pad(u, ((0, 0), pads[0], pads[1], (0, 0)))
    h, w = u.shape[1], u.shape[2]
    h_out, w_out = (h - kh) // sh + 1, (w - kw) // sw + 1
    if h_out < 1 or w_out < 1:
        raise ValueError(f"input of spatial size {h}x{w} (after padding) is smaller than the "
                         f"{kh}x{kw} kernel")
    v = sum(u[:, :, q: q + sw * (w_out - 1) + 1: sw, :] * a_cols[q] for q in range(kw))  # stage 2
    v = sum(v[:, p: p + sh * (h_out - 1) + 1: sh, :, :] * a_rows[p] for p in range(kh))  # stage 3
    return v @ a_out.T                                                        # stage 4


class CPConv(nn.Module):
    """A 2-D convolution (NHWC, HWIO kernel, cross-correlation) whose kernel is rank-R CP.

    factored=True runs `cp_conv_factored` (TDPFed's four convolutions); factored=False
    reconstructs the HWIO kernel and runs the engine's convolution (layers.conv2d with `conv`).
    Same outputs.
    """

    features: int
    kernel_size: tuple[int, int]
    rank: int
    strides: tuple[int, int] = (1, 1)
    padding: str | Sequence[tuple[int, int]] = "VALID"
    use_bias: bool = True
    factored: bool = True
    conv: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kh, kw = self.kernel_size
        cin = x.shape[-1]
        kernel = self.param("kernel", _cp_kernel_init(kh * kw * cin, self.rank),
                            (kh, kw, cin, self.features))
        if self.factored:
            y = cp_conv_factored(x, kernel.factors, strides=self.strides, padding=self.padding)
        else:
            y = conv2d(x, cp_reconstruct(kernel.factors), strides=self.strides,
                       padding=self.padding, impl=self.conv)
        if self.use_bias:
            y = y + self.param("bias", torch_default_bias_init(kh * kw * cin), (self.features,))
        return y


# ----------------------------------------------------------------------------------------------
# Networks (parameter paths equal to the dense MLP / VGG8 of models/nets.py)


class CPMLP(nn.Module):
    """CP-DNN: Flatten → [CPDense(h) → ReLU]* → CPDense(num_classes), ranks from `cr`.

    784-100-10 with CR 1.5 has ranks (59, 6) and CR 2 ranks (44, 5) (TDPFed Table I).
    """

    num_classes: int
    hidden: Sequence[int] = (100,)
    cr: float = 2.0
    factored: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[0], -1)
        widths = (*self.hidden, self.num_classes)
        for i, width in enumerate(widths):
            rank = cp_rank_for_compression((x.shape[-1], width), self.cr)
            x = CPDense(width, rank, factored=self.factored, name=f"Dense_{i}")(x)
            if i < len(widths) - 1:
                x = nn.relu(x)
        return x


VGG8_CONV_WIDTHS = (32, 64, 128, 256, 256)
VGG8_DENSE_WIDTHS = (256, 256)


class CPVGG8(nn.Module):
    """CP-VGG8 (TDPFed Table I): five CP 3×3 convs (SAME) 32-64-128-256-256, each followed by
    ReLU and a 2×2 max pool, then CP dense 256-256-num_classes with ReLUs. 32×32 inputs."""

    num_classes: int
    cr: float = 2.0
    factored: bool = True
    conv: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i, width in enumerate(VGG8_CONV_WIDTHS):
            rank = cp_rank_for_compression((3, 3, x.shape[-1], width), self.cr)
            x = CPConv(width, (3, 3), rank, padding="SAME", factored=self.factored,
                       conv=self.conv, name=f"Conv2D_{i}")(x)
            x = max_pool_2x2(nn.relu(x))
        x = x.reshape(x.shape[0], -1)
        widths = (*VGG8_DENSE_WIDTHS, self.num_classes)
        for i, width in enumerate(widths):
            rank = cp_rank_for_compression((x.shape[-1], width), self.cr)
            x = CPDense(width, rank, factored=self.factored, name=f"Dense_{i}")(x)
            if i < len(widths) - 1:
                x = nn.relu(x)
        return x


def cp_param_counts(tree: Params) -> dict[str, int]:
    """{'cp': floats of the CP tree, 'dense': floats of its reconstruction, both with biases}."""
    return {"cp": num_floats(tree), "dense": dense_num_floats(tree)}

