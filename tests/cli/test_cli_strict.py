"""run.py's last silent cases: duplicate --seeds, an impossible --process-id, multi-process flags
without --coordinator, a malformed preset file. Each is one line, exit status 2, before any
computation, and leaves the files of an earlier run in --out exactly as they were."""

import json

import pytest
import run as cli  # noqa: E402  (experiments/run.py)
from helpers import snapshot

from fedjax_pfl import runner  # noqa: E402


@pytest.fixture
def earlier_run(tmp_path):
    """An output folder holding an earlier run's files (what --overwrite would replace)."""
    out = tmp_path / "earlier"
    (out / "seed_0").mkdir(parents=True)
    (out / "config.json").write_text('{"algo": "fedavg"}')
    (out / "summary.json").write_text('{"best": {}}')
    (out / "seed_0" / "metrics.jsonl").write_text('{"round": 1}\n')
    return out


@pytest.fixture
def no_compute(monkeypatch):
    """Fails the test if the CLI gets past validation (a run, or jax.distributed starting)."""
    import fedjax_pfl

    def forbidden(*a, **k):
        raise AssertionError("the CLI went past validation")
    monkeypatch.setattr(runner, "run", forbidden)
    monkeypatch.setattr(runner, "load_data", forbidden)
    monkeypatch.setattr(fedjax_pfl, "init_distributed", forbidden)


def _fails(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv + ["--quiet"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("run.py: error: "), err
    return err


@pytest.mark.parametrize("argv,message", [
    (["--seeds", "0", "0"], "--seeds lists seed 0 more than once"),
    (["--seeds", "3", "1", "2", "1"], "--seeds lists seed 1 more than once"),
    (["--num-processes", "2", "--process-id", "5"],
     "--process-id must be in [0, --num-processes 2), got 5"),
    (["--process-id", "1"], "--process-id must be in [0, --num-processes 1), got 1"),
    (["--process-id", "-1", "--num-processes", "2", "--coordinator", "127.0.0.1:1234"],
     "--process-id must be in [0, --num-processes 2), got -1"),
    (["--num-processes", "0"], "--num-processes must be >= 1, got 0"),
    (["--num-processes", "2"], "--num-processes 2 needs --coordinator HOST:PORT"),
    (["--num-processes", "2", "--process-id", "1", "--coordinator", "localhost"],
     "--coordinator must be HOST:PORT, got 'localhost'"),
    (["--num-processes", "2", "--process-id", "1", "--coordinator", "h:99999"],
     "--coordinator must be HOST:PORT, got 'h:99999'"),
    (["--peer-timeout", "5"], "--peer-timeout applies to a multi-process run"),
    (["--coordinator-timeout", "5"], "--coordinator-timeout applies to a multi-process run"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--coordinator-timeout", "0"],
     "--coordinator-timeout must be a number of seconds > 0, got 0.0"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--peer-timeout", "nan"],
     "--peer-timeout must be a number of seconds > 0, got nan"),
])
def test_silent_cases_are_refused(argv, message, capsys, no_compute, earlier_run):
    before = snapshot(earlier_run)
    err = _fails(argv + ["--out", str(earlier_run), "--overwrite"], capsys)
    assert message in err
    assert snapshot(earlier_run) == before


def test_valid_multi_process_flags_pass_the_check():
    """The checks refuse only what cannot be a process of a run (the distributed test starts real
    processes with these flags)."""
    for argv in ([], ["--coordinator", "127.0.0.1:12355", "--num-processes", "2", "--process-id", "1"],
                 ["--coordinator", "[::1]:80", "--num-processes", "1"], ["--seeds", "0", "1", "2"]):
        cli.config_from_args(cli.parse(argv))


@pytest.mark.parametrize("text,message", [
    ('{"rounds": 5,', "not valid JSON (Expecting property name enclosed in double quotes: line 1 "
                      "column 14 (char 13))"),
    ("", "not valid JSON (Expecting value: line 1 column 1 (char 0))"),
    (b"\xff\xfe{}", "not valid JSON ("),
    ('["rounds", 5]', "must hold a JSON object of settings, got a JSON list"),
])
def test_malformed_preset_file_is_one_line_naming_it(text, message, tmp_path, monkeypatch, capsys,
                                                     no_compute, earlier_run):
    configs = tmp_path / "configs"
    configs.mkdir()
    bad = configs / "bad.json"
    bad.write_bytes(text if isinstance(text, bytes) else text.encode())
    (configs / "good.json").write_text(json.dumps({"rounds": 3}))
    monkeypatch.setattr(cli, "CONFIG_DIR", configs)
    before = snapshot(earlier_run)
    err = _fails(["--preset", "bad", "--out", str(earlier_run), "--overwrite"], capsys)
    assert f"preset file {bad}: {message}" in err
    assert snapshot(earlier_run) == before
    assert cli.parse(["--preset", "good"]).rounds == 3          # the same folder's good preset


def test_parse_flags_raises_instead_of_exiting(capsys):
    """For entry points that report errors themselves (sweep.py's --common): the same message as a
    UsageError (a ValueError), nothing printed, and `parse` still exits as before."""
    with pytest.raises(cli.UsageError, match=r"^argument --rounds: invalid int value: 'x'"):
        cli.parse_flags(["--rounds", "x"])
    with pytest.raises(cli.UsageError, match="--preset 'nope' not found"):
        cli.parse_flags(["--preset", "nope"])
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit):
        cli.parse(["--rounds", "x"])
    assert capsys.readouterr().err.startswith("run.py: error: argument --rounds")
