"""The checks a program's trace notes and returns, read on the host after each call.

Deep inside a round, the engine's reads of placed rows produce checks that the round must
return as outputs:

  "misdealt"  [devices] int32: rows the client mapper ran on a device that does not hold their
              client's samples (data in per-device blocks, `core.rows.DeviceBlocks`);
  "rows"      () int32 bits: MISSED, a client-state row read or written that is not among the
              rows present (`core.rows.ClientRows`); CROSSED, rows of a dealt world read or
              written across its devices (`core.world`: exact, only slower).

Rather than thread them through every signature, the reads `note` them into the innermost
`collecting` block of the trace; the program's functions return their combination as one more
output (`checked`), and the host reads it once per call (`Found`). A check is never silent: a
misdealt row or a missed id stops the run. (A host callback would be simpler, but JAX never
writes a program holding one to its persistent compilation cache, so every run would compile
its rounds again.)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfl.models import frozen

MISSED, CROSSED = 1, 2
MISDEALT = "a client ran on a device that does not hold its samples"

_FOUND: contextvars.ContextVar[list | None] = contextvars.ContextVar("fedjax_pfl_checks",
                                                                      default=None)


@contextlib.contextmanager
def collecting() -> Iterator[list]:
    """Within the block, `note` appends to a fresh list (the enclosing block's is restored after
    it, so nested traces keep their own)."""
    found: list = []
    token = _FOUND.set(found)
    try:
        yield found
    finally:
        _FOUND.reset(token)


def note(kind: str, value: jax.Array | None) -> None:
    """Adds a check to the enclosing `collecting` block. Outside one, a concrete value is
    checked at once and a traced one refused: nothing would read it."""
    if value is None:
        return
    found = _FOUND.get()
    if found is not None:
        found.append((kind, value))
    elif isinstance(value, jax.core.Tracer):
        raise RuntimeError("placed rows (client data in per-device blocks, client-state rows "
                           "off the devices) are read only inside the programs core.Program "
                           "builds, which return these checks")
    elif kind == "misdealt" and Found.of({kind: value}).misdealt:
        raise RuntimeError(MISDEALT)
    elif kind == "rows" and Found.of({kind: value}).rows & MISSED:
        raise RuntimeError("a client-state row was read or written that is not among the "
                           "participants' rows present")


def combined(found: list) -> dict[str, jax.Array]:
    """The collected checks as one output: misdealt counts added up, row flags or-ed ({} where
    nothing was noted: no output at all)."""
    out: dict[str, jax.Array] = {}
    misdealt = [v for k, v in found if k == "misdealt"]
    rows = [v for k, v in found if k == "rows"]
    if misdealt:
        out["misdealt"] = functools.reduce(jnp.add, misdealt)
    if rows:
        out["rows"] = jax.lax.reduce_or(jnp.stack(rows), (0,))
    return out


def note_each(checks: dict[str, jax.Array]) -> None:
    """`note` for the checks of a scan's iterations (each leaf with a leading iteration axis)."""
    if "misdealt" in checks:
        note("misdealt", jnp.sum(checks["misdealt"], axis=0))
    if "rows" in checks:
        note("rows", _or_over_first(checks["rows"]))


def _or_over_first(flags: jax.Array) -> jax.Array:
    """The bits of `flags` or-ed over its leading axis, bit by bit as maxima (an axis split
    over devices reduces with a max; XLA:CPU has no all-reduce of a bitwise or)."""
    return functools.reduce(jnp.bitwise_or, [jnp.max(flags & bit, axis=0)
                                             for bit in (MISSED, CROSSED)])


def checked(fn: Callable) -> Callable:
    """fn(*args) -> (fn's result, the checks noted while it traced)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with collecting() as found:
            out = fn(*args, **kwargs)
        return out, combined(found)

    return run


def jit_carrying(fn: Callable, **jit_kwargs) -> Callable:
    """`jax.jit(fn)` whose checks reach the caller's trace: the jitted function returns them as
    one more output and each call notes them again. (A jitted function is traced once and its
    trace reused by every program that calls it, so what it collects must leave it as an
    output, not through Python state; for the same reason the frozen parameters bound by the
    caller's trace enter it as an argument, `models.frozen.jit`.) A given `out_shardings` is
    fn's result's."""
    if "out_shardings" in jit_kwargs:
        jit_kwargs = {**jit_kwargs, "out_shardings": (jit_kwargs["out_shardings"], None)}
    jitted = frozen.jit(checked(fn), **jit_kwargs)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        out, found = jitted(*args, **kwargs)
        note_each({k: v[None] for k, v in found.items()})
        return out

    return call


class Found:
    """A call's checks on the host (`to_host` of `combined`'s output)."""

    def __init__(self, misdealt: int = 0, rows: int = 0):
        self.misdealt, self.rows = int(misdealt), int(rows)

    @classmethod
    def of(cls, checks: dict[str, Any]) -> "Found":
        """From host (or concrete) check values; misdealt counts spanning other processes'
        devices are all-gathered."""
        misdealt = checks.get("misdealt")
        if misdealt is not None:
            if isinstance(misdealt, jax.Array) and not misdealt.is_fully_addressable:
                from jax.experimental import multihost_utils

                misdealt = multihost_utils.process_allgather(misdealt, tiled=True)
            misdealt = np.sum(np.asarray(misdealt))
        return cls(misdealt or 0, np.asarray(checks.get("rows", 0)))

    @property
    def crossed(self) -> bool:
        return bool(self.rows & CROSSED)

    def raise_if_any(self, where: str, algo: str = "the algorithm") -> None:
        if self.misdealt:
            raise RuntimeError(
                f"{where}: {algo} ran a client on a device that does not hold its samples (its "
                "round reads them in another client order than its training); declare it with "
                "data_blocks=False or run it with --data-placement device")
        if self.rows & MISSED:
            raise RuntimeError(
                f"{where}: {algo} read or wrote the client-state rows of a client that was not "
                "among the participants moved to the devices; run it with --state-placement "
                "device")
