"""Fuzzing the command line: random values of random types for every flag of every algorithm.
Whatever the input, run.py ends with status 0 or with status 2 and one line naming the problem:
never a traceback. (Status 1 is kept for a run that diverges, NaN/Inf in training, which no check
can foresee: its message is one line too and names the round.)

`test_any_flags_…` draws any of run.py's flags (but the multi-process start-up's) in any
combination, up to the data load: fast enough for the quick tier, it is where a check that
lets an input through to a traceback, or says a warning before its error, shows first."""

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
           "--target-acc", "--conv", "--synthetic-alpha", "--emnist-split", "--model-options",
           "--dp-noise-multiplier", "--dp-clip", "--target-epsilon", "--local-epochs"]
SPECIAL = ["0", "1", "-1", "2", "inf", "-inf", "nan", "1e9", "0.5", "true", "", "x", "1.5", "-0",
           "1e-6", "1e308", "-1e-9", "hidden=abc", "width=10", "conv=x", "hidden=2,layers=0",
           "=", "a=b=c", "4294967296", "00", "0x10", "1_000"]
# The multi-process start-up flags start jax.distributed: not drawn here (their checks are
# tests/cli/test_cli_strict.py's).
DISTRIBUTED = {"--coordinator", "--distributed", "--num-processes", "--process-id",
               "--coordinator-timeout", "--peer-timeout"}
# Every other flag of run.py, every algorithm's hyperparameters among them.
EVERY_FLAG = sorted(a.option_strings[0] for a in PARSER._actions
                    if a.option_strings and a.option_strings[0] not in DISTRIBUTED | {"-h"})


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


# The flags of the review (each accepted or silently ignored before): drawn more often.
FOCUS = ["--shards-per-client", "--synthetic-alpha", "--model-cr", "--emnist-split",
         "--model-options", "--local-epochs", "--local-steps", "--dp-noise-multiplier", "--dp-clip",
         "--target-epsilon", "--dp-delta", "--dp-accountant", "--download", "--data-dir", "--resume"]
OWN_FLAGS = {flag for name in algorithms.names()
             for _, flag in algorithms.spec(name).all_hparams()[len(algorithms.COMMON_HPARAMS):]}


def _plausible(flag):
    """Mostly values a user might mean (the flag's choices, small numbers, the special ones of
    this task: 1e-6, rank-1 compression rates, model options), some junk."""
    action = _action(flag)
    options = [st.integers(-2, 8).map(str), st.sampled_from(SPECIAL),
               st.sampled_from(["0.25", "0.5", "1", "2", "3", "10", "100", "1e-3"])]
    if action.choices:
        options += [st.sampled_from([str(c) for c in action.choices])] * 3
    if flag == "--model-options":
        options += [st.sampled_from(["hidden=8", "hidden=abc", "layers=0", "width=10,heads=4",
                                     "conv=im2col", "output_tanh=true", "nope=1", "hidden"])] * 3
    return st.one_of(*options)


@st.composite
def any_flags(draw):
    """An algorithm, a dataset, maybe a partition and a model, and any of the other flags (the
    algorithm's own and sometimes another's, the data's, the model's, privacy, the run's) in any
    combination, with plausible values, special numbers or junk."""
    algo = draw(st.sampled_from(algorithms.names() + ["nope"]))
    argv = ["--algo", algo]
    for flag, pick in (("--dataset", ["digits", "digits", "synthetic", "mnist", "emnist",
                                      "femnist", "shakespeare", "nope"]),
                       ("--partition", [None, None, "iid", "dirichlet", "shards", "clustered",
                                        "pathological", "natural", "dirichlet_client", "x"]),
                       ("--model", [None, None, "mlp", "cp_mlp", "char_lstm", "femnist_cnn",
                                    "transformer", "logreg", "cnn"])):
        value = draw(st.sampled_from(pick))
        if value is not None:
            argv += [flag, value]
    own = [flag for _, flag in algorithms.spec(algo if algo != "nope" else "fedavg").all_hparams()]
    pool = sorted(set(EVERY_FLAG) - OWN_FLAGS - {"--algo", "--dataset", "--partition", "--model",
                                                  "--out"}) + own * 2 + FOCUS * 4
    extra = draw(st.lists(st.sampled_from(pool), max_size=6, unique=True))
    if draw(st.integers(0, 9)) == 0:                    # now and then another algorithm's flag
        extra.append(draw(st.sampled_from(sorted(OWN_FLAGS))))
    for flag in dict.fromkeys(extra):
        action = _action(flag)
        if action.nargs == 0:                                   # store_true
            argv.append(flag)
        elif action.nargs == "?" and draw(st.booleans()):       # --resume, --checkpoint-on-signal
            argv.append(flag)
        elif action.nargs == "+":                               # --seeds
            argv += [flag, *draw(st.lists(_plausible(flag), min_size=1, max_size=3))]
        else:
            argv += [flag, draw(_plausible(flag))]
    return argv


class _Loaded(Exception):
    pass


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(argv=any_flags())
@pytest.mark.slow
def test_any_flags_pass_the_checks_or_are_refused_in_one_line_with_nothing_written(
        argv, tmp_path_factory, capsys, monkeypatch):
    """Up to the data load (runner.load_data replaced, so no data and no compilation): every
    combination ends in the checks' one line "run.py: error: …" with status 2 and nothing in
    --out, or passes them; a warning is one line "run.py: warning: …" each; never a traceback."""
    def loaded(*a, **k):
        raise _Loaded
    monkeypatch.setattr(runner, "load_data", loaded)
    monkeypatch.setattr(runner, "run", loaded)
    root = tmp_path_factory.mktemp("fuzz")
    out = root / "out"
    flags = argv + (["--out", str(out)] if "--out" not in argv else []) + ["--quiet"]
    try:
        code = cli.main(flags)
    except SystemExit as e:
        code = e.code
    except _Loaded:
        code = None                                           # passed every check
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err, (flags, captured.err)
    lines = [line for line in captured.err.splitlines() if line.strip()]
    if code is None:
        assert all(line.startswith("run.py: warning: ") for line in lines), (flags, captured.err)
        return
    assert code == 2, (flags, code, captured.err)
    assert len(lines) == 1 and lines[0].startswith("run.py: error: "), (flags, captured.err)
    assert not out.exists() or not os.listdir(out), (flags, os.listdir(out))
