"""The figure writers of `fedjax_pfl.plots` (`plot_*`) and one stub for them all, for tests that
do not check figures: tests/conftest.py's `_no_figures` (in-process, undone after each test through
monkeypatch), and for a whole process run_no_figures.py, pause_run.py and
tests/runner/test_checkpoint_cost.py's script. A figure added to the runner is left out with the
others. Imports only fedjax_pfl.plots (a run's subprocess needs no more)."""

from collections.abc import Callable

from fedjax_pfl import plots


def writers() -> list[str]:
    return [n for n in dir(plots) if n.startswith("plot_") and callable(getattr(plots, n))]


def _nothing(*args, **kwargs) -> None:
    return None


def stub_all(assign: Callable = setattr) -> None:
    """Every figure writer does nothing: `assign(plots, name, stub)` (setattr, or a monkeypatch's)."""
    for name in writers():
        assign(plots, name, _nothing)
