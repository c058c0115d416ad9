"""The notebooks of examples/ run: each is executed as a reader runs it (a fresh kernel, every
cell in order, in an empty folder; a cell that raises fails the test, and the notebooks' own
cells assert what they teach: the custom algorithm equals FedAvg, a vmapped run a plain one),
without writing the executed copy back. The stored copies carry the outputs a reader sees."""

import os
import signal
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
NOTEBOOKS = ("custom_algorithm.ipynb", "quickstart.ipynb", "sweep.ipynb")


def _outputs(nb) -> list:
    return [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]


def _figures(nb) -> int:
    return sum("image/png" in o.get("data", {}) for o in _outputs(nb))


def test_examples_are_the_three_notebooks_stored_with_their_outputs():
    """Every notebook of examples/ is one of those executed below, and each is stored as run
    top to bottom once (execution counts 1, 2, …: no cell added or rerun since), with no error
    output and its figure."""
    assert sorted(p.name for p in EXAMPLES.glob("*.ipynb")) == list(NOTEBOOKS)
    for name in NOTEBOOKS:
        nb = nbformat.read(EXAMPLES / name, as_version=4)
        nbformat.validate(nb)
        code = [cell for cell in nb.cells if cell.cell_type == "code"]
        assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), name
        assert not [o for o in _outputs(nb) if o.output_type == "error"], name
        assert _figures(nb) >= 1, name


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_top_to_bottom(name, tmp_path, monkeypatch):
    from nbclient import NotebookClient

    nb = nbformat.read(EXAMPLES / name, as_version=4)
    work = tmp_path / "cwd"
    work.mkdir()
    # The kernel imports this checkout's package; IPython's and Jupyter's own files go to tmp_path.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.delenv("MPLBACKEND", raising=False)   # (the kernel's inline backend draws the figures)
    # nbclient's kernel manager installs Python's default SIGINT handler; put back the one this
    # process had (a background job's, or pytest's), as tests/conftest.py requires.
    handler = signal.getsignal(signal.SIGINT)
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3",
                       resources={"metadata": {"path": str(work)}}).execute()   # raises if a cell does
    finally:
        signal.signal(signal.SIGINT, handler)
    assert not [o for o in _outputs(nb) if o.output_type == "error"]
    assert _figures(nb) >= 1                 # its plot was drawn
    assert list(work.iterdir()) == []        # and nothing written where it ran
