"""The documentation site (docs/): its API reference covers the public modules, its docstring
fallback catches unsound markup, and it builds offline with warnings as errors."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PUBLIC = ["core", "algorithms", "runner", "sweep", "callbacks", "checkpoint", "distributed", "models",
          "data", "ops", "privacy", "sinks", "errors", "interrupts", "export", "compiles",
          "compile_cache"]


def test_api_reference_has_a_page_for_every_public_module():
    index = DOCS.joinpath("api", "index.md").read_text()
    for name in PUBLIC:
        page = DOCS / "api" / f"{name}.md"
        assert page.exists(), page
        assert re.search(rf"^\.\. automodule:: fedjax_pfl\.{name}$", page.read_text(), re.M), page
        assert re.search(rf"^{name}$", index, re.M), f"{name} not in docs/api/index.md"


def test_docstring_check_flags_unsound_markup_and_shows_it_verbatim():
    pytest.importorskip("sphinx")
    sys.path.insert(0, str(DOCS))
    from _ext.docstrings import markup_problems, verbatim

    sound = ["Exposes `count` cores.", "", "Args:", "  count: how many.", "", "Returns:", "  The count."]
    assert markup_problems(sound) == []
    # An equation with an unclosed `*`, and an aligned table that ends without a blank line:
    assert any("emphasis" in p for p in markup_problems(["The weight *w of a client."]))
    assert markup_problems(["By role:", "  clients   the axis", "not indented"])
    shown = verbatim(["a*b", "", "  x"])
    assert shown[:2] == ["::", ""] and shown[2:5] == ["    a*b", "", "      x"]


@pytest.mark.slow
def test_docs_build_offline_with_warnings_as_errors(tmp_path):
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    out = tmp_path / "html"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", "html",
                           str(DOCS), str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    # The API reference is generated from the docstrings: a class and a function documented.
    core = out.joinpath("api", "core.html").read_text()
    assert 'id="fedjax_pfl.core.Program"' in core and "Program" in core
    # A reading cited across pages by an algorithm note's HTML anchor resolves to that anchor.
    results = out.joinpath("results", "pgfed.html").read_text()
    assert re.search(r'href="\.\./algorithms/pgfed\.html#a\d+"', results)
    # benchmarks/RESULTS.md is a page of the site.
    assert out.joinpath("benchmarks.html").exists()
