"""benchmarks/: the README's table lists every script and only scripts that exist, and each listed
script's --help exits 0 before importing JAX or PyTorch (the heavy imports follow the parsing)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def listed() -> list[str]:
    """The scripts in the first column of benchmarks/README.md's table, relative to benchmarks/."""
    return re.findall(r"^\| `([\w/]+\.py)` \|", (BENCH / "README.md").read_text(), re.M)


def test_the_readme_lists_every_script_once_and_only_scripts_that_exist():
    names = listed()
    assert len(names) == len(set(names)), names
    missing = sorted(p.name for p in BENCH.glob("*.py") if p.name not in names)
    assert not missing, f"benchmarks/README.md does not list {missing}"
    absent = [n for n in names if not (BENCH / n).is_file()]
    assert not absent, f"benchmarks/README.md lists scripts that do not exist: {absent}"
    assert "peers/harness.py" in names


# Runs the script as `python SCRIPT ARGS...` would, then reports which heavy modules it imported.
_HELP = r"""
import runpy, sys
script, sys.argv = sys.argv[1], sys.argv[1:]
try:
    runpy.run_path(script, run_name="__main__")
    code = 0
except SystemExit as e:
    code = e.code or 0
print("HEAVY", sorted(m for m in ("jax", "torch", "flax", "optax") if m in sys.modules))
sys.exit(code)
"""

SUBCOMMANDS = [("scale.py", "clients"), ("scale.py", "skew"), ("scale.py", "seeds"),
               ("scale.py", "processes"), ("placement.py", "data"), ("placement.py", "state")]


@pytest.mark.parametrize("script,sub", [(name, None) for name in listed()] + SUBCOMMANDS)
@pytest.mark.slow
def test_help_exits_zero_without_heavy_imports(script, sub):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", _HELP, str(BENCH / script), *([sub] if sub else []), "--help"]
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "HEAVY []", out.stdout[-500:]


# A commit as git abbreviates or spells it: 7–40 lowercase hex digits, at least one a–f letter and
# one digit, standing alone (plain numbers such as 1000000 and words such as "defaced" are not).
_COMMIT = re.compile(r"(?<![\w.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w-])")
# Pages owned by the documentation rewrite (issue 55, items 1–2), which drops their citations;
# every other text file of the repository is checked.
_CITATIONS_CHECKED_ELSEWHERE: set[str] = set()
_SECTION = "\u00a7"  # the section sign, escaped so that this file does not cite one itself


def test_results_hold_no_commit_hashes():
    """RESULTS.md holds current figures with their machine and date, not the commits that made
    them (history is git's), so a measurement's line cannot rot into a diary again."""
    found = _COMMIT.findall((BENCH / "RESULTS.md").read_text())
    assert not found, f"benchmarks/RESULTS.md names commits: {sorted(set(found))[:10]}"


def _text_files() -> list[Path]:
    dirs = ["fedjax_pfl", "benchmarks", "experiments", "tests", "docs", ".ci"]
    files = [p for d in dirs for p in (ROOT / d).rglob("*")
             if p.is_file() and p.suffix in {".py", ".md", ".toml", ".sh", ".txt", ".cfg", ".ipynb", ""}
             and "work" not in p.relative_to(ROOT).parts]
    files += [ROOT / "pyproject.toml", ROOT / "README.md"]
    return [p for p in files if p.is_file()
            and p.relative_to(ROOT).as_posix() not in _CITATIONS_CHECKED_ELSEWHERE]


def test_nothing_cites_a_results_section_number():
    """RESULTS.md has no numbered sections (its tables are named by their headings), so a section
    sign within a few words of the page's name anywhere in the code, tests or docs is a stale
    citation: cite the table's heading or a docs/decisions note instead."""
    results = (BENCH / "RESULTS.md").read_text()
    assert _SECTION not in results, "benchmarks/RESULTS.md cites a section number"
    stale = []
    for path in _text_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for m in re.finditer(_SECTION, text):
            if "RESULTS" in text[max(0, m.start() - 40):m.end() + 40]:
                line = text.count("\n", 0, m.start()) + 1
                stale.append(f"{path.relative_to(ROOT)}:{line}")
    assert not stale, f"citations of a RESULTS.md section number: {stale}"


def test_citations_name_results_headings_and_decision_notes_that_exist():
    """A citation of a RESULTS.md table names one of its headings, and a citation of a settled
    question names a note under docs/decisions/, so renaming either breaks here, not silently."""
    headings = set(re.findall(r"^## (.+)$", (BENCH / "RESULTS.md").read_text(), re.M))
    decisions = {p.name for p in (ROOT / "docs" / "decisions").glob("*.md")}
    cited_tables: list[tuple[str, str]] = []
    cited_notes: list[tuple[str, str]] = []
    for path in _text_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        name = path.relative_to(ROOT).as_posix()
        cited_tables += [(name, " ".join(t.split())) for t in
                         re.findall(r"RESULTS\.md`?(?:'s table|, tables?|,)\s*\"([^\"]+)\"", text)]
        cited_notes += [(name, n) for n in re.findall(r"docs/decisions/([\w-]+\.md)", text)]
    assert cited_tables and cited_notes  # the patterns still find the code's citations
    unknown = [c for c in cited_tables if c[1] not in headings]
    assert not unknown, f"citations of RESULTS.md tables that it does not have: {unknown}"
    missing = [c for c in cited_notes if c[1] not in decisions]
    assert not missing, f"citations of notes not in docs/decisions/: {missing}"


