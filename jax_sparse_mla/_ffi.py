"""Loading the extensions, registering the FFI targets, and the ``ffi_call`` plumbing.

The CPU extension is always built. The CUDA extension is optional: when it is missing,
:func:`cuda_import_error` says why (not built, or built but unable to load), and ``sparse_mla``
raises a clear error on a CUDA backend.

The extensions are found beside this file (an installed package, an editable install's import hook,
an in-place build) or, when the package is imported from its source tree, in the installed
distribution of the same version: Python puts the working directory first on ``sys.path``, so
``python -m jax_sparse_mla`` run from the clone's root imports the sources, which hold no compiled
files, while ``pip install .`` put them in site-packages.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import pathlib
import sys
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import __version__
from .formats import CacheLayout

_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent


def _source_tree_hint() -> str:
    root = _PACKAGE_DIR.parent
    if (root / "pyproject.toml").is_file():
        return (f"{_PACKAGE_DIR} is the source tree; run `pip install .` in {root} (or import "
                f"{__package__} from another directory)")
    return f"reinstall {__package__} (pip install --force-reinstall {__package__})"


def _installed_extension(name: str) -> Optional[pathlib.Path]:
    """The compiled module ``name`` in the installed distribution, when this package is another copy of it
    (its source tree); None when there is no such file."""
    try:
        dist = importlib.metadata.distribution(__package__)
    except importlib.metadata.PackageNotFoundError:
        return None
    installed = pathlib.Path(dist.locate_file(__package__)).resolve()
    if installed == _PACKAGE_DIR:
        return None  # this is the installed package, and it was built without that module
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = installed / f"{name}{suffix}"
        if path.is_file():
            # The compiled tables must describe the kernels these sources plan for.
            if dist.version != __version__:
                raise ImportError(f"{__package__}: the sources in {_PACKAGE_DIR} are version {__version__} but the "
                                  f"installed build in {installed} is version {dist.version}; "
                                  + _source_tree_hint())
            return path
    return None


# Sources without compiled files beside them (see the module docstring) take every extension from the
# installed distribution; otherwise none comes from there, so one build never mixes with another.
_FROM_INSTALLED = importlib.util.find_spec(f"{__package__}._cpu_ext") is None


def _import_extension(name: str):
    """The compiled module ``name`` (see the module docstring), or None when it was not built."""
    full_name = f"{__package__}.{name}"
    if not _FROM_INSTALLED:
        return importlib.import_module(full_name) if importlib.util.find_spec(full_name) is not None else None
    path = _installed_extension(name)
    if path is None:
        return None
    spec = importlib.util.spec_from_file_location(full_name, path)
    module = importlib.util.module_from_spec(spec)
    # Registered like any submodule, so `from . import _cpu_ext` elsewhere in the package finds it.
    sys.modules[full_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[full_name]
        raise
    setattr(sys.modules[__package__], name, module)
    return module


_cpu_ext = _import_extension("_cpu_ext")
if _cpu_ext is None:
    raise ImportError(f"{__package__}: its compiled CPU extension (_cpu_ext) is not installed: " + _source_tree_hint())

#: The versioned FFI targets (``ffi/target_name.h``; a changed attribute contract gets a new name): the
#: forward, and the backward (the CUDA handler of which takes one more result, its workspace).
TARGET = _cpu_ext.FORWARD_TARGET
BACKWARD_TARGET = _cpu_ext.BACKWARD_TARGET

for _name, _capsule in _cpu_ext.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")

#: Why the CUDA kernels cannot run, when they cannot: not built, or built but failing to load.
_CUDA_IMPORT_ERROR: Optional[ImportError] = None
_CUDA_BUILT = True
try:
    _cuda_ext = _import_extension("_cuda_ext")
except ImportError as _error:  # the extension exists but cannot load (e.g. a missing CUDA library)
    _cuda_ext = None
    _CUDA_IMPORT_ERROR = _error
else:
    if _cuda_ext is None:
        _CUDA_BUILT = False
        _CUDA_IMPORT_ERROR = ImportError(
            f"this installation of {__package__} was built without its CUDA extension (reinstall with "
            f"JSMLA_CUDA=ON where nvcc is available, or install a wheel built with the CUDA kernels)")
if _cuda_ext is not None:
    for _name, _capsule in _cuda_ext.registrations().items():
        jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")


def cuda_available() -> bool:
    """True when the CUDA extension is built and its handlers are registered."""
    return _cuda_ext is not None


def cuda_built() -> bool:
    """True when the installation carries the CUDA extension, whether or not it loaded."""
    return _CUDA_BUILT


def cuda_import_error() -> Optional[ImportError]:
    """Why the CUDA extension is unavailable (None when it is available)."""
    return _CUDA_IMPORT_ERROR


def cpu_format_table() -> list:
    """The C++ format table (``kernels/common/formats.h``) as a list of dicts."""
    return _cpu_ext.format_table()


def hopper_compiled() -> bool:
    """Whether the CUDA build carries the Hopper family's sm_90a code; without the CUDA extension
    (planning for export from a host without a GPU), the default architectures' answer: True."""
    return True if _cuda_ext is None else bool(_cuda_ext.hopper_compiled())


