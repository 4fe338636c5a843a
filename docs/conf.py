"""Sphinx configuration of the fedcompress documentation (``make docs``; ``make test`` builds it
with warnings as errors, so a broken link, reference or docstring fails the tests).

Sphinx with MyST: the pages are Markdown (MyST), the API reference is generated from the
docstrings (autodoc + autosummary), which are written in reST roles (``:func:``, ``:class:``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

project = "fedcompress"
author = "the fedcompress authors"
copyright = "the fedcompress authors, Apache-2.0"  # noqa: A001

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
]
# ``make test`` builds the site with ``-t check``: every page, reference and docstring under the
# same strict rules, without the two parts that only render (together they were half of the
# build's 104 s): the highlighted source pages (viewcode) and each function and class as an
# entry of its page's table of contents, which the theme copies into every page's navigation.
CHECK = tags.has("check")  # type: ignore[name-defined]  # noqa: F821 (Sphinx's namespace)
if not CHECK:
    extensions.append("sphinx.ext.viewcode")
toc_object_entries = not CHECK
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
exclude_patterns = ["_build", "api/generated/*.inc"]

templates_path = ["_templates"]
autosummary_generate = True
autodoc_default_options = {"members": True, "show-inheritance": True, "ignore-module-all": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"

html_theme = "furo"
html_title = "fedcompress"
