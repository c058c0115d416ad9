"""Errors that name the caller's arguments, so that each front end can say them its own way.

The library's messages name its own arguments (`rounds`, `num_clients`, a hyperparameter's
keyword): a notebook user reads "rounds must be >= 1, got 0". The command line reads the same
error with its flags ("--rounds must be >= 1, got 0") by rendering it with its own spellings:

    raise OptionError(f"{arg('eval_every')} {k} must be a multiple of {arg('rounds_per_call')} {m}")

    str(e)                      # 'eval_every 4 must be a multiple of rounds_per_call 3'
    e.render(flags.get)         # '--eval-every 4 must be a multiple of --rounds-per-call 3'

`arg(name, space)` marks a name in a message; `space` tells names that two parts of a run's
configuration share apart ("hparams" for an algorithm's hyperparameters, "partition" for the
split, "data" for a dataset's options; "" for the run's own settings). This module imports
nothing else of the package: every layer may raise these.
"""

from __future__ import annotations

import re
from typing import Callable

_MARK = "\x00"
_PATTERN = re.compile(f"{_MARK}([^{_MARK}]*){_MARK}([^{_MARK}]*){_MARK}")


def arg(name: str, space: str = "") -> str:
    """`name` marked as an argument in an `OptionError` message (rendered per front end)."""
    return f"{_MARK}{space}{_MARK}{name}{_MARK}"


def render(text: str, spell: Callable[[str, str], str | None] | None = None) -> str:
    """`text` with every `arg` mark replaced by `spell(name, space)`, or the plain name where
    `spell` is None or returns None."""
    def one(match: re.Match) -> str:
        space, name = match.group(1), match.group(2)
        spelled = spell(name, space) if spell is not None else None
        return name if spelled is None else spelled

    return _PATTERN.sub(one, text)


def names(text: str) -> list[tuple[str, str]]:
    """The (name, space) of every argument a message marks, in order."""
    return [(m.group(2), m.group(1)) for m in _PATTERN.finditer(text)]


class OptionError(ValueError):
    """Bad input, named by the library's own argument names (`arg`): `str(e)` says them as
    they are, `e.render(spell)` as a front end spells them. Raised before any computation."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return render(self.message)

    def render(self, spell: Callable[[str, str], str | None] | None) -> str:
        return render(self.message, spell)

    @property
    def arguments(self) -> list[tuple[str, str]]:
        """(name, space) of the arguments the message names, the first the one at fault."""
        return names(self.message)


class OptionWarning(UserWarning):
    """An input that was left out rather than refused (a setting the run does not use, which a
    user may keep in every command line), named as `OptionError` names arguments: `str(w)`
    plainly, `w.render(spell)` as a front end spells them."""

    harmless: bool = False      # a setting users keep in every command line (where data live)

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return render(self.message)

    def render(self, spell: Callable[[str, str], str | None] | None) -> str:
        return render(self.message, spell)


class MarkedError:
    """Mixin for exceptions that are no ValueError (a FileNotFoundError, a FloatingPointError)
    whose messages mark arguments all the same: `str(e)` says them plainly, `e.render(spell)`
    as a front end spells them, as an `OptionError` does.

        class DatasetNotFoundError(MarkedError, FileNotFoundError): ...
    """

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return render(self.message)

    def render(self, spell: Callable[[str, str], str | None] | None) -> str:
        return render(self.message, spell)

    @property
    def arguments(self) -> list[tuple[str, str]]:
        return names(self.message)


def marked(e: BaseException) -> str:
    """The message of `e` with its argument marks kept, to quote it inside another marked
    message (`OptionError(f"{arg('grid')} lr=0: {marked(e)}")`); `str(e)` for an exception
    whose message marks nothing."""
    if isinstance(e, (OptionError, MarkedError)):
        return e.message
    return str(e)


def spelled(e: BaseException, spell: Callable[[str, str], str | None] | None) -> str:
    """What a front end prints for `e`: its arguments as `spell` says them where its message
    marks them (`OptionError`, `MarkedError`), else `str(e)`."""
    if isinstance(e, (OptionError, MarkedError, OptionWarning)):
        return e.render(spell)
    return str(e)
