"""What XLA's memory and cost analyses would say of a program, and upper bounds of it that need no
compilation.

The automatic sizes (`clients.auto_chunk_size`, `evaluate.auto_eval_batch`) read one client's
temporaries, outputs and floating-point operations from XLA's analyses of a compiled probe. That
compilation is most of their cost (0.1–0.4 s each at -O0, several per algorithm). For small
programs the answer is already decided by the traced program: where even generous upper bounds
of those three numbers fit the budgets, so do XLA's, and nothing needs compiling.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
from jax.extend import core as jex_core


def compiled_for_analysis(fn: Callable, *abstract_args: Any):
    """`fn` compiled for XLA's memory and cost analyses only. Buffer assignment (what
    memory_analysis reports) precedes LLVM code generation, so the unoptimised backend gives the
    same numbers in a fraction of the compile time."""
    return jax.jit(fn).lower(*abstract_args).compile(
        compiler_options={"xla_backend_optimization_level": 0})


class Bounds(NamedTuple):
    """Upper bounds of XLA's `memory_analysis()` temp_size_in_bytes and output_size_in_bytes and
    of `cost_analysis()["flops"]` for one program."""

    temp_bytes: float
    output_bytes: float
    flops: float


# Every buffer XLA assigns is padded to this alignment (xla::cpu_function_runtime::Align()).
_ALIGN = 64
# Margins over the traced counts: XLA adds buffers the traced program does not name (copies of
# loop carries and of values it changes layout for, a primitive's expansion), and its scheduler
# need not keep the traced program's order.
_TEMP_MARGIN = 2
_FLOP_MARGIN = 1.5

# Flops per element that XLA's HloCostAnalysis counts for each primitive of linear cost (per
# output element; reductions per input element), measured on XLA:CPU with
# `compiled_for_analysis(...).cost_analysis()` and rounded up. Transcendental functions count 1
# here (XLA counts them apart, as transcendentals). Primitives not listed (sort, cumulative sums,
# linear algebra, while loops: costs that grow faster than their outputs or are unknown) make
# the bound unknown, and the caller compiles instead.
_PER_OUTPUT = {
    **dict.fromkeys((
        "add", "sub", "mul", "div", "rem", "neg", "max", "min", "abs", "sign", "floor", "ceil",
        "round", "select_n", "clamp", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not",
        "xor", "shift_left", "shift_right_logical", "shift_right_arithmetic", "exp", "exp2",
        "log", "log1p", "expm1", "tanh", "sqrt", "rsqrt", "cbrt", "sin", "cos", "pow", "erf",
        "erfc", "is_finite", "square", "convert_element_type", "bitcast_convert_type", "copy",
        "copy_p", "reduce_precision", "stop_gradient", "nextafter", "population_count", "clz",
        "real", "imag", "conj", "complex", "add_any"), 1),
    "logistic": 4,
    # 1 − x² (JAX ≥ 0.11, in tanh's derivative): a multiply and a subtract.
    "one_minus_square": 2,
    # Expanded by XLA into a few operations each (acos: a square root, an atan2 and arithmetic).
    **dict.fromkeys(("acos", "asin", "atan", "atan2", "tan", "sinh", "cosh", "asinh", "acosh",
                     "atanh"), 8),
    **dict.fromkeys(("erf_inv", "lgamma", "digamma"), 64),
    **dict.fromkeys((
        "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "slice",
        "dynamic_slice", "dynamic_update_slice", "gather", "scatter", "scatter-add",
        "scatter_add", "concatenate", "pad", "iota", "rev", "split", "unstack",
        "random_wrap", "random_unwrap", "device_put", "optimization_barrier",
        "sharding_constraint", "pvary"), 1),
    # threefry's rounds: ~45 per 32-bit word, a key is 2 words.
    **dict.fromkeys(("random_bits", "random_split", "random_fold_in", "random_seed",
                     "threefry2x32"), 128),
}
# Primitives whose expansion holds several buffers the size of their output at once.
_EXPANDED_BUFFERS = dict.fromkeys(("random_bits", "random_split", "random_fold_in",
                                   "random_seed", "threefry2x32"), 4)
_PER_INPUT = {**dict.fromkeys(("reduce_sum", "reduce_max", "reduce_min", "reduce_prod",
                               "reduce_and", "reduce_or", "reduce_xor"), 1),
              "argmax": 16, "argmin": 16}
# Primitives that only call a sub-program (counted by recursion).
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call",
                    "custom_vjp_call", "custom_vjp_call_jaxpr", "remat", "checkpoint", "cond",
                    "scan"})


def _nbytes(aval) -> int:
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):   # threefry: 2 words, rbg: 4
        return math.prod(shape) * 16
    return math.prod(shape) * dtype.itemsize


def _size(aval) -> int:
    shape = getattr(aval, "shape", None)
    return math.prod(shape) if shape is not None else 0


def _flops(eqn) -> float | None:
    """What HloCostAnalysis counts for one primitive (its sub-programs apart), rounded up; None
    for a primitive whose cost is not bounded here."""
    name = eqn.primitive.name
    out = sum(_size(v.aval) for v in eqn.outvars)
    if name in _CALLS:
        return 0.0
    if name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        shape = eqn.invars[0].aval.shape
        return 2.0 * out * math.prod(shape[d] for d in lhs_contract)
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval
        out_features = rhs.shape[eqn.params["dimension_numbers"].rhs_spec[0]]
        return 2.0 * out * (_size(rhs) // max(out_features, 1))
    if name == "integer_pow":
        return float(out * max(abs(eqn.params["y"]), 1))
    if name in _PER_INPUT:
        return float(_PER_INPUT[name] * max(_size(v.aval) for v in eqn.invars))
    if name in _PER_OUTPUT:
        return float(_PER_OUTPUT[name] * out)
    return None


def _walk(jaxpr, live_outside: int, totals: dict, slices=()) -> bool:
    """Adds the flops of `jaxpr` (sub-programs included, a loop's body once, as HloCostAnalysis
    counts it) to totals["flops"], and raises totals["peak"] to the most bytes its values hold
    at once (each value from its definition to its last use) plus `live_outside` bytes held by
    the enclosing programs. Its inputs are buffers the caller holds (arguments, or values counted
    outside) except `slices` (a scan's per-iteration slices). False where no bound is known."""
    last_use = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, jex_core.Literal):
                last_use[v] = i
    for v in jaxpr.outvars:
        if not isinstance(v, jex_core.Literal):
            last_use[v] = len(jaxpr.eqns)
    size = lambda v: _nbytes(v.aval) + _ALIGN
    live = {v: size(v) for v in slices}
    live_bytes = sum(live.values())
    for i, eqn in enumerate(jaxpr.eqns):
        flops = _flops(eqn)
        if flops is None:
            return False
        totals["flops"] += flops
        outs = sum(size(v) for v in eqn.outvars)
        name = eqn.primitive.name
        extra = outs * (_EXPANDED_BUFFERS.get(name, 1) - 1)
        totals["peak"] = max(totals["peak"], live_outside + live_bytes + outs + extra)
        for sub in jex_core.jaxprs_in_params(eqn.params):
            inner_slices = ()
            if name == "scan":              # the slices of the scanned-over inputs
                inner_slices = sub.invars[_scan_consts_and_carry(eqn.params):]
            if not _walk(sub, live_outside + live_bytes + outs, totals, inner_slices):
                return False
        for v in eqn.outvars:
            live[v] = size(v)
        live_bytes += outs
        for v in (*eqn.invars, *eqn.outvars):        # values not needed after this one
            if not isinstance(v, jex_core.Literal) and v in live and last_use.get(v, -1) <= i:
                live_bytes -= live.pop(v)
    return True


