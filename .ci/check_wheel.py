"""Checks a wheel built with the CUDA kernels (README, "A wheel with the CUDA kernels"): both extensions
and every module of the package, the license and version in its metadata, SASS for each CUDA
architecture (and the PTX) in every translation unit of the CUDA extension, and no shared library
dependency beyond the C/C++ runtime (the CUDA runtime is static; the driver is loaded at run time).

Usage: python .ci/check_wheel.py WHEEL [--manylinux]    (--manylinux: the tag auditwheel repair gave)

The CUDA extension's device code is a fatbin in its .nv_fatbin section: a header (magic 0xBA55ED50)
then one entry per code object, each with its kind (1 = PTX, 2 = ELF/SASS), SM number and flags; flag
0x100000 marks architecture-specific code ("sm_90a"). Where nvcc is on PATH the decoding is checked
first on kernels compiled for sm_90 and sm_90a, so a changed fatbin layout fails here, not silently.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "jax_sparse_mla"
#: The architectures of JSMLA_CUDA_ARCHS (CMakeLists.txt): SASS for each, PTX for the oldest.
EXPECTED_SASS = {"sm_80", "sm_90a", "sm_120a"}
EXPECTED_PTX = {"compute_80"}
#: Libraries every Linux system provides (the manylinux policies' base set); anything else would have
#: to be grafted into the wheel or come from elsewhere.
SYSTEM_LIBRARIES = re.compile(r"^(libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|ld-linux-x86-64)\.so")

FATBIN_MAGIC = 0xBA55ED50
ARCH_SPECIFIC_FLAG = 0x100000
_FATBIN_HEADER = struct.Struct("<IHHQ")  # magic, version, header size, size of the entries
_ENTRY_HEADER = struct.Struct("<HHIQIIHHIIIQ")  # kind, -, header size, payload size, -, -, minor, major, arch,
#                                                 name offset, name length, flags


def elf_sections(data: bytes) -> dict:
    """Section name -> (offset, size) of a little-endian ELF64 file."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError("not an ELF64 file")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_offset = headers[shstrndx][4]

    def name(offset):
        start = names_offset + offset
        return data[start:data.index(b"\0", start)].decode()

    return {name(h[0]): (h[4], h[5]) for h in headers}


