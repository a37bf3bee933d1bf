"""Sphinx configuration for kvcore's documentation.

Why Sphinx with MyST:

- the pages are Markdown, and myst-parser reads them as they are;
- sphinx-argparse generates the CLI reference straight from
  ``kvcore.tools.cli.build_parser``, so the reference always matches the parser;
- autodoc reads the API reference from the docstrings (reST field lists,
  ``:param x:``), so it cannot drift from the code;
- ``sphinx -W`` turns every warning (a broken reference, a bad docstring, a
  page missing from the toctree) into an error, so CI catches them;
- MkDocs 1.x's future is unsettled.

Build (what CI runs)::

    python -m pip install -e ".[docs]"
    python -m sphinx -W --keep-going -b html docs docs/_build/html

Intersphinx is deliberately not enabled: CI machines may have no internet.
"""

from __future__ import annotations

import importlib.util

project = "kvcore"
author = "kvcore contributors"
copyright = "kvcore contributors"

extensions = [
    "myst_parser",
    "sphinxarg.ext",
    "sphinx.ext.autodoc",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# MyST: ``{ref}`` targets for every heading down to ###, so pages can link to
# sections ("capacity.md#packing-policies").
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# autodoc: members in source order, signatures with their type hints in the
# description rather than the (long) signature line.
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}

# The docstrings refer to names by Python roles (``:class:`KVCachePool```);
# a name that is not documented here (torch, attrs, private helpers) would
# warn under nitpicky mode, so it stays off: -W still fails on every real
# markup error and every broken document reference.
nitpicky = False

html_theme = "furo" if importlib.util.find_spec("furo") else "alabaster"
html_title = "kvcore"
html_static_path: list[str] = []

# Options are shown as typed: "--memory" must not become an en dash.
smartquotes = False
