"""Sphinx configuration of the documentation site (`pip install -e ".[docs]"`, then
`python -m sphinx -W --keep-going -b html docs build/docs`; tests/test_docs.py builds it so).

Offline by construction: no intersphinx, no notebook execution, no remote theme assets. The API
reference imports the package (autodoc) and nothing else heavy: the optional metric-sink
libraries are imported by the sinks only when a run asks for them.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))                   # the checkout's package, installed or not
sys.path.insert(0, str(Path(__file__).parent))  # _ext

project = "fedjax_pfl"
author = "the fedjax_pfl authors"
copyright = "the fedjax_pfl authors, Apache-2.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",       # the docstrings' Google-style Args:/Returns: sections
    "sphinx.ext.mathjax",
    "_ext.docstrings",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "**/_build", "results/*.py", "results/*.sh"]

# Markdown: `#anchor` links to headings (docstrings and the algorithm notes cite
# docs/algorithms/NAME.md#aN), $…$ math, definition lists and tables as GitHub writes them.
myst_heading_anchors = 4
myst_enable_extensions = ["dollarmath", "deflist", "colon_fence", "attrs_inline"]

# Docstrings write `name` for code, as Markdown does.
default_role = "code"

autodoc_default_options = {"members": True, "member-order": "bysource", "show-inheritance": True}
autodoc_typehints = "signature"
autodoc_class_signature = "separated"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = "fedjax_pfl"
html_static_path: list[str] = []

# Pages of the site that live elsewhere in the repository (included by a page here): links to
# them from the docs pages lead to that page.
site_pages_outside = {"benchmarks/RESULTS": "benchmarks"}