def cuda_handler_invocations() -> int:
    """How many times the CUDA handler ran on the host (command-buffer replays do not run it)."""
    if _cuda_ext is None:
        raise RuntimeError(f"the CUDA extension is not available: {_CUDA_IMPORT_ERROR}")
    return _cuda_ext.handler_invocations()


def _geometry(prefix: str, layout: Optional[CacheLayout]) -> dict:
    if layout is None:
        return {f"{prefix}page_size": np.int64(1), f"{prefix}num_pages": np.int64(0),
                f"{prefix}page_stride": np.int64(0), f"{prefix}row_stride": np.int64(0)}
    return {f"{prefix}page_size": np.int64(layout.page_size), f"{prefix}num_pages": np.int64(layout.num_pages),
            f"{prefix}page_stride": np.int64(layout.page_stride), f"{prefix}row_stride": np.int64(layout.row_stride)}


def _operands(problem, q, kv_cache, indices, topk_length, attn_sink, extra_kv_cache, extra_indices,
              extra_topk_length, valid_tokens):
    """The attention's operands as both targets take them: absent optional operands as empty arrays (an
    absent ``valid_tokens``: every row is valid, and the kernels read no count)."""
    empty_i32 = jnp.zeros((0,), jnp.int32)
    if extra_kv_cache is None:
        extra_kv_cache = jnp.zeros((0,), jnp.uint8)
        extra_indices = jnp.zeros((problem.num_tokens, 0), jnp.int32)
    return (
        q,
        kv_cache,
        indices,
        empty_i32 if topk_length is None else topk_length,
        jnp.zeros((0,), jnp.float32) if attn_sink is None else attn_sink,
        extra_kv_cache,
        extra_indices,
        empty_i32 if extra_topk_length is None else extra_topk_length,
        empty_i32 if valid_tokens is None else jnp.reshape(valid_tokens, (1,)),
    )


def _format_attrs(problem) -> dict:
    """The format and geometry attributes both targets take."""
    extra_fmt = problem.extra_fmt if problem.extra_fmt is not None else problem.fmt
    attrs = {"kv_format": np.int32(problem.fmt.id), "extra_kv_format": np.int32(extra_fmt.id),
             "sm_scale": np.float32(problem.sm_scale)}
    attrs.update(_geometry("", problem.layout))
    attrs.update(_geometry("extra_", problem.extra_layout))
    return attrs


def call(plan, problem, q, kv_cache, indices, topk_length, attn_sink, extra_kv_cache, extra_indices,
         extra_topk_length, valid_tokens):
    """Emits the custom call for one plan. Absent optional operands are passed as empty arrays.

    Args are flattened rows: q ``[T, H, d_qk]``, indices ``[T, topk]``, lengths ``[T]`` or None,
    attn_sink ``[H]`` or None, extra arrays or None, valid_tokens an int32 scalar or None.
    Returns ``(out, lse)``; the workspace output is dropped.
    """
    t, h = problem.num_tokens, problem.num_heads
    results = (
        jax.ShapeDtypeStruct((t, h, problem.fmt.d_v), jnp.bfloat16),
        jax.ShapeDtypeStruct((t, h), jnp.float32),
        jax.ShapeDtypeStruct(plan.workspace_shape, jnp.uint8),
    )
    attrs = _format_attrs(problem)
    attrs.update({k: np.int32(v) for k, v in plan.attrs().items()})
    operands = _operands(problem, q, kv_cache, indices, topk_length, attn_sink, extra_kv_cache, extra_indices,
                         extra_topk_length, valid_tokens)
    out, lse, _ = jax.ffi.ffi_call(TARGET, results)(*operands, **attrs)
    return out, lse


