"""benchmarks/: the README's table lists every script and only scripts that exist, and each listed
script's --help exits 0 before importing JAX or PyTorch (the heavy imports follow the parsing)."""

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
def test_help_exits_zero_without_heavy_imports(script, sub):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", _HELP, str(BENCH / script), *([sub] if sub else []), "--help"]
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "HEAVY []", out.stdout[-500:]
