"""Sphinx configuration of the jax_sparse_mla documentation.

Build from the repository root, after ``pip install '.[docs]'``::

    sphinx-build -W -b html docs docs/_build/html

The API reference is generated from the docstrings of the *installed* package (its compiled extension
is needed to import it), so the source folder is kept off ``sys.path``.
"""

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The source folder has no compiled extension: importing jax_sparse_mla from it would fail.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

import jax_sparse_mla  # noqa: E402

project = "jax_sparse_mla"
copyright = "the jax_sparse_mla authors"
release = jax_sparse_mla.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
# kernel_log.md is the kernels' development history, not part of the user guide.
exclude_patterns = ["_build", "kernel_log.md"]

myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

html_theme = "alabaster"
html_title = f"jax_sparse_mla {release}"