def needed_libraries(data: bytes) -> list:
    """The DT_NEEDED entries of an ELF64 shared object."""
    sections = elf_sections(data)
    dyn_offset, dyn_size = sections[".dynamic"]
    str_offset, _ = sections[".dynstr"]
    needed = []
    for i in range(dyn_size // 16):
        tag, value = struct.unpack_from("<qQ", data, dyn_offset + 16 * i)
        if tag == 0:
            break
        if tag == 1:  # DT_NEEDED
            start = str_offset + value
            needed.append(data[start:data.index(b"\0", start)].decode())
    return needed


def fatbin_code_objects(blob: bytes) -> list:
    """(kind, architecture name, object name) of every code object of the fatbins in ``blob``."""
    objects = []
    position = 0
    while position + _FATBIN_HEADER.size <= len(blob):
        magic, _, header_size, size = _FATBIN_HEADER.unpack_from(blob, position)
        if magic != FATBIN_MAGIC:
            position += 8  # fatbins are 8-byte aligned within the section
            continue
        entry, end = position + header_size, position + header_size + size
        while entry < end:
            (kind, _, entry_header, payload, _, _, _, _, arch, name_offset, name_length,
             flags) = _ENTRY_HEADER.unpack_from(blob, entry)
            suffix = "a" if flags & ARCH_SPECIFIC_FLAG else ""
            label = {1: f"compute_{arch}{suffix}", 2: f"sm_{arch}{suffix}"}.get(kind, f"kind{kind}_{arch}")
            name = blob[entry + name_offset:entry + name_offset + name_length].rstrip(b"\0").decode(errors="replace")
            objects.append((kind, label, name))
            entry += entry_header + payload
        position = end
    return objects


def check_decoder_with_nvcc() -> None:
    """The decoding above, on kernels nvcc compiles for sm_90 and sm_90a."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("nvcc not found: the fatbin decoding is not cross-checked")
        return
    with tempfile.TemporaryDirectory() as tmp:
        source = pathlib.Path(tmp) / "k.cu"
        source.write_text("__global__ void k(float* x) { x[0] = 1.0f; }\n")
        for arch in ("90", "90a"):
            out = pathlib.Path(tmp) / f"{arch}.fatbin"
            subprocess.run([nvcc, "-fatbin", f"-gencode=arch=compute_{arch},code=sm_{arch}", str(source), "-o",
                            str(out)], check=True)
            labels = {label for _, label, _ in fatbin_code_objects(out.read_bytes())}
            assert labels == {f"sm_{arch}"}, f"fatbin decoding: nvcc's sm_{arch} kernel reads as {labels}"
    print("fatbin decoding cross-checked with nvcc (sm_90, sm_90a)")


def check(wheel: pathlib.Path, manylinux: bool) -> None:
    problems = []
    names = zipfile.ZipFile(wheel).namelist()
    tag = wheel.name[:-len(".whl")].split("-")[-1]
    if manylinux and not tag.startswith("manylinux"):
        problems.append(f"platform tag {tag}: expected a manylinux tag")
    sources = {f"{PACKAGE}/{p.name}" for p in (ROOT / PACKAGE).glob("*.py")}
    missing = sorted(sources - set(names))
    if missing:
        problems.append(f"package modules missing: {missing}")
    extensions = {}
    for module in ("_cpu_ext", "_cuda_ext"):
        found = [n for n in names if re.fullmatch(rf"{PACKAGE}/{module}\..*\.so", n)]
        if len(found) != 1:
            problems.append(f"{module}: expected one shared object in {PACKAGE}/, found {found}")
        else:
            extensions[module] = zipfile.ZipFile(wheel).read(found[0])
    grafted = [n for n in names if n.startswith(f"{PACKAGE}.libs/")]
    if grafted:
        problems.append(f"libraries grafted into the wheel: {grafted}")

    dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
    licenses = [n for n in names if n.startswith(f"{dist_info}/") and n.rsplit("/", 1)[-1] == "LICENSE"]
    if not licenses or zipfile.ZipFile(wheel).read(licenses[0]) != (ROOT / "LICENSE").read_bytes():
        problems.append(f"the repository's LICENSE is not in {dist_info}: {licenses}")
    metadata = zipfile.ZipFile(wheel).read(f"{dist_info}/METADATA").decode()
    version = re.search(r'^__version__ = "([^"]+)"', (ROOT / PACKAGE / "__init__.py").read_text(), re.M).group(1)
    if f"\nVersion: {version}\n" not in metadata:
        problems.append(f"METADATA does not carry version {version}")
    for field in ("License: Apache-2.0", "Classifier: License :: OSI Approved :: Apache Software License",
                  "Requires-Dist: jax"):
        if field not in metadata:
            problems.append(f"METADATA lacks {field!r}")

    for module, data in extensions.items():
        foreign = [lib for lib in needed_libraries(data) if not SYSTEM_LIBRARIES.match(lib)]
        if foreign:
            problems.append(f"{module} links {foreign} (only the C/C++ runtime is expected)")
    if "_cuda_ext" in extensions:
        data = extensions["_cuda_ext"]
        offset, size = elf_sections(data)[".nv_fatbin"]
        objects = fatbin_code_objects(data[offset:offset + size])
        by_unit = {}
        for kind, label, name in objects:
            by_unit.setdefault(name, set()).add(label)
        expected = EXPECTED_SASS | EXPECTED_PTX
        wrong = {unit: sorted(labels) for unit, labels in by_unit.items() if labels != expected}
        if not by_unit or wrong:
            problems.append(f"CUDA code objects: expected {sorted(expected)} in every translation unit, got {wrong}")
        print(f"{wheel.name}: {len(by_unit)} CUDA translation units, each with {sorted(expected)}; "
              f"_cuda_ext {len(data) / 2 ** 20:.1f} MiB")
    if problems:
        sys.exit(f"{wheel.name}:\n  " + "\n  ".join(problems))
    print(f"{wheel.name}: contents check passed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=pathlib.Path)
    parser.add_argument("--manylinux", action="store_true", help="require a manylinux platform tag")
    args = parser.parse_args()
    check_decoder_with_nvcc()
    check(args.wheel, args.manylinux)


if __name__ == "__main__":
    main()
