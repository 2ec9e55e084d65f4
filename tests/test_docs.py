"""The documentation: every public name has a docstring and an entry in the API reference, and the
user-facing text cites only what ships in the repository."""

from __future__ import annotations

import inspect
import pathlib
import re
import types

import pytest

import jax_sparse_mla as jsm

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
API_PAGE = DOCS / "api.rst"

# Design notes that live outside the repository: user-facing text must not point there.
OUTSIDE_CITATIONS = re.compile(r"SPEC\s*§|SPEC\.md|PERF\.md|ARCHITECTURE\.md|shared/design")


def _own_docstring(obj) -> str:
    """The object's own docstring: not one inherited from its type, nor a dataclass's generated signature."""
    doc = obj.__doc__ if isinstance(obj, type) or callable(obj) else None
    if not doc:
        return ""
    if isinstance(obj, type) and doc.startswith(f"{obj.__name__}("):
        return ""  # dataclasses and NamedTuples without a docstring get their signature as __doc__
    return inspect.cleandoc(doc)


@pytest.mark.parametrize("name", [n for n in jsm.__all__ if callable(getattr(jsm, n))])
def test_every_public_callable_has_a_docstring(name):
    doc = _own_docstring(getattr(jsm, name))
    assert doc, f"jax_sparse_mla.{name} has no docstring"
    assert len(doc.splitlines()[0]) > 10, f"jax_sparse_mla.{name}: the docstring's summary line is empty"


@pytest.mark.parametrize("name", jsm.__all__)
def test_every_public_name_is_on_the_api_page(name):
    directive = re.compile(rf"^\.\. (autofunction|autoclass|autodata|py:data|py:function|py:class):: {name}$",
                           re.MULTILINE)
    assert directive.search(API_PAGE.read_text()), f"docs/api.rst does not document jax_sparse_mla.{name}"


def _user_facing_texts():
    for path in sorted(DOCS.glob("*.md")) + sorted(DOCS.glob("*.rst")) + [ROOT / "README.md", ROOT / "CHANGELOG.md"]:
        yield str(path.relative_to(ROOT)), path.read_text()
    for name in jsm.__all__:
        obj = getattr(jsm, name)
        yield f"jax_sparse_mla.{name}", _own_docstring(obj)
        if isinstance(obj, type):
            for attr, member in vars(obj).items():
                if not attr.startswith("_") and isinstance(member, (property, types.FunctionType)) and member.__doc__:
                    yield f"jax_sparse_mla.{name}.{attr}", member.__doc__


def test_user_facing_text_cites_only_the_repository():
    offending = [f"{where}: {match.group(0)!r}" for where, text in _user_facing_texts()
                 for match in OUTSIDE_CITATIONS.finditer(text)]
    assert not offending, "user-facing text cites files outside the repository:\n" + "\n".join(offending)


def test_license_is_the_apache_license():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
