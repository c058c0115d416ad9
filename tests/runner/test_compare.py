"""experiments/compare.py: a table of runs on one partition, diverged runs recorded, --resume
reusing only runs of the same configuration, and nothing of an earlier run touched otherwise."""

import json
import os

import compare  # experiments/compare.py
import pytest

COMMON = "--clients 6 --rounds 2 --participation 0.5"


def _files(root) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
            for d, _, fs in os.walk(root) for f in fs}


def _refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        compare.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1, err
    return err[0]


@pytest.mark.slow
def test_compare_tabulates_records_divergence_and_resumes(tmp_path, capsys):
    out = tmp_path / "cmp"
    argv = ["--out", str(out), "--common", COMMON,
            "--run", "fedavg: --algo fedavg", "--run", "blows up: --algo fedavg --lr 1e12"]
    assert compare.main(argv) == 0
    rows = json.loads((out / "results.json").read_text())
    assert [r["label"] for r in rows] == ["fedavg", "blows up"]
    assert 0 <= rows[0]["acc_last"] <= 1 and rows[1]["diverged"].startswith("round 1")
    table = (out / "results.md").read_text()
    assert "| blows up | diverged (round 1" in table
    assert "python experiments/run.py --clients 6 --rounds 2 --participation 0.5 --algo fedavg" in table
    assert (out / "curves.png").exists() and (out / "fedavg" / "summary.json").exists()
    capsys.readouterr()
    # --resume reuses the finished run (same numbers, no retraining).
    summary_file = out / "fedavg" / "summary.json"
    written = summary_file.stat().st_mtime_ns
    assert compare.main(argv[:2] + ["--resume"] + argv[2:6]) == 0
    assert summary_file.stat().st_mtime_ns == written
    again = json.loads((out / "results.json").read_text())
    assert again[0]["acc_last"] == rows[0]["acc_last"] and len(again) == 1
    # A run whose flags changed is neither reused nor run again over the saved one: refused,
    # before anything runs, naming the flag; no file changes.
    before = _files(out)
    changed = ["--out", str(out), "--resume", "--common", COMMON.replace("--rounds 2", "--rounds 3"),
               "--run", "fedavg: --algo fedavg"]
    line = _refused(changed, capsys)
    assert "--run 'fedavg'" in line and "--rounds 2, not 3" in line
    assert _files(out) == before
    # A flag in --common that changes a hyperparameter is caught too (not just the named ones).
    changed = ["--out", str(out), "--resume", "--common", COMMON + " --local-epochs 2",
               "--run", "fedavg: --algo fedavg"]
    assert "--local-epochs 1, not 2" in _refused(changed, capsys)
    assert _files(out) == before


def test_labels_that_share_a_folder_are_refused_before_anything(tmp_path, capsys):
    """"lr 0.05" and "lr-0.05" both name the folder lr_0_05: the second run would delete the
    first's files. Refused in one line before --out is made."""
    out = tmp_path / "cmp"
    line = _refused(["--out", str(out), "--common", COMMON, "--run", "lr 0.05: --lr 0.05",
                     "--run", "lr-0.05: --lr 0.05"], capsys)
    assert "--run 'lr 0.05' and --run 'lr-0.05' would share the folder" in line
    assert not out.exists()


def test_an_out_holding_files_needs_resume_and_is_left_as_it_is(tmp_path, capsys):
    out = tmp_path / "cmp"
    (out / "fedavg").mkdir(parents=True)
    (out / "fedavg" / "summary.json").write_text('{"kept": true}')
    before = _files(out)
    line = _refused(["--out", str(out), "--common", COMMON, "--run", "fedavg: --algo fedavg"],
                    capsys)
    assert "already holds files" in line and "--resume" in line
    # With --resume, a folder that holds files but no config.json is no run of this command.
    line = _refused(["--out", str(out), "--resume", "--common", COMMON,
                     "--run", "fedavg: --algo fedavg"], capsys)
    assert "no readable config.json" in line
    assert _files(out) == before


@pytest.mark.parametrize("flags,message", [
    ("--lr -1", "--run 'bad': --lr must be > 0"),
    ("--no-such-flag", "--run 'bad': unrecognized arguments: --no-such-flag"),
    ("--partition iid --shards-per-client 2",
     "--run 'bad': --shards-per-client applies to --partition shards only, not --partition iid"),
    ("--dp-noise-multiplier 1", "--run 'bad': --dp-noise-multiplier needs --dp-clip"),
])
def test_bad_run_flags_are_one_line_and_leave_no_folder(tmp_path, capsys, flags, message):
    out = tmp_path / "cmp"
    line = _refused(["--out", str(out), "--common", COMMON, "--run", f"bad: {flags}"], capsys)
    assert message in line
    assert not out.exists()
