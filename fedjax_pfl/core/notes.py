"""Values noted while a function is traced, collected by the code that traces it.

Deep inside a round, the engine's reads of client rows and data blocks produce checks (an id
missing from the rows present, a client run on a device without its samples) that the round must
return as outputs. Rather than thread them through every signature, the reads add them to the
innermost `collect` block of the trace (`Notes.current`), and the program returns their
combination (`core.blocks`, `core.hoststate`).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator


class Notes:
    """One kind of note: a context variable holding the innermost `collect` block's list."""

    def __init__(self, name: str):
        self._found: contextvars.ContextVar[list | None] = contextvars.ContextVar(name, default=None)

    @contextlib.contextmanager
    def collect(self) -> Iterator[list]:
        """Within the block, `current()` is a fresh list (the enclosing block's is restored
        after it, so nested traces keep their own)."""
        found: list = []
        token = self._found.set(found)
        try:
            yield found
        finally:
            self._found.reset(token)

    def current(self) -> list | None:
        """The innermost `collect` block's list; None outside every block."""
        return self._found.get()
