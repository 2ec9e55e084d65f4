"""Errors about the CUDA kernels say what is actually missing on this machine: a GPU (no build helps),
the CUDA extension (not built: rebuild with JSMLA_CUDA=ON) or a loadable one (built, failing to load)."""

from __future__ import annotations

import importlib.machinery
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla import _ffi

ROOT = pathlib.Path(__file__).resolve().parents[1]
T, H = 2, 4


def _call(impl):
    q = jax.ShapeDtypeStruct((T, H, 576), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((2, 64, 656), jnp.uint8)
    indices = jax.ShapeDtypeStruct((T, 8), jnp.int32)
    return jax.eval_shape(lambda q, c, i: jsm.sparse_mla(q, c, i, kv_format="dsv3_2", sm_scale=0.1, impl=impl),
                          q, cache, indices)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the message without a GPU")
@pytest.mark.parametrize("impl", ["decode", "prefill"])
def test_no_gpu_is_not_reported_as_a_missing_build(impl):
    with pytest.raises(ValueError) as info:
        _call(impl)
    message = str(info.value)
    assert message.startswith(f"impl: {impl!r} selects a CUDA kernel, but JAX's default backend is 'cpu'")
    assert "JSMLA_CUDA" not in message and "rebuild" not in message


@pytest.fixture
def gpu_without_cuda_kernels(monkeypatch):
    """A GPU backend, with the CUDA extension state set by the test."""
    monkeypatch.setattr(jsm.api.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(_ffi, "_cuda_ext", None)

    def state(built: bool, error: str):
        monkeypatch.setattr(_ffi, "_CUDA_BUILT", built)
        monkeypatch.setattr(_ffi, "_CUDA_IMPORT_ERROR", ImportError(error))

    return state


@pytest.mark.parametrize("impl", ["auto", "decode"])
def test_a_gpu_without_the_extension_is_told_to_rebuild(gpu_without_cuda_kernels, impl):
    gpu_without_cuda_kernels(False, "this installation of jax_sparse_mla was built without its CUDA extension "
                                    "(reinstall with JSMLA_CUDA=ON where nvcc is available)")
    with pytest.raises(ValueError, match=f"^impl: .*{impl}.*JSMLA_CUDA=ON"):
        _call(impl)


@pytest.mark.parametrize("impl", ["auto", "decode"])
def test_an_extension_that_fails_to_load_is_not_told_to_rebuild(gpu_without_cuda_kernels, impl):
    gpu_without_cuda_kernels(True, "libcuda.so.1: cannot open shared object file")
    with pytest.raises(ValueError) as info:
        _call(impl)
    message = str(info.value)
    assert "installed but failed to load (libcuda.so.1: cannot open shared object file)" in message
    assert "JSMLA_CUDA" not in message


def test_the_loader_tells_not_built_from_failing_to_load(tmp_path):
    """A package directory holding the CPU extension and a CUDA extension that cannot load."""
    package = tmp_path / "jax_sparse_mla"
    shutil.copytree(ROOT / "jax_sparse_mla", package, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy(_ffi._cpu_ext.__file__, package)
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    check = ("import jax_sparse_mla as jsm; from jax_sparse_mla import _ffi; "
             "print(_ffi.cuda_built(), jsm.cuda_available()); print(_ffi.cuda_import_error())")

    def run():
        result = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr
        return result.stdout.splitlines()

    built, error = run()
    assert built == "False False" and "built without its CUDA extension" in error
    (package / f"_cuda_ext{suffix}").write_bytes(b"not a shared object")
    built, error = run()
    assert built == "True False" and "JSMLA_CUDA" not in error
