"""experiments/compare.py: a table of runs on one partition, diverged runs recorded, --resume."""

import json

import pytest

import compare        # experiments/compare.py


@pytest.mark.slow
def test_compare_tabulates_records_divergence_and_resumes(tmp_path, capsys):
    out = tmp_path / "cmp"
    argv = ["--out", str(out), "--common", "--clients 6 --rounds 2 --participation 0.5",
            "--run", "fedavg: --algo fedavg", "--run", "blows up: --algo fedavg --lr 1e12"]
    stale = out / "blows_up" / "summary.json"       # left over from an earlier run there
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")
    assert compare.main(argv) == 0
    assert not stale.exists()                       # the diverged run did not leave it in place
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
    # A run whose flags changed is not reused.
    capsys.readouterr()
    changed = ["--out", str(out), "--resume", "--common", "--clients 6 --rounds 3 --participation 0.5",
               "--run", "fedavg: --algo fedavg"]
    assert compare.main(changed) == 0
    assert "another configuration: running it again" in capsys.readouterr().out
    assert json.loads((out / "fedavg" / "config.json").read_text())["rounds"] == 3

