"""The README's two set-up commands are the ones CI and users run."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_exactly_the_readme_test_command():
    readme = ROOT.joinpath("README.md").read_text()
    ci = ROOT.joinpath(".ci", "run").read_text()
    test_command = 'pip install -e ".[test]" && python -m pytest -n 2'
    assert f"    {test_command}\n" in readme
    assert ci.rstrip().endswith(test_command)
    assert "    pip install -e . && python experiments/run.py --algo fedavg\n" in readme


@pytest.mark.slow
def test_readme_notebook_example_runs(capsys):
    import re

    code = re.search(r"```python\n(.*?)```", ROOT.joinpath("README.md").read_text(), re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    accuracies = capsys.readouterr().out
    assert accuracies.strip().startswith("[") and "nan" not in accuracies