def _scan_consts_and_carry(params: dict) -> int:
    """How many of a scan body's inputs precede its per-iteration slices (its constants and its
    carry). JAX ≤ 0.10 records the counts; from 0.11 the scan's `ft_in` is a flat tree of
    (constants, carry, scanned inputs)."""
    if "num_consts" in params:
        return params["num_consts"] + params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(list(consts.vals)) + len(list(carry.vals))


def traced_bounds(fn: Callable, *abstract_args: Any) -> Bounds | None:
    """Upper bounds of what XLA's analyses report for `fn` compiled for these arguments, read
    off its traced program without compiling it: temporaries from the most bytes its values hold
    at once in program order (arguments apart, each value padded to 64 bytes), outputs exactly,
    flops per primitive as HloCostAnalysis counts them (`_PER_OUTPUT`), with margins. None where
    no bound is known (a while loop, a sort: see `_PER_OUTPUT`; or a program that does not
    trace, which the compiled analysis then reports). Checked against XLA's analyses in
    tests/core/test_analysis.py."""
    try:
        closed = jax.make_jaxpr(fn)(*abstract_args)
    except Exception:
        return None
    totals = {"peak": 0, "flops": 0.0}
    if not _walk(closed.jaxpr, 0, totals):
        return None
    outputs = sum(_nbytes(v.aval) + _ALIGN for v in closed.jaxpr.outvars)
    return Bounds(float(_TEMP_MARGIN * totals["peak"]), float(outputs),
                  _FLOP_MARGIN * totals["flops"])
