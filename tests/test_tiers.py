"""The suite's tiers: which cases the README's test command runs and which only `--extended` does
(tests/conftest.py `_extended_only`, docs/decisions/test-suite-time.md); and the figures, which
runs draw only in tests marked `figures` (tests/conftest.py `_no_figures`)."""

import pathlib
import re
import types

import conftest
import helpers
import no_figures
import pytest

from fedjax_pfl import algorithms


def _item(markers, name=None, quick=()):
    """A stand-in for a collected pytest item: its markers, its `name` parameter, its module."""
    item = types.SimpleNamespace(module=types.SimpleNamespace(QUICK=quick))
    item.get_closest_marker = lambda m: m if m in markers else None
    if name is not None:
        item.callspec = types.SimpleNamespace(params={"name": name})
    return item


def test_the_representative_algorithms_are_registered_and_some_send_private_uplinks():
    names = set(algorithms.names())
    assert set(helpers.REPRESENTATIVE) <= names
    specs = {n: algorithms.spec(n) for n in helpers.REPRESENTATIVE}
    # Some of them send private uplinks, some do not (the private matrices keep at least two).
    assert sum(s.private_uplink is not None for s in specs.values()) >= 2
    assert any(s.private_uplink is None for s in specs.values())


@pytest.mark.parametrize("markers, name, quick, extended", [
    ({"matrix", "slow"}, "moon", (), True),          # outside the set: --extended only
    ({"matrix", "slow"}, "fedpc", (), False),        # representative
    ({"matrix", "slow"}, "moon", ("moon",), False),  # the module's quick case
    ({"matrix"}, "scaffold", "scaffold", False),     # QUICK as one string
    ({"matrix"}, "fedala", {("fedala", "per_token")}, False),   # QUICK as (name, task) pairs
    ({"slow"}, "moon", (), False),                   # not a matrix test: an ordinary case
    ({"matrix"}, None, (), False),                   # a matrix test without a `name` parameter
    ({"extended"}, None, (), True),                  # marked so
])
def test_extended_only_cases(markers, name, quick, extended):
    assert conftest._extended_only(_item(markers, name, quick)) is extended


def test_every_figure_the_runner_writes_is_stubbed_outside_figures_tests(tmp_path):
    """Each `plots.<name>(` the runner and the command lines call that writes a file is one of
    `no_figures.writers`, and in this (unmarked) test each of them writes nothing."""
    from fedjax_pfl import plots

    root = pathlib.Path(__file__).resolve().parents[1]
    sources = [*sorted((root / "fedjax_pfl").rglob("*.py")), *sorted((root / "experiments").glob("*.py"))]
    called = {m for f in sources for m in re.findall(r"\bplots\.(plot_\w+)\(", f.read_text())}
    assert called and called <= set(no_figures.writers()), called
    for name in no_figures.writers():
        assert getattr(plots, name)(None, str(tmp_path / f"{name}.png")) is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.figures
def test_a_figures_test_has_the_real_writers(tmp_path):
    import numpy as np

    from fedjax_pfl import plots

    plots.plot_client_accuracy(np.array([0.5, 0.25]), str(tmp_path / "acc.png"))
    assert (tmp_path / "acc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
