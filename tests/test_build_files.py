"""BUILD (Bazel) and cmake/sources.cmake must list the same sources, and every listed file exists."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LISTS = ("JSMLA_CPU_SOURCES", "JSMLA_CPU_MODULE_SOURCES", "JSMLA_CUDA_SOURCES", "JSMLA_CUDA_MODULE_SOURCES")


def cmake_lists():
    text = re.sub(r"#[^\n]*", "", (ROOT / "cmake" / "sources.cmake").read_text())
    return {name: body.split() for name, body in re.findall(r"set\((\w+)\s+([^)]*)\)", text)}


def bazel_lists():
    text = re.sub(r"#[^\n]*", "", (ROOT / "BUILD").read_text())
    return {name: re.findall(r'"([^"]+)"', body) for name, body in re.findall(r"^(\w+) = \[(.*?)\]", text, re.S | re.M)}


@pytest.mark.parametrize("name", LISTS)
def test_bazel_and_cmake_list_the_same_sources(name):
    cmake, bazel = cmake_lists(), bazel_lists()
    assert name in cmake, f"{name} missing from cmake/sources.cmake"
    assert name in bazel, f"{name} missing from BUILD"
    assert bazel[name] == cmake[name]


@pytest.mark.parametrize("name", LISTS)
def test_listed_sources_exist(name):
    for path in cmake_lists()[name]:
        assert (ROOT / path).is_file(), path


def test_every_source_file_is_listed():
    listed = {p for name in LISTS for p in cmake_lists()[name]}
    on_disk = {str(p.relative_to(ROOT)) for p in ROOT.glob("ffi/*.c*")} | {
        str(p.relative_to(ROOT)) for p in ROOT.glob("kernels/**/*.c*") if "tests" not in p.parts}
    on_disk = {p for p in on_disk if p.endswith((".cc", ".cu"))}
    assert on_disk <= listed, f"not built by CMake/Bazel: {sorted(on_disk - listed)}"
