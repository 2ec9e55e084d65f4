"""benchmarks/ab_tree.sh, the A/B trees of the GPU sessions: a revision's files under .ab/<name> with the
defaults of compile-time knobs (`#define NAME value` lines under kernels/, each defined once) replaced,
and a clear failure for a knob that is not defined exactly once."""

import collections
import os
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "ab_tree.sh"
DEFINE = re.compile(r"^#define (JSMLA_[A-Z0-9_]+) (\d+)\s*$", re.M)


def _knobs():
    """{name: (file, default)} of the numeric `#define`s defined exactly once under kernels/."""
    seen = collections.defaultdict(list)
    for path in sorted(ROOT.glob("kernels/**/*")):
        if path.suffix in (".h", ".cuh", ".cu", ".cc"):
            for name, value in DEFINE.findall(path.read_text()):
                seen[name].append((path, value))
    return {name: places[0] for name, places in seen.items() if len(places) == 1}


def _git_available():
    return shutil.which("git") is not None and subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not _git_available() or shutil.which("bash") is None,
                                reason="needs git, bash and a git checkout")


@pytest.fixture
def tree_name():
    name = "pytest_ab_tree"
    yield name
    shutil.rmtree(ROOT / ".ab" / name, ignore_errors=True)


def test_a_knob_is_set_in_the_tree_and_nothing_else_changes(tree_name):
    knobs = _knobs()
    if not knobs:
        pytest.skip("no compile-time knob under kernels/ at this revision")
    name, (path, default) = sorted(knobs.items())[0]
    value = str(int(default) + 16)
    proc = subprocess.run(["bash", str(SCRIPT), tree_name, "HEAD", f"{name}={value}"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    relative = path.relative_to(ROOT)
    changed = (ROOT / ".ab" / tree_name / relative).read_text()
    committed = subprocess.run(["git", "-C", str(ROOT), "show", f"HEAD:{relative.as_posix()}"],
                               capture_output=True, text=True, check=True).stdout
    assert f"#define {name} {value}\n" in changed
    assert changed == committed.replace(f"#define {name} {default}", f"#define {name} {value}")
    assert f"{name} = {value}" in proc.stdout


def test_an_unknown_knob_fails_with_its_name(tree_name):
    proc = subprocess.run(["bash", str(SCRIPT), tree_name, "HEAD", "JSMLA_NO_SUCH_KNOB=1"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    assert "JSMLA_NO_SUCH_KNOB is not defined exactly once" in proc.stderr


def test_check_from_overlays_the_standalone_check(tree_name):
    check = "kernels/cuda/tests/portable_check.cu"
    revisions = subprocess.run(["git", "-C", str(ROOT), "log", "-n", "2", "--format=%H", "--", check],
                               capture_output=True, text=True, check=True).stdout.split()
    if len(revisions) < 2:
        pytest.skip("the checkout holds one revision of the standalone check")
    older = revisions[1]
    proc = subprocess.run(["bash", str(SCRIPT), tree_name, older], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "AB_CHECK_FROM": "HEAD"})
    assert proc.returncode == 0, proc.stderr
    head = subprocess.run(["git", "-C", str(ROOT), "show", f"HEAD:{check}"], capture_output=True, text=True,
                          check=True).stdout
    old_kernel = subprocess.run(["git", "-C", str(ROOT), "show", f"{older}:kernels/cuda/candidate_tiles.cuh"],
                                capture_output=True, text=True)
    tree = ROOT / ".ab" / tree_name
    assert (tree / check).read_text() == head
    if old_kernel.returncode == 0:  # the rest is the older revision's
        assert (tree / "kernels/cuda/candidate_tiles.cuh").read_text() == old_kernel.stdout
    assert f"{check} from HEAD" in proc.stdout
