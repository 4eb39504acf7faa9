"""Sphinx configuration: MyST Markdown pages, the furo theme. Built strictly (warnings are errors) by
``tests/test_docs.py`` and ``.ci/run``: ``python -m sphinx -W --keep-going -b html docs docs/_build``."""

project = "resumable"
author = "the resumable authors"
extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = "resumable"
myst_heading_anchors = 3  # links such as drive.md#drive-api-from-a-shell work across pages
suppress_warnings: list[str] = []