def backward_results(problem, kv_cache_shape, wrt, groups: int) -> dict:
    """``{name: ShapeDtypeStruct}`` of the backward's results, in its result order: ``q``'s gradient,
    bfloat16 ``[T, H, d_qk]``; the cache's, bfloat16 ``[groups, *kv_cache_shape]``; the sink's, float32
    ``[groups, H]`` (one gradient of each shared operand per ``T / groups`` consecutive rows). A result
    whose name is not in ``wrt`` is empty (``[0]``): it is not computed."""
    t, h = problem.num_tokens, problem.num_heads
    shapes = {"q": ((t, h, problem.fmt.d_qk), jnp.bfloat16),
              "kv_cache": ((groups, *kv_cache_shape), jnp.bfloat16),
              "attn_sink": ((groups, h), jnp.float32)}
    return {name: jax.ShapeDtypeStruct(shape if name in wrt else (0,), dtype)
            for name, (shape, dtype) in shapes.items()}


def call_backward(problem, arrays, out, lse, d_out, d_lse, *, wrt, groups: int, chunk_tokens: int,
                  workspace_bytes: int = 0):
    """Emits the backward custom call: the vector-Jacobian product of :func:`call`'s attention.

    Args:
      problem: the flattened call's ``Problem``.
      arrays: the op's operands by name (flattened rows, absent optional operands left out), as for the
        forward.
      out: the forward's bfloat16 ``[T, H, d_v]`` (the CUDA tensor-core backward takes each row's
        ``D = <d_out, out>`` from it; the CPU kernel recomputes D).
      lse: the forward's float32 ``[T, H]``.
      d_out: the cotangent of ``out``, bfloat16 ``[T, H, d_v]``, or None for zero.
      d_lse: the cotangent of ``lse``, float32 ``[T, H]``, or None for zero.
      wrt: the gradients to compute, among ``"q"``, ``"kv_cache"`` (a ``bf16_*`` cache) and ``"attn_sink"``.
      groups: the number of gradients of each shared operand (the cache, the sink): one per ``T / groups``
        consecutive rows (a ``jax.vmap`` batch element each, when the batch is folded into rows).
      chunk_tokens: tokens per chunk of the CUDA cache gradient (``kernel_tables.backward_chunk_tokens``).
      workspace_bytes: the CUDA handler's workspace result (``kernel_tables.backward_workspace_bytes``),
        dropped from the results; 0 for the CPU handler, which takes none.

    Returns:
      ``{name: gradient}`` for the names in ``wrt`` (shapes and dtypes of :func:`backward_results`).
    """
    get = arrays.get
    operands = _operands(problem, get("q"), get("kv_cache"), get("indices"), get("topk_length"), get("attn_sink"),
                         get("extra_kv_cache"), get("extra_indices"), get("extra_topk_length"), get("valid_tokens"))
    cotangents = (jnp.zeros((0,), jnp.bfloat16) if d_out is None else d_out,
                  jnp.zeros((0,), jnp.float32) if d_lse is None else d_lse)
    results = backward_results(problem, arrays["kv_cache"].shape, wrt, groups)
    shapes = tuple(results.values())
    if workspace_bytes:
        shapes += (jax.ShapeDtypeStruct((workspace_bytes,), jnp.uint8),)
    gradients = jax.ffi.ffi_call(BACKWARD_TARGET, shapes)(
        *operands, lse, out, *cotangents, **_format_attrs(problem), gradient_groups=np.int64(groups),
        chunk_tokens=np.int64(chunk_tokens))
    return {name: g for name, g in zip(results, gradients) if name in wrt}
