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
    own = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "kernels" / "cuda" / "NOTES.md"]
    for path in sorted(DOCS.glob("*.md")) + sorted(DOCS.glob("*.rst")) + own:
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


def _documented_arguments(doc: str):
    """The names of the entries of a Google-style ``Args:`` section (None without one)."""
    lines = doc.splitlines()
    if "Args:" not in [line.strip() for line in lines]:
        return None
    start = [line.strip() for line in lines].index("Args:") + 1
    indent = None
    names = []
    for line in lines[start:]:
        if not line.strip():
            continue
        width = len(line) - len(line.lstrip())
        if indent is None:
            indent = width
        if width < indent:
            break  # the next section
        if width == indent:
            match = re.match(r"\s*(\*{0,2}\w+)( \(.*\))?: ", line)
            assert match, f"an Args entry that does not start with one argument name: {line.strip()!r}"
            names.append(match.group(1).lstrip("*"))
    return names


@pytest.mark.parametrize("name", [n for n in jsm.__all__ if inspect.isfunction(getattr(jsm, n))])
def test_args_sections_have_one_entry_per_parameter(name):
    function = getattr(jsm, name)
    names = _documented_arguments(_own_docstring(function))
    if names is None:
        pytest.skip(f"{name} has no Args section")
    parameters = [p for p in inspect.signature(function).parameters]
    assert names == parameters, f"jax_sparse_mla.{name}: Args entries {names} != parameters {parameters}"


def test_the_ffi_target_version_is_named_consistently():
    """Text that names the FFI target's version names the one that is registered (the changelog, which
    records earlier versions, aside)."""
    from jax_sparse_mla import _ffi

    version = re.fullmatch(r"jax_sparse_mla_fwd_(v\d+)", _ffi.TARGET).group(1)
    package = ROOT / "jax_sparse_mla"
    texts = [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted(package.glob("*.py"))]
    texts += [(where, text) for where, text in _user_facing_texts() if where != "CHANGELOG.md"]
    pattern = re.compile(r"jax_sparse_mla_fwd_(v\d+)|`_?(v\d+)` attribute contract|_(v\d+)`` attribute contract")
    named = [(where, next(g for g in m.groups() if g)) for where, text in texts for m in pattern.finditer(text)]
    assert named, "nothing names the FFI target"
    assert [n for n in named if n[1] != version] == [], f"the target is {_ffi.TARGET}"


def test_readme_example_sm_scale_is_marked_illustrative():
    """The README example's literal sm_scale is said to be illustrative, with a pointer to the model's own."""
    readme = (ROOT / "README.md").read_text()
    example = re.search(r"^## Example\n(.*?)^## ", readme, re.S | re.M).group(1)
    blocks = re.findall(r"```python\n(.*?)```", example, re.S)
    literal = [b for b in blocks if re.search(r"sm_scale=\d", b)]
    assert literal
    for block in literal:
        assert "illustrative" in block and "examples/deepseek_v32" in block, block
