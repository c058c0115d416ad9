"""Layers that stay fast when vmapped over clients.

`jax.vmap` of `lax.conv_general_dilated` over per-client kernels lowers to a grouped convolution,
which XLA:CPU runs 12× slower than the im2col below (the FedAvg CNN at 100 clients: 15 against
182 client-steps/s, and slower than a Python loop over clients too; jax 0.10.2,
docs/decisions/cnn-step.md). `Conv2D` below computes the same convolution as im2col: the kh·kw
shifted (strided) slices of the padded input are concatenated on the channel axis and multiplied
by the kernel reshaped to [kh·kw·C_in, C_out]. Under vmap this is a batched matmul, which runs at
parity with the loop. On CPU, stride-1 convolutions with enough input depth run by Winograd's
minimal filtering along the width instead (`conv2d_winograd`: 2.5× fewer multiplications for a
5×5 kernel, the FedAvg CNN's step 1.4× faster); `conv2d` picks between the two. Outputs equal
`lax.conv_general_dilated` (NHWC / HWIO, cross-correlation); tests/models/test_layers.py checks
that in float64.

Initialisation follows PyTorch's defaults (U(±1/√fan_in) for weights and biases) because the
reference codes of our papers are PyTorch; `torch_default_*` make that explicit.
"""

from __future__ import annotations

import functools
from fractions import Fraction
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

# PyTorch's kaiming_uniform_(a=√5) for weights is U(±√(1/fan_in)) = variance_scaling(1/3, fan_in, uniform).
torch_default_kernel_init = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


def torch_default_bias_init(fan_in: int):
    """U(±1/√fan_in), PyTorch's default bias initialisation for Linear and Conv2d."""
    bound = 1.0 / jnp.sqrt(max(fan_in, 1))

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def conv2d_im2col(
    x: jax.Array,
    kernel: jax.Array,
    *,
    strides: tuple[int, int] = (1, 1),
    padding: str | Sequence[tuple[int, int]] = "VALID",
) -> jax.Array:
    """NHWC × HWIO cross-correlation by im2col from shifted slices, then one matmul.

    y[b, i, j, o] = Σ_{p, q, c} x_pad[b, s_h·i + p, s_w·j + q, c] · kernel[p, q, c, o].

    Args:
      x: [B, H, W, C_in] input.
      kernel: [kh, kw, C_in, C_out].
      strides: (s_h, s_w).
      padding: "VALID", "SAME" (as in lax.conv_general_dilated) or explicit ((lo, hi), (lo, hi)).
    Returns:
      [B, H_out, W_out, C_out].
    """
    kh, kw, cin, cout = kernel.shape
    sh, sw = strides
    if isinstance(padding, str):
        pads = jax.lax.padtype_to_pads(x.shape[1:3], (kh, kw), strides, padding)
    else:
        pads = tuple(tuple(p) for p in padding)
    if any(p != (0, 0) for p in pads):
        x = jnp.pad(x, ((0, 0), pads[0], pads[1], (0, 0)))
    h, w = x.shape[1], x.shape[2]
    h_out = (h - kh) // sh + 1
    w_out = (w - kw) // sw + 1
    if h_out < 1 or w_out < 1:
        raise ValueError(
            f"input of spatial size {h}x{w} (after padding) is smaller than the {kh}x{kw} kernel"
        )
    if kh == 1 and kw == 1:
        patches = x[:, : sh * (h_out - 1) + 1 : sh, : sw * (w_out - 1) + 1 : sw, :]
    elif (sh, sw) == (1, 1):
        patches = im2col_patches(x, kh, kw)
    else:
        patches = _shifted_slices(x, kh, kw, h_out, w_out, sh, sw)
    return patches_matmul(patches, kernel.reshape(kh * kw * cin, cout))


