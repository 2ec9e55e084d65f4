"""The README's quick start as a new user runs it: its commands are what CI runs, verbatim from the
clone's root, and the package imports from its source tree (the directory those commands run in).

Python puts the working directory first on ``sys.path``, so ``python -m jax_sparse_mla`` run from the
clone's root imports the sources, which hold no compiled files; the package then loads the extensions
of the installed distribution, or says in one line what to do.
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import jax_sparse_mla as jsm

ROOT = pathlib.Path(__file__).resolve().parents[1]
CI_SCRIPT = ROOT / ".ci" / "run"


def _readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", text, re.S | re.M)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def _bash_commands(section: str) -> list:
    """The commands of a section's ```bash blocks, without their trailing comments."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.splitlines():
            command = re.sub(r"\s+#.*$", "", line).strip()
            if command:
                commands.append(command)
    return commands


def _ci_lines() -> list:
    return [line.strip() for line in CI_SCRIPT.read_text().splitlines()]


def test_readme_quick_start_is_what_ci_runs_from_the_root():
    commands = _bash_commands(_readme_section("Quick start"))
    assert commands == ["pip install . && python -m jax_sparse_mla demo", "pip install '.[test]' && pytest -q tests"]
    lines = _ci_lines()
    for command in commands:
        # A whole line: not inside a subshell or after a `cd` that leaves the clone's root.
        assert command in lines, f".ci/run does not run the README's quick-start command verbatim: {command}"
    before = lines[:min(lines.index(command) for command in commands)]
    moves = [line for line in before if re.search(r"(^|[(;&|]\s*)(cd|pushd)\s", line)]
    assert moves == ['cd "$(dirname "$0")/.."'], f".ci/run leaves the clone's root before the quick start: {moves}"


def test_readme_wheel_command_is_what_ci_runs():
    section = _readme_section("Building with CUDA")
    wheel = [c for c in _bash_commands(section) if "python -m build" in c]
    assert len(wheel) == 1, f"the README's CUDA section should give one wheel command, got {wheel}"
    assert wheel[0] in _ci_lines(), f".ci/run does not build the wheel as the README says: {wheel[0]}"


def _run_python(code: str, cwd, env=None):
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=env)


def test_package_imports_from_the_source_tree():
    result = _run_python("import jax_sparse_mla as jsm; print(jsm.__file__); print(jsm._ffi._cpu_ext.__file__)",
                         cwd=ROOT)
    assert result.returncode == 0, result.stderr
    package_file, extension_file = result.stdout.split()
    assert pathlib.Path(package_file).parent == ROOT / "jax_sparse_mla"  # the sources, not the installed copy
    assert pathlib.Path(extension_file).is_file()


def test_cli_runs_from_the_source_tree():
    result = subprocess.run([sys.executable, "-m", "jax_sparse_mla", "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "demo" in result.stdout


def _source_copy(tmp_path, version=None) -> pathlib.Path:
    """A source tree (pyproject.toml beside the package, no compiled files) at tmp_path/src."""
    root = tmp_path / "src"
    shutil.copytree(ROOT / "jax_sparse_mla", root / "jax_sparse_mla",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    if version is not None:
        init = root / "jax_sparse_mla" / "__init__.py"
        init.write_text(re.sub(r'__version__ = "[^"]*"', f'__version__ = "{version}"', init.read_text()))
    return root


def _one_line_import_error(stderr: str) -> str:
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: jax_sparse_mla: "), stderr
    return last


def test_source_tree_without_an_installed_build_says_what_to_do(tmp_path):
    root = _source_copy(tmp_path)
    # As on a machine where the package was never installed: no distribution metadata is found.
    hide_install = ("import importlib.metadata as m\n"
                    "def missing(name): raise m.PackageNotFoundError(name)\n"
                    "m.distribution = missing\n"
                    "import jax_sparse_mla\n")
    result = _run_python(hide_install, cwd=root)
    assert result.returncode != 0
    message = _one_line_import_error(result.stderr)
    assert f"run `pip install .` in {root}" in message


def _regular_install() -> bool:
    """The extension lies in the installed distribution's package directory (not an editable install's
    build tree or an in-place build)."""
    try:
        dist = importlib.metadata.distribution("jax_sparse_mla")
    except importlib.metadata.PackageNotFoundError:
        return False
    installed = pathlib.Path(dist.locate_file("jax_sparse_mla")).resolve()
    return pathlib.Path(jsm._ffi._cpu_ext.__file__).resolve().parent == installed


@pytest.mark.skipif(not _regular_install(), reason="needs jax_sparse_mla installed with pip install .")
def test_source_tree_of_another_version_says_what_to_do(tmp_path):
    root = _source_copy(tmp_path, version="99.0.0")
    result = _run_python("import jax_sparse_mla", cwd=root)
    assert result.returncode != 0
    message = _one_line_import_error(result.stderr)
    assert "version 99.0.0" in message and f"version {jsm.__version__}" in message
    assert f"run `pip install .` in {root}" in message


def test_ci_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(CI_SCRIPT)], capture_output=True).returncode == 0
