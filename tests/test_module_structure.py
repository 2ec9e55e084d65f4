"""Imports inside the package flow one way: no module reaches, directly or through others, a module
that imports it (deferred imports inside functions included)."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jax_sparse_mla"


def package_imports():
    """module name -> the package modules it imports anywhere in its source."""
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    graph = {}
    for path in PACKAGE.glob("*.py"):
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    targets.add(node.module.split(".")[0])
                else:
                    targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module == "jax_sparse_mla":
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jax_sparse_mla."):
                targets.add(node.module.split(".")[1])
        graph[path.stem] = {t for t in targets if t in modules and t != path.stem}
    return graph


def test_package_imports_have_no_cycle():
    graph = package_imports()
    state = {}

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph[module]):
            assert state.get(target) != "open", "import cycle: " + " -> ".join(path + [target])
            if target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_planner_sits_below_calibration_and_timing():
    graph = package_imports()
    assert "calibration" not in graph["planner"] and "timing" not in graph["planner"]
    assert {"planner", "timing", "calibration_store"} <= graph["calibration"]
    assert "calibration_store" in graph["planner"]