# startup.py's phase accounting. A toy script whose phases take known times: an import that sleeps
# 0.25 s, a "plot" that sleeps 0.3 s (wall, no CPU), a "checkpoint" that spins 0.3 s of its
# thread's CPU, 0.2 s of sleep in no phase ("other"); nothing calls core.Program.init, and the
# fake fedjax_pfl.checkpoint has no `restore`, so the table prints "–" for "initial state" and
# says that hook was not found.
_TOY = {
    "slow_import.py": "import time\ntime.sleep(0.25)\n",
    "fedjax_pfl/__init__.py": "",
    "fedjax_pfl/plots.py": "import time\n\ndef plot_learning_curves():\n    time.sleep(0.3)\n",
    "fedjax_pfl/checkpoint.py": ("import time\n\ndef save():\n    t = time.thread_time()\n"
                                 "    while time.thread_time() - t < 0.3:\n        pass\n"),
    "toy.py": ("import time\nimport slow_import\nfrom fedjax_pfl import checkpoint, plots\n"
               "plots.plot_learning_curves()\ncheckpoint.save()\ntime.sleep(0.2)\n"),
}


def _startup(args: list[str], env: dict, tmp_path: Path) -> tuple[str, list[dict]]:
    out = tmp_path / "startup.json"
    proc = subprocess.run([sys.executable, str(BENCH / "startup.py"), *args, "--repeats", "1",
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc.stdout, json.loads(out.read_text())["runs"]


def _phase_sums(run: dict) -> tuple[float, float]:
    ledger = run["ledger"]
    return sum(ledger["wall"].values()), sum(ledger["cpu"].values())


def test_startup_phases_of_a_toy_script_take_their_known_times_and_add_up(tmp_path):
    for name, text in _TOY.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    stdout, runs = _startup(["--script", str(tmp_path / "toy.py"), "--modes", "cold"], env, tmp_path)
    (run,) = runs
    wall, cpu = run["ledger"]["wall"], run["ledger"]["cpu"]
    slack = 1.0                                    # (a shared 2-core machine)
    assert 0.3 <= wall["plots"] < 0.3 + slack and cpu["plots"] < 0.1
    assert cpu["checkpoints"] >= 0.3 and wall["checkpoints"] >= 0.3
    assert 0.25 <= wall["imports"] < 0.25 + slack
    assert wall["other"] >= 0.2
    assert "initial state" not in wall and "XLA compile" not in wall
    # Every moment is in exactly one phase: the phases add up to the parent's own totals.
    total_wall, total_cpu = _phase_sums(run)
    assert abs(total_wall - run["total_wall"]) < 0.02, (total_wall, run["total_wall"])
    assert abs(total_cpu - run["total_cpu"]) < 0.02, (total_cpu, run["total_cpu"])
    rows = {line.split("  ")[1].strip(): line for line in stdout.splitlines()
            if line.startswith("  ") and len(line.split("  ")) > 2}
    assert rows["initial state"].rstrip().endswith("–"), rows["initial state"]
    assert rows["plots"].split()[-3:] == [f"{wall['plots']:.2f}", "/", f"{cpu['plots']:.2f}"]
    assert "hooks not found: fedjax_pfl.checkpoint:restore" in stdout


@pytest.mark.slow
def test_startup_phases_of_two_rounds_on_the_digits_add_up(tmp_path):
    """The main job for 2 rounds, cold then warm: the phases add up to the process's wall and
    CPU, and the runner's own compile clock (summary.json) is within the phases its
    Program.compile is split into."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    _, runs = _startup(["--jobs", "fedavg", "--rounds", "2"], env, tmp_path)
    by_mode = {r["mode"]: r for r in runs}
    assert set(by_mode) == {"cold", "warm"}
    for run in runs:
        wall, cpu = run["ledger"]["wall"], run["ledger"]["cpu"]
        total_wall, total_cpu = _phase_sums(run)
        assert abs(total_wall - run["total_wall"]) < 0.05, (run["mode"], total_wall, run["total_wall"])
        assert abs(total_cpu - run["total_cpu"]) < 0.05, (run["mode"], total_cpu, run["total_cpu"])
        assert min(wall.values()) >= 0 and min(cpu.values()) >= -0.01
        for phase in ("imports", "trace + lower", "XLA compile", "initial state",
                      "rounds and evaluations", "teardown"):
            assert phase in wall, (run["mode"], phase)
        assert run["ledger"]["programs"] > 0
        split = wall["trace + lower"] + wall["XLA compile"] + wall["imports"]
        assert run["summary_compile_s"] <= split + 0.1, (run["summary_compile_s"], split)
    assert by_mode["warm"]["ledger"]["wall"]["XLA compile"] < by_mode["cold"]["ledger"]["wall"]["XLA compile"]
