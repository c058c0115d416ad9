"""Fuzzing the command line: random values of random types for every flag of every algorithm.
Whatever the input, run.py ends with status 0 or with status 2 and one line naming the problem:
never a traceback. (Status 1 is kept for a run that diverges, NaN/Inf in training, which no check
can foresee: its message is one line too and names the round.)"""

import os

import pytest

hypothesis = pytest.importorskip("hypothesis")
import run as cli  # noqa: E402  (experiments/run.py)
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st

from fedjax_pfl import algorithms, runner  # noqa: E402

PARSER = cli.build_parser()
GENERAL = ["--rounds", "--seed", "--eval-every", "--eval-clients", "--rounds-per-call",
           "--state-dtype", "--model", "--model-cr", "--partition", "--clients", "--alpha",
           "--min-size", "--classes-per-client", "--shards-per-client", "--shard-size",
           "--clusters", "--test-fraction", "--checkpoint-every", "--dataset", "--preset",
           "--target-acc", "--conv"]
SPECIAL = ["0", "1", "-1", "2", "inf", "-inf", "nan", "1e9", "0.5", "true", "", "x", "1.5", "-0"]


def _action(flag):
    return next(a for a in PARSER._actions if flag in a.option_strings)


def _value(flag):
    """Values of any type for `flag`: its own choices, small and special numbers, junk text."""
    action = _action(flag)
    options = [st.integers(-3, 6).map(str), st.sampled_from(SPECIAL),
               st.floats(allow_nan=True, allow_infinity=True).map(repr),
               st.text("abc01.-e", max_size=4)]
    if action.choices:
        options.append(st.sampled_from([str(c) for c in action.choices]))
    return st.one_of(*options)


@st.composite
def argvs(draw):
    algo = draw(st.sampled_from(algorithms.names() + ["nope"]))
    own = [flag for _, flag in algorithms.spec(algo if algo != "nope" else "fedavg").all_hparams()]
    flags = draw(st.lists(st.sampled_from(GENERAL + own), max_size=5, unique=True))
    argv = ["--algo", algo, "--clients", "6", "--rounds", "1", "--local-steps", "1"]
    for flag in flags:
        action = _action(flag)
        if action.nargs == 0:                       # store_true
            argv.append(flag)
        else:
            argv += [flag, draw(_value(flag))]
    return argv


def _check(argv, tmp_path, capsys):
    out = tmp_path / f"run{len(os.listdir(tmp_path))}"
    try:
        code = cli.main(argv + ["--out", str(out), "--quiet"])
    except SystemExit as e:
        code = e.code
    except runner.NonFiniteError:
        raise
    captured = capsys.readouterr()
    assert code in (0, 1, 2), (argv, code, captured.err)
    if code:
        lines = [line for line in captured.err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("run.py: error: "), (argv, captured.err)
        assert "Traceback" not in captured.err
    if code == 1:
        assert "non-finite" in captured.err, (argv, captured.err)


class _Reached(Exception):
    pass


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(argv=argvs())
def test_validation_never_raises_a_traceback(argv, tmp_path, capsys, monkeypatch):
    """Every check up to the first round (runner.run replaced): status 2 and one line, or valid."""
    def reached(*a, **k):
        raise _Reached
    monkeypatch.setattr(runner, "run", reached)
    try:
        _check(argv, tmp_path, capsys)
    except _Reached:
        capsys.readouterr()


@pytest.mark.slow
@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(argv=argvs())
def test_short_runs_end_with_0_or_one_line(argv, tmp_path, capsys):
    """The same with real (one-round) runs: nothing fails later than the checks."""
    _check(argv, tmp_path, capsys)
