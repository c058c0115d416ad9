"""The README and the docs pages say what the code does: the set-up commands CI and users run,
every registered algorithm in the table, and command lines whose flags exist."""

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The pages whose commands are checked: the README and the site's own pages (docs/results/ and
# docs/decisions/ hold the commands of past measurements, with their own scripts).
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "algorithms").glob("*.md"))]


def test_ci_runs_exactly_the_readme_test_command():
    readme = README.read_text()
    ci = ROOT.joinpath(".ci", "run").read_text()
    test_command = 'pip install -e ".[test]" && python -m pytest -n 2'
    assert f"    {test_command}\n" in readme
    assert ci.rstrip().endswith(test_command)
    assert "    pip install -e . && python experiments/run.py --algo fedavg\n" in readme


@pytest.mark.slow
def test_readme_notebook_example_runs(capsys):
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    accuracies = capsys.readouterr().out
    assert accuracies.strip().startswith("[") and "nan" not in accuracies


def _algorithm_table() -> list[list[str]]:
    """The README's algorithm table: the rows under "## Algorithms", cells stripped."""
    section = README.read_text().split("\n## Algorithms\n", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("| `")]
    return [row for row in rows if row[0] != "`--algo`"]           # (the header)


def test_readme_algorithm_table_lists_every_registered_algorithm_once_with_paper_and_family():
    from fedjax_pfl import algorithms

    rows = _algorithm_table()
    names = [re.fullmatch(r"`(\w+)`", row[0]).group(1) for row in rows]
    assert sorted(names) == sorted(algorithms.names())          # every one, and nothing else
    assert len(names) == len(set(names))                         # once
    for row in rows:
        assert len(row) == 3 and row[1] and row[2], row         # a paper (or "—") and a family


def _commands(path: Path) -> list[tuple[str, str]]:
    """(page, command line) of every shell command in the page's code: fenced ```bash blocks and
    indented blocks, continuation lines joined."""
    text = path.read_text()
    blocks = re.findall(r"```(?:bash|sh|console)\n(.*?)```", text, re.S)
    blocks += re.findall(r"(?:^|\n\n)((?:(?: {4}|\t)[^\n]*\n?)+)", re.sub(r"```.*?```", "", text, flags=re.S))
    lines = []
    for block in blocks:
        joined = re.sub(r"\\\n\s*", " ", block)
        lines += [(path.name, line.strip()) for line in joined.splitlines() if line.strip()]
    return lines


def _argv(line: str, script: str) -> list[str] | None:
    """The arguments after `python experiments/SCRIPT` on a line, or None: not that script, or a
    line with a placeholder (`...`, `…`) that stands for flags."""
    if f"experiments/{script}" not in line or "..." in line or "…" in line:
        return None
    words = shlex.split(line, comments=True)
    words = [w for w in words if w != "&"]
    return words[words.index(f"experiments/{script}") + 1:]


def test_every_run_py_command_in_readme_and_docs_uses_flags_run_py_has():
    import run

    checked = 0
    for page in PAGES:
        for where, line in _commands(page):
            argv = _argv(line, "run.py")
            if argv is None or argv == ["--help"]:      # (--help: test_run_py_help_runs)
                continue
            try:
                run.parse_flags(argv)
            except (run.UsageError, SystemExit) as e:
                pytest.fail(f"{where}: {line}: {e}")
            checked += 1
    assert checked >= 20         # the README's recipes and the topic pages' (not a silent no-op)


def test_every_sweep_and_prepare_command_in_readme_and_docs_uses_flags_they_have():
    import prepare
    import run
    import sweep

    checked = 0
    for page in PAGES:
        for where, line in _commands(page):
            if (argv := _argv(line, "sweep.py")) is not None:
                args = sweep.build_parser().parse_args(argv)
                if args.common:
                    run.parse_flags(shlex.split(args.common))
                checked += 1
            if (argv := _argv(line, "prepare.py")) is not None:
                prepare.parse_args(argv)
                checked += 1
    assert checked >= 3


def test_run_py_help_runs():
    import run

    with pytest.raises(SystemExit) as exit_:
        run.main(["--help"])
    assert exit_.value.code == 0


def test_readme_images_and_links_into_docs_exist():
    text = README.read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if not re.match(r"\w+://", t) and not t.startswith("examples")]
    assert any(t.endswith(".png") for t in local)
    for target in local:
        assert (ROOT / target).exists(), target
