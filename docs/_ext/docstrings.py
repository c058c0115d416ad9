"""How the API reference reads the library's docstrings.

The docstrings are written for a reader of the source: Google-style sections (napoleon renders
them), `name` for code, and here and there an aligned plain-text table or an equation with `*`
in it, which reStructuredText takes for markup it cannot close. Such a docstring is shown
verbatim, as one preformatted block, rather than mangled or turned into a build warning: the
reference then says exactly what the source says. The docstrings shown verbatim are listed in the
build's log (`sphinx-build -v`).

The algorithm notes mark their numbered readings with HTML anchors, `<a id="a1"></a>`, which
GitHub renders and docstrings cite (`docs/algorithms/NAME.md#a1`); they are registered as link
targets of their page here, so that `[A1](#a1)` and `pgfed.md#a4` resolve in the site too.

Members that a package merely re-exports from outside the library (`typing.Any`, jax functions)
are left out: the reference documents fedjax_pfl's own objects.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

from docutils.core import publish_doctree
from docutils.nodes import raw, reference
from sphinx.addnodes import pending_xref
from sphinx.util import logging

logger = logging.getLogger(__name__)

# Sphinx's roles and directives (`:py:class:`, `.. attribute::`, what napoleon writes), unknown to
# plain docutils: stripped before the check, which asks only whether the markup itself is sound.
_ROLE = re.compile(r":(?:[\w+-]+:)+(?=`)")
_DIRECTIVE = re.compile(r"^(\s*)\.\. ([\w:-]+)::", re.M)
_SPHINX_ONLY = ("Unknown directive type", "Unknown interpreted text role", "No role entry",
                "No directive entry")


def markup_problems(lines: list[str]) -> list[str]:
    """The reStructuredText problems (warnings and worse) of a docstring's lines, as docutils
    reports them, ignoring roles and directives that only Sphinx defines."""
    text = _DIRECTIVE.sub(r"\1.. \2 (a directive)", _ROLE.sub("", "\n".join(lines)))
    stream = io.StringIO()
    publish_doctree(text, settings_overrides={
        "report_level": 2, "halt_level": 5, "warning_stream": stream,
        "file_insertion_enabled": False, "raw_enabled": False})
    found = re.split(r"^<string>:\d+: ", stream.getvalue(), flags=re.M)
    return [" ".join(m.split()) for m in found
            if m.strip() and not any(s in m for s in _SPHINX_ONLY)]


def verbatim(lines: list[str]) -> list[str]:
    """`lines` as one literal block (the docstring exactly as written)."""
    return ["::", ""] + [("    " + line) if line.strip() else "" for line in lines] + [""]


# The docstrings found unsound before napoleon rewrote them: name -> their lines as written.
_AS_WRITTEN: dict[str, list[str]] = {}


def _check_docstring(app: Any, what: str, name: str, obj: Any, options: Any,
                     lines: list[str]) -> None:
    problems = markup_problems(lines) if lines else []
    if problems:
        logger.verbose("docstring of %s shown verbatim: %s", name, problems[0])
        _AS_WRITTEN[name] = list(lines)


def _show_verbatim(app: Any, what: str, name: str, obj: Any, options: Any,
                   lines: list[str]) -> None:
    if name in _AS_WRITTEN:
        lines[:] = verbatim(_AS_WRITTEN.pop(name))


def _skip_member(app: Any, what: str, name: str, obj: Any, skip: bool, options: Any) -> bool | None:
    module = getattr(obj, "__module__", None)
    if what == "module" and isinstance(module, str) and not module.startswith("fedjax_pfl"):
        return True
    return None


_HTML_ANCHOR = re.compile(r'<a\s+id="([^"]+)"\s*>')


def _html_anchors(app: Any, doctree: Any) -> None:
    docname = app.env.docname
    anchors = {anchor for node in doctree.findall(raw) if "html" in node.get("format", "").split()
               for anchor in _HTML_ANCHOR.findall(node.astext())}
    labels = app.env.domaindata["std"]["anonlabels"]
    for anchor in anchors:
        labels[f"{docname}#{anchor}"] = (docname, anchor)   # keyed by page: each note has its a1
    # `[A1](#a1)` on the anchor's own page: a plain link to it (MyST would look the name up among
    # every page's labels).
    for node in list(doctree.findall(pending_xref)):
        if node.get("reftype") == "myst" and node["reftarget"] in anchors:
            link = reference("", "", *node.children, refid=node["reftarget"], internal=True)
            node.replace_self(link)


def _pages_outside(app: Any, doctree: Any) -> None:
    """Links to the repository's files that the site includes as pages of its own
    (`site_pages_outside`: path from the repository root -> page) lead to those pages."""
    root = Path(app.srcdir).parent
    for node in doctree.findall(pending_xref):
        target = node.get("reftarget", "")
        if node.get("reftype") == "myst" and target.startswith(str(root)):
            page = app.config.site_pages_outside.get(Path(target).relative_to(root).as_posix())
            if page:
                node["reftarget"] = page


def setup(app: Any) -> dict:
    # The check reads the docstring as written, before napoleon (priority 500) turns its sections
    # into Sphinx's directives; a docstring found unsound then replaces napoleon's rendering.
    app.connect("autodoc-process-docstring", _check_docstring, priority=100)
    app.connect("autodoc-process-docstring", _show_verbatim, priority=900)
    app.connect("autodoc-skip-member", _skip_member)
    app.connect("doctree-read", _html_anchors)
    app.add_config_value("site_pages_outside", {}, "env")
    app.connect("doctree-read", _pages_outside)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