def _shifted_slices(x, kh, kw, h_out, w_out, sh, sw):
    # Order (p, q, c) matches kernel.reshape(kh * kw * cin, cout) of an HWIO kernel. Two
    # concatenations, the kw column shifts and then the kh row shifts of those rows, copy
    # fewer and longer runs than one concatenation of kh·kw slices (whose runs are C floats):
    # 0.20 → 0.10 ms for conv 1 (C = 1) and 0.36 → 0.30 ms for conv 2 of the FedAvg CNN at
    # batch 10, one core.
    rows = jnp.concatenate([x[:, :, q : q + sw * (w_out - 1) + 1 : sw, :] for q in range(kw)],
                           axis=-1)
    return jnp.concatenate([rows[:, p : p + sh * (h_out - 1) + 1 : sh] for p in range(kh)],
                           axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def im2col_patches(x: jax.Array, kh: int, kw: int) -> jax.Array:
    """Stride-1 im2col patches of (already padded) NHWC x: [B, H-kh+1, W-kw+1, kh·kw·C] with
    patches[b, i, j, (p·kw + q)·C + c] = x[b, i + p, j + q, c].

    Its transpose (col2im) is custom: autodiff of the slices pads each of the kh·kw patch
    gradients to the full input shape and adds them, so every input element sums kh·kw terms,
    padding zeros included (for a 5×5 kernel on a 12×12 input, 56 % of the 25 × 144 terms are
    zeros), each behind a bounds check. Here each patch gradient is added in place into its own
    window (dynamic_update_slice), touching only real terms: the FedAvg CNN's conv-2 col2im at
    batch 10 goes from 0.78 to 0.31 ms on one core (docs/decisions/cnn-step.md). Same values up to
    the order of float additions (tests/models/test_layers.py checks against lax.conv). Like
    `patches_matmul`, reverse mode and forward-over-reverse only (custom_vjp).
    """
    h_out, w_out = x.shape[1] - kh + 1, x.shape[2] - kw + 1
    return _shifted_slices(x, kh, kw, h_out, w_out, 1, 1)


def _im2col_forward(x, kh, kw):
    return im2col_patches(x, kh, kw), x.shape


def _col2im(kh, kw, x_shape, g):
    b, h_out, w_out, _ = g.shape
    c = x_shape[-1]
    g = g.reshape(b, h_out, w_out, kh * kw, c)
    dx = jnp.zeros(x_shape, g.dtype)
    for p in range(kh):
        for q in range(kw):
            window = (0, p, q, 0)
            summed = jax.lax.dynamic_slice(dx, window, (b, h_out, w_out, c)) + g[..., p * kw + q, :]
            dx = jax.lax.dynamic_update_slice(dx, summed, window)
    return (dx,)


im2col_patches.defvjp(_im2col_forward, _col2im)


def _matmul_with_kernel_gradient(kernel_gradient: Callable[[jax.Array, jax.Array], jax.Array]):
    """x @ kernel (x [..., K], kernel [K, H]) with a custom reverse-mode rule: the input gradient
    is g kernelᵀ and the kernel gradient Σ_r x_r ⊗ g_r is `kernel_gradient(x2, g2)` on the rows
    flattened to x2 [R, K] and g2 [R, H], computed in whichever form XLA runs fastest. Forward
    mode applied to the function itself is not supported (custom_vjp); forward-over-reverse
    (jax.jvp of jax.grad, Per-FedAvg HF) is."""

    @jax.custom_vjp
    def matmul(x, kernel):
        return x @ kernel

    def forward(x, kernel):
        return x @ kernel, (x, kernel)

    def backward(residuals, g):
        x, kernel = residuals
        x2 = x.reshape(-1, x.shape[-1])
        g2 = g.reshape(-1, g.shape[-1])
        return g @ kernel.T, kernel_gradient(x2, g2).astype(kernel.dtype)

    matmul.defvjp(forward, backward)
    return matmul


def _canonical_matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b computed in exactly that operand order: optimisation barriers keep XLA from
    folding a transpose of `a` (or of the result) into the dot's contraction dimensions."""
    return jax.lax.optimization_barrier(jax.lax.optimization_barrier(a) @ b)


def _patches_kernel_gradient(p2: jax.Array, g2: jax.Array) -> jax.Array:
    # Transpose the narrower operand, so the GEMM's output rows are the fewer: conv 1 of the
    # FedAvg CNN (K = 25, C_out = 32) as Pᵀ G took 0.32 ms against 0.61 as (Gᵀ P)ᵀ; conv 2
    # (K = 800, C_out = 64) as (Gᵀ P)ᵀ 1.71 ms against 1.87 as Pᵀ G (batch 10, one core).
    if p2.shape[1] <= g2.shape[1]:
        return _canonical_matmul(p2.T, g2)
    return _canonical_matmul(g2.T, p2).T


_patches_matmul = _matmul_with_kernel_gradient(_patches_kernel_gradient)


def patches_matmul(patches: jax.Array, kernel: jax.Array) -> jax.Array:
    """patches @ kernel for im2col patches [..., K] and a kernel [K, C_out], whose kernel
    gradient runs as a GEMM that XLA:CPU's fast path accepts.

    The kernel gradient is ∂L/∂W = Pᵀ G (P: patches [R, K], G: output gradient [R, C_out],
    contraction over the R = batch · positions rows). Left to itself, XLA:CPU emits it as a dot
    contracting both operands' first dimension, which falls back to Eigen at ~60 GFLOP/s; with
    the narrower operand transposed and materialised (Pᵀ G for conv 1 of the FedAvg CNN,
    (Gᵀ P)ᵀ for conv 2) and the transposes kept out of the dot, it runs through the YNNPACK
    GEMM at ~80 GFLOP/s: the engine's FedAvg CNN step at batch 10 went from 6.06 to 5.46 ms on
    one core (docs/decisions/cnn-step.md, "Step kernels"). Values are those of autodiff up to float
    rounding (tests/models/test_layers.py).
    """
    return _patches_matmul(patches, kernel)


# Finite interpolation points of Winograd's minimal filtering, in the order they are taken
# (the last point is always ∞). Small magnitudes and reciprocal pairs keep the transforms'
# entries small, so the float32 error stays near the direct convolution's (Lavin & Gray 2016).
_WINOGRAD_POINTS = (0, 1, -1, 2, -2, Fraction(1, 2), Fraction(-1, 2), 3, -3, Fraction(1, 3))


@functools.lru_cache(maxsize=None)
def winograd_matrices(m: int, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Aᵀ [m, n], G [n, r], Bᵀ [n, n] of Winograd's F(m, r), n = m + r - 1, for correlation:
    y = Aᵀ [(G g) ⊙ (Bᵀ d)] gives y_i = Σ_k d_{i+k} g_k, i < m, for a filter g of r taps and an
    input tile d of n values (Lavin & Gray, "Fast Algorithms for Convolutional Neural Networks",
    CVPR 2016, eq. 7).

    Derived as the transpose of Toom–Cook polynomial multiplication at the points
    `_WINOGRAD_POINTS[: n - 1]` and ∞: with V the [n, n] evaluation matrix of polynomials of
    degree < n (row j = powers of point j; the ∞ row picks the leading coefficient), V_r and V_m
    its first r and m columns, Aᵀ = V_mᵀ, G = V_r and Bᵀ = V⁻ᵀ. Computed in exact rational
    arithmetic, then rounded once to float64.
    """
    n = m + r - 1
    if not (1 <= m and 1 <= r and n - 1 <= len(_WINOGRAD_POINTS)):
        raise ValueError(f"F({m}, {r}) needs {n - 1} finite points; at most "
                         f"{len(_WINOGRAD_POINTS)} are defined")
    points = [Fraction(a) for a in _WINOGRAD_POINTS[: n - 1]]
    v = [[a ** k for k in range(n)] for a in points] + [[Fraction(int(k == n - 1)) for k in range(n)]]
    # Gauss–Jordan inverse of v, exact.
    aug = [row[:] + [Fraction(int(i == j)) for j in range(n)] for i, row in enumerate(v)]
    for col in range(n):
        pivot = next(i for i in range(col, n) if aug[i][col] != 0)
        aug[col], aug[pivot] = aug[pivot], aug[col]
        scale = aug[col][col]
        aug[col] = [e / scale for e in aug[col]]
        for i in range(n):
            if i != col and aug[i][col] != 0:
                factor = aug[i][col]
                aug[i] = [e - factor * f for e, f in zip(aug[i], aug[col])]
    v_inv = [row[n:] for row in aug]
    a_t = np.array([[float(v[j][i]) for j in range(n)] for i in range(m)])
    a_t[m - 1, n - 1] = 1.0  # the ∞ row of V_m: the product's leading coefficient
    a_t[: m - 1, n - 1] = 0.0
    g = np.array([[float(v[j][k]) for k in range(r)] for j in range(n)])
    g[n - 1] = 0.0
    g[n - 1, r - 1] = 1.0
    b_t = np.array([[float(v_inv[j][i]) for j in range(n)] for i in range(n)])
    return a_t, g, b_t


def _linear_combinations(matrix: np.ndarray, terms: Sequence[jax.Array]) -> list[jax.Array]:
    """[Σ_u matrix[i, u] · terms[u] for each row i], skipping zero coefficients, so XLA fuses each
    into one elementwise loop (the transforms' entries are mostly 0 and ±1)."""
    out = []
    for row in matrix:
        acc = None
        for c, t in zip(row, terms):
            if c == 0:
                continue
            t = t if c == 1 else -t if c == -1 else t * float(c)
            acc = t if acc is None else acc + t
        out.append(acc if acc is not None else jnp.zeros_like(terms[0]))
    return out


def winograd_tile(kw: int, w_out: int, max_tile: int = 8) -> int:
    """The output tile m of F(m, kw) along the width: the one with the fewest transform points
    per output column, T·n / w_out with T = ⌈w_out / m⌉ tiles of n = m + kw - 1 points, among
    tiles of at most `max_tile` points (larger ones lose float32 accuracy)."""
    best = None
    for m in range(2, max_tile - kw + 2):
        cost = (-(-w_out // m)) * (m + kw - 1) / w_out
        if best is None or cost < best[0] - 1e-12:
            best = (cost, m)
    if best is None:
        raise ValueError(f"no Winograd tile of at most {max_tile} points for a kernel width {kw}")
    return best[1]


def conv2d_winograd(
    x: jax.Array,
    kernel: jax.Array,
    *,
    padding: str | Sequence[tuple[int, int]] = "VALID",
    tile: int | None = None,
) -> jax.Array:
    """Stride-1 NHWC × HWIO cross-correlation with Winograd's minimal filtering F(m, kw) along
    the width and im2col along the height.

    y[b, i, t·m + a, o] = Σ_j Aᵀ[a, j] Σ_{(p, c)} (Bᵀ d_{b,i,t})[j, (p, c)] · (G k)[j, (p, c), o],

    where d_{b,i,t}[u, (p, c)] = x_pad[b, i + p, t·m + u, c] (u < n = m + kw - 1) are the kh input
    rows of output row i over the columns of width tile t, and (G k)[j] the kernel transformed
    along its width (Lavin & Gray 2016, eq. 7, in one dimension). The n transform points are n
    GEMMs [B·H_out·T, kh·C_in] × [kh·C_in, C_out], m/n as many multiplications per output as
    im2col's one GEMM of depth kh·kw·C_in: for the FedAvg CNN's conv 2 (5×5, 32 → 64 channels,
    8×8 outputs) F(4, 5) does 2.5× fewer, and its forward and backward take half the time of
    im2col's on one core (docs/decisions/cnn-step.md). Float32 results differ from the direct sum
    by rounding only, with 2–6× im2col's error depending on the tile (F(4, 5) about 2×, F(6, 3)
    and F(6, 2) 4–6× on random data; tests/models/test_layers.py compares both with lax.conv in
    float64). Gradients by autodiff, which is Winograd's form again, so forward
    mode works too.

    Args:
      x: [B, H, W, C_in].
      kernel: [kh, kw, C_in, C_out].
      padding: "VALID", "SAME" or explicit ((lo, hi), (lo, hi)).
      tile: m, the outputs per width tile; None picks `winograd_tile(kw, W_out)`.
    """
    kh, kw, cin, cout = kernel.shape
    if isinstance(padding, str):
        pads = jax.lax.padtype_to_pads(x.shape[1:3], (kh, kw), (1, 1), padding)
    else:
        pads = tuple(tuple(p) for p in padding)
    b, h, w = x.shape[0], x.shape[1] + sum(pads[0]), x.shape[2] + sum(pads[1])
    h_out, w_out = h - kh + 1, w - kw + 1
    if h_out < 1 or w_out < 1:
        raise ValueError(
            f"input of spatial size {h}x{w} (after padding) is smaller than the {kh}x{kw} kernel"
        )
    m = winograd_tile(kw, w_out) if tile is None else tile
    a_t, g, b_t = winograd_matrices(m, kw)
    n = m + kw - 1
    tiles = -(-w_out // m)
    # Columns past the input feed only the outputs past w_out, which are cropped.
    extra = (tiles - 1) * m + n - w
    if any(p != (0, 0) for p in pads) or extra > 0:
        x = jnp.pad(x, ((0, 0), pads[0], (pads[1][0], pads[1][1] + max(extra, 0)), (0, 0)))
    rows = jnp.concatenate([x[:, p : p + h_out] for p in range(kh)], axis=-1)
    columns = [rows[:, :, u : u + (tiles - 1) * m + 1 : m].reshape(-1, kh * cin) for u in range(n)]
    kernel_by_column = kernel.transpose(1, 0, 2, 3).reshape(kw, kh * cin, cout)
    products = [d @ k for d, k in zip(_linear_combinations(b_t, columns),
                                      _linear_combinations(g, list(kernel_by_column)))]
    outputs = _linear_combinations(a_t, products)
    y = jnp.stack([o.reshape(b, h_out, tiles, cout) for o in outputs], axis=3)
    return y.reshape(b, h_out, tiles * m, cout)[:, :, :w_out]


CONV_IMPLS = ("auto", "im2col", "winograd")
# auto: Winograd needs this much depth per kernel column (kh·C_in) to pay; the FedAvg CNN's
# conv 1 on one-channel images (5 × 1) ran 2–3 % slower with it, TDPFed's VGG8 conv 1 (3 × 3)
# the same as im2col (docs/decisions/cnn-step.md).
WINOGRAD_MIN_DEPTH = 8


def uses_winograd(kernel_shape: Sequence[int], strides: Sequence[int], w_out: int,
                  impl: str = "auto") -> bool:
    """Whether `conv2d` computes a convolution of this HWIO kernel shape and output width by
    Winograd.

    It applies at stride 1 to kernels 2 to 7 wide (tiles of at most 8 points). "winograd": wherever
    it applies; "im2col": never; "auto": where it applies, its GEMMs do fewer multiplications than
    im2col's (T·n < W_out·kw, false for one output column), kh·C_in ≥ WINOGRAD_MIN_DEPTH and the
    default backend is the CPU. On a GPU the im2col convolution is what was measured
    (benchmarks/RESULTS.md, "PGFed's protocol on an H100"), so auto keeps it there.
    """
    if impl not in CONV_IMPLS:
        raise ValueError(f"conv impl must be one of {list(CONV_IMPLS)}, got {impl!r}")
    kh, kw, cin = kernel_shape[0], kernel_shape[1], kernel_shape[2]
    if impl == "im2col" or tuple(strides) != (1, 1) or not 2 <= kw <= 7:
        return False
    if impl == "winograd":
        return True
    m = winograd_tile(kw, w_out)
    fewer_products = -(-w_out // m) * (m + kw - 1) < w_out * kw
    return fewer_products and kh * cin >= WINOGRAD_MIN_DEPTH and jax.default_backend() == "cpu"


def conv2d(
    x: jax.Array,
    kernel: jax.Array,
    *,
    strides: tuple[int, int] = (1, 1),
    padding: str | Sequence[tuple[int, int]] = "VALID",
    impl: str = "auto",
) -> jax.Array:
    """NHWC × HWIO cross-correlation (as lax.conv_general_dilated) by `conv2d_winograd` where
    `uses_winograd` says so, else by `conv2d_im2col`. Both equal the direct sum up to float
    rounding."""
    kw = kernel.shape[1]
    if isinstance(padding, str):
        pads = jax.lax.padtype_to_pads(x.shape[1:3], kernel.shape[:2], strides, padding)
    else:
        pads = tuple(tuple(p) for p in padding)
    w_out = x.shape[2] + sum(pads[1]) - kw + 1
    if w_out >= 1 and uses_winograd(kernel.shape, strides, w_out, impl):
        return conv2d_winograd(x, kernel, padding=pads)
    return conv2d_im2col(x, kernel, strides=strides, padding=pads)


def max_pool_2x2(x: jax.Array) -> jax.Array:
    """2×2 max pooling with stride 2 (floor mode, as torch.nn.MaxPool2d(2)) on NHWC input."""
    b, h, w, c = x.shape
    x = x[:, : h // 2 * 2, : w // 2 * 2, :]
    return x.reshape(b, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


class Conv2D(nn.Module):
    """A 2-D convolution layer computed by `conv2d` (NHWC in, NHWC out; HWIO kernel); `impl`
    picks im2col or Winograd (see `conv2d`)."""

    features: int
    kernel_size: tuple[int, int]
    strides: tuple[int, int] = (1, 1)
    padding: str | Sequence[tuple[int, int]] = "VALID"
    use_bias: bool = True
    impl: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kh, kw = self.kernel_size
        cin = x.shape[-1]
        kernel = self.param(
            "kernel", torch_default_kernel_init, (kh, kw, cin, self.features), jnp.float32
        )
        y = conv2d(x, kernel, strides=self.strides, padding=self.padding, impl=self.impl)
        if self.use_bias:
            bias = self.param("bias", torch_default_bias_init(kh * kw * cin), (self.features,))
            y = y + bias
        return y


# Batches of at most this many rows take the outer-product path for the kernel gradient.
OUTER_PRODUCT_MAX_ROWS = 16


def _sum_of_outer_products(x: jax.Array, g: jax.Array) -> jax.Array:
    """Σ_r x_r ⊗ g_r for x [R, D], g [R, H], unrolled over the (static, small) R rows."""
    acc = x[0][:, None] * g[0][None, :]
    for r in range(1, x.shape[0]):
        acc = acc + x[r][:, None] * g[r][None, :]
    return acc


def _small_batch_kernel_gradient(x2: jax.Array, g2: jax.Array) -> jax.Array:
    if x2.shape[0] <= OUTER_PRODUCT_MAX_ROWS:
        return _sum_of_outer_products(x2, g2)
    return x2.T @ g2


_matmul_small_batch_grad = _matmul_with_kernel_gradient(_small_batch_kernel_gradient)


def matmul_small_batch_grad(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x @ kernel, whose kernel gradient xᵀg is computed for speed under vmap over clients.

    Under vmap, XLA:CPU turns the kernel gradient xᵀg (contraction over a batch of B rows) into
    a batched dot that runs at ~15 GFLOP/s. For B ≤ OUTER_PRODUCT_MAX_ROWS we write it as an
    unrolled sum of B outer products instead: one elementwise loop that XLA fuses with the
    optimizer's update, so the [D, H] gradient is never materialised (3.7× faster for the
    784×100 layer at B = 10 over 100 clients; docs/decisions/mlp-round.md). Larger batches use the dot.
    Values are identical up to float rounding. Forward mode: as `_matmul_with_kernel_gradient`
    (reverse mode and forward-over-reverse only).
    """
    return _matmul_small_batch_grad(x, kernel)


class Dense(nn.Module):
    """y = x W + b with PyTorch-default initialisation and a vmap-friendly kernel gradient.

    Parameters are named like flax's nn.Dense ('kernel' [D, H], 'bias' [H]).
    """

    features: int
    use_bias: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        fan_in = x.shape[-1]
        kernel = self.param("kernel", torch_default_kernel_init, (fan_in, self.features), jnp.float32)
        y = matmul_small_batch_grad(x, kernel)
        if self.use_bias:
            y = y + self.param("bias", torch_default_bias_init(fan_in), (self.features,))
        return y
