"""Frozen parameters: a model's shared, never-trained part (a pretrained base under adapters).

A `Model` may carry `frozen`, a `Frozen`: parameters its `apply` reads but no algorithm sees.
They are not a client row, not in a gradient, not in the state and not checkpointed per client;
every compiled program of `core.Program` (rounds, evaluations, init) takes them as one more
argument, replicated over the mesh, and binds that argument while it traces (`binding`), so the
base is an input of the program, never a constant in its HLO. `Frozen.get()` is what a model's
apply reads:

    base = Frozen(params)                     # concrete arrays, the model's own copy
    def apply(adapters, x):
        return forward(base.get(), adapters, x)

Inside a program's trace `get()` returns the bound value (the program's argument, a tracer);
outside any program (a notebook's eager call, the loop and debug backends) it returns the
concrete arrays. A jitted function that is traced once and reused by several programs (the
engine's `checks.jit_carrying`, the loop backend's per-client jit) must not capture one trace's
bound value, so it takes the bindings as an argument too (`jit`), as the checks a trace notes
leave it as an output.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from typing import Any, Callable, Iterator

import jax

Params = Any

# {Frozen.key: value} bound by the programs being traced; empty outside them.
_BOUND: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar(
    "fedjax_pfl_frozen", default={})
_KEYS = itertools.count()


class Frozen:
    """A model's frozen parameters `value` (a pytree of arrays), read with `get()` (module
    docstring). `key` names it among the bindings ("frozen0", …)."""

    def __init__(self, value: Params):
        self.value = value
        self.key = f"frozen{next(_KEYS)}"

    def get(self) -> Params:
        """The value bound by the program being traced, else the concrete `value`."""
        return _BOUND.get().get(self.key, self.value)

    def __repr__(self) -> str:
        leaves = jax.tree.leaves(self.value)
        return f"Frozen({self.key}: {len(leaves)} leaves, {nbytes(self.value):,} bytes)"


def nbytes(tree: Params) -> int:
    """Bytes of a (frozen) pytree's leaves."""
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


@contextlib.contextmanager
def binding(values: dict[str, Any]) -> Iterator[None]:
    """Within: `Frozen.get()` of each key of `values` returns its value (a tracer of the
    program being traced), beside what enclosing bindings bound."""
    token = _BOUND.set({**_BOUND.get(), **values})
    try:
        yield
    finally:
        _BOUND.reset(token)


def bindings() -> dict[str, Any]:
    """The current bindings ({} outside every program)."""
    return dict(_BOUND.get())


def bound(frozen: Frozen | None, value: Params | None) -> dict[str, Any]:
    """The bindings of one `Frozen` (none where there is none): `{frozen.key: value}`."""
    return {} if frozen is None else {frozen.key: value}


def threaded(fn: Callable) -> Callable:
    """fn(*args, **kwargs) as f(values, *args, **kwargs), `values` bound around the call."""
    def with_values(values, *args, **kwargs):
        with binding(values):
            return fn(*args, **kwargs)

    # (JAX names the program after the function: "jit(evaluate_rows_ids)" stays that)
    with_values.__name__ = with_values.__qualname__ = getattr(fn, "__name__", "with_values")
    return with_values


def jit(fn: Callable, **jit_kwargs) -> Callable:
    """`jax.jit(fn)` that takes the caller's current bindings as an argument and binds them while
    it traces: a jitted function reused by several programs never reads a value bound by the
    trace it was first traced in (its cached trace would hold that trace's tracers). With no
    binding (an eager call) `Frozen.get()` reads the concrete arrays. `jit_kwargs`' argument
    numbers are fn's own."""
    shift = lambda nums: (tuple(n + 1 for n in nums) if isinstance(nums, (tuple, list))
                          else nums + 1)
    jit_kwargs = {k: shift(v) if k in ("static_argnums", "donate_argnums") else v
                  for k, v in jit_kwargs.items()}
    jitted = jax.jit(threaded(fn), **jit_kwargs)

    def call(*args, **kwargs):
        return jitted(bindings(), *args, **kwargs)

    call.jitted = jitted
    return call
