"""Trace-time validation of ``sparse_mla`` arguments (docs/errors.md) and the supported-config envelope.

Everything checkable from shapes and dtypes is checked here, before anything is lowered. Wrong dtypes
raise ``TypeError``; every other violation raises ``ValueError``. Messages name the argument, what was
expected and what was given.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Union

import jax.numpy as jnp
import numpy as np

from . import kernel_tables
from .formats import FORMATS, CacheLayout, KVFormat, cache_layout, get_format

__all__ = ["ENVELOPE", "IMPLS", "PRECISIONS", "Problem", "normalize", "supported_configs", "check_supported"]

#: Values of ``impl=``.
IMPLS = ("auto", "decode", "prefill", "xla")
#: The (main, extra) format pairs of a dual cache: each dual-cache format with itself, and the FP4 caches
#: as the extra cache of the FP8 format of the same layout (docs/formats.md).
DUAL_CACHE_PAIRS = tuple(sorted({(k, k) for k, f in FORMATS.items() if f.dual_cache}
                                | {("dsv4", "dsv4_nvfp4"), ("dsv4_1", "dsv4_1_fp4")}))


def extra_formats(kv_format: str) -> tuple:
    """The formats an extra cache of a ``kv_format`` main cache may have (empty without a dual form)."""
    return tuple(extra for main, extra in DUAL_CACHE_PAIRS if main == kv_format)


#: Values of ``precision=``: 16-bit compute, or the query quantized to FP8 (docs/semantics.md).
PRECISIONS = ("bf16", "fp8")

#: The one envelope table used by validation, planning and ``supported_configs()``.
ENVELOPE = {
    "min_heads": kernel_tables.MIN_HEADS,
    "max_heads": kernel_tables.MAX_HEADS,
    "min_topk": kernel_tables.MIN_TOPK,
    "platforms": {
        "cpu": {"variants": ("reference",), "archs": ()},
        "cuda": {"variants": ("decode", "prefill"), "archs": ("sm_80", "sm_90a", "sm_120a")},
    },
}


@dataclasses.dataclass(frozen=True)
class Problem:
    """Static description of one call after normalisation (shapes are of the flattened rows)."""

    fmt: KVFormat
    lead_shape: tuple  # (T,) or (B, S): leading axes of q
    num_tokens: int  # flattened rows
    num_heads: int
    topk: int
    extra_topk: int  # 0 without an extra cache
    layout: CacheLayout
    extra_layout: Optional[CacheLayout]
    sm_scale: float
    impl: str
    precision: str = "bf16"
    extra_fmt: Optional[KVFormat] = None  # the extra cache's format (None without an extra cache)
    batch_invariant: bool = False


def _describe(x) -> str:
    if x is None:
        return "None"
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        return f"{type(x).__name__} {x!r}"
    return f"{np.dtype(x.dtype).name} [{', '.join(str(d) for d in x.shape)}]"


def _lead_text(lead) -> str:
    return ", ".join(f"{n}={v}" for n, v in zip(("B", "S") if len(lead) == 2 else ("T",), lead))


def _check_dtype(name, x, dtype, expected_text):
    if np.dtype(x.dtype) != np.dtype(dtype):
        raise TypeError(f"{name}: expected {expected_text}, got {_describe(x)}")


def _row_array(name, x, lead, allow_unit_axis):
    """Checks an index-like array [*lead, k] (or [T, 1, k]); returns k."""
    lead = tuple(lead)
    forms = f"int32 [{', '.join(('B', 'S') if len(lead) == 2 else ('T',))}, topk]"
    if allow_unit_axis and len(lead) == 1:
        forms += " or [T, 1, topk]"
    expected = f"{forms} with {_lead_text(lead)}"
    _check_dtype(name, x, jnp.int32, expected)
    shape = tuple(x.shape)
    if shape[:-1] == lead and len(shape) == len(lead) + 1:
        return shape[-1]
    if allow_unit_axis and len(lead) == 1 and len(shape) == 3 and shape[0] == lead[0] and shape[1] == 1:
        return shape[-1]
    raise ValueError(f"{name}: expected {expected}, got {_describe(x)}")


def _check_lengths(name, x, lead):
    expected = f"int32 [{', '.join(('B', 'S') if len(lead) == 2 else ('T',))}] with {_lead_text(lead)}"
    _check_dtype(name, x, jnp.int32, expected)
    if tuple(x.shape) != tuple(lead):
        raise ValueError(f"{name}: expected {expected}, got {_describe(x)}")


def normalize(q, kv_cache, indices, *, kv_format, sm_scale, page_size=None, topk_length=None, attn_sink=None,
              extra_kv_cache=None, extra_indices=None, extra_topk_length=None, extra_page_size=None,
              valid_tokens=None, impl="auto", batch_invariant=False, precision="bf16",
              extra_kv_format=None) -> Problem:
    """Validates every argument of :func:`jax_sparse_mla.sparse_mla` and returns the static :class:`Problem`."""
    fmt = get_format(kv_format)
    if not isinstance(impl, str):
        raise TypeError(f"impl: expected one of {IMPLS}, got {type(impl).__name__}")
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    if not isinstance(precision, str):
        raise TypeError(f"precision: expected one of {PRECISIONS}, got {type(precision).__name__}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"sm_scale: expected a Python float (static), got {_describe(sm_scale)}")
    sm_scale = float(sm_scale)
    if not isinstance(batch_invariant, (bool, np.bool_)):
        raise TypeError(f"batch_invariant: expected a bool, got {_describe(batch_invariant)}")
    if batch_invariant and impl == "xla":
        raise ValueError("batch_invariant: True is served by the FFI kernels (impl='auto' or 'decode'); "
                         "impl='xla' leaves the reduction order to XLA, got impl='xla'")
    if not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale: expected a finite float, got {sm_scale}")

    for name, x in (("q", q), ("kv_cache", kv_cache), ("indices", indices)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name}: expected an array, got {_describe(x)}")
    q_expected = f"bfloat16 [T, H, {fmt.d_qk}] or [B, S, H, {fmt.d_qk}] with 1 <= H <= {ENVELOPE['max_heads']} (format {fmt.key})"
    _check_dtype("q", q, jnp.bfloat16, q_expected)
    if q.ndim not in (3, 4) or q.shape[-1] != fmt.d_qk:
        raise ValueError(f"q: expected {q_expected}, got {_describe(q)}")
    num_heads = int(q.shape[-2])
    if not ENVELOPE["min_heads"] <= num_heads <= ENVELOPE["max_heads"]:
        raise ValueError(f"q: expected {q_expected}, got H={num_heads} in {_describe(q)}")
    lead = tuple(int(d) for d in q.shape[:-2])
    num_tokens = int(np.prod(lead))

    topk = _row_array("indices", indices, lead, allow_unit_axis=True)
    if topk < ENVELOPE["min_topk"]:
        raise ValueError(f"indices: expected topk >= {ENVELOPE['min_topk']}, got {_describe(indices)}")
    if topk_length is not None:
        _check_lengths("topk_length", topk_length, lead)
    if attn_sink is not None:
        _check_dtype("attn_sink", attn_sink, jnp.float32, f"float32 [{num_heads}]")
        if tuple(attn_sink.shape) != (num_heads,):
            raise ValueError(f"attn_sink: expected float32 [{num_heads}] (one per head), got {_describe(attn_sink)}")
    if valid_tokens is not None:
        _check_dtype("valid_tokens", valid_tokens, jnp.int32, "int32 scalar or [1]")
        if tuple(valid_tokens.shape) not in ((), (1,)):
            raise ValueError(f"valid_tokens: expected int32 scalar or [1], got {_describe(valid_tokens)}")

    layout = cache_layout(kv_cache, fmt, page_size, name="kv_cache")

    extra_layout = None
    extra_topk = 0
    if (extra_kv_cache is None) != (extra_indices is None):
        given = "extra_kv_cache" if extra_kv_cache is not None else "extra_indices"
        raise ValueError(f"extra_kv_cache/extra_indices: expected both or neither, got only {given}")
    extra_fmt = None
    if extra_kv_cache is None:
        for name, value in (("extra_topk_length", extra_topk_length), ("extra_page_size", extra_page_size),
                            ("extra_kv_format", extra_kv_format)):
            if value is not None:
                raise ValueError(f"{name}: given without extra_kv_cache/extra_indices")
    else:
        if not fmt.dual_cache:
            dual = sorted(k for k, f in FORMATS.items() if f.dual_cache)
            raise ValueError(f"extra_kv_cache: format {fmt.key} has no dual-cache form (formats with one: {dual})")
        for name, x in (("extra_kv_cache", extra_kv_cache), ("extra_indices", extra_indices)):
            if not hasattr(x, "shape") or not hasattr(x, "dtype"):
                raise TypeError(f"{name}: expected an array, got {_describe(x)}")
        extra_topk = _row_array("extra_indices", extra_indices, lead, allow_unit_axis=True)
        if extra_topk < ENVELOPE["min_topk"]:
            raise ValueError(f"extra_indices: expected topk >= {ENVELOPE['min_topk']}, got {_describe(extra_indices)}")
        if extra_topk_length is not None:
            _check_lengths("extra_topk_length", extra_topk_length, lead)
        extra_fmt = fmt if extra_kv_format is None else get_format(extra_kv_format)
        if extra_fmt.key not in extra_formats(fmt.key):
            raise ValueError(f"extra_kv_format: expected one of {list(extra_formats(fmt.key))} for a {fmt.key} main "
                             f"cache, got {extra_fmt.key!r}")
        extra_layout = cache_layout(extra_kv_cache, extra_fmt, extra_page_size, name="extra_kv_cache")

    return Problem(fmt=fmt, lead_shape=lead, num_tokens=num_tokens, num_heads=num_heads, topk=int(topk),
                   extra_topk=int(extra_topk), layout=layout, extra_layout=extra_layout, sm_scale=sm_scale,
                   impl=impl, batch_invariant=bool(batch_invariant), precision=precision, extra_fmt=extra_fmt)


def _page_rules(fmt: KVFormat) -> str:
    if not fmt.quantized:
        return "any page_size >= 1; [num_slots, d_qk] or [num_pages, page_size, d_qk] bfloat16"
    if fmt.layout.name == "FOOTER":
        multiple = 16 // math.gcd(fmt.bytes_per_token, 16)
        return (f"any page_size >= 1; 3-D/4-D form needs page_size % {multiple} == 0 "
                f"(page_size*{fmt.bytes_per_token} % 16 == 0); "
                f"2-D [num_pages, page_bytes] form with page_bytes >= page_size*{fmt.bytes_per_token}, % 16 == 0")
    return (f"any page_size >= 1; rows of >= {fmt.bytes_per_token} bytes, % 16 == 0 (padding ignored); "
            f"2-D [num_pages, page_bytes] form with page_bytes >= page_size*{fmt.bytes_per_token}, % 16 == 0")


def supported_configs() -> dict[str, dict[str, Any]]:
    """Per format key: its envelope as plain Python data (usable without a GPU).

    Returns:
      A fresh ``dict`` per call, mapping each format key to a dict with ``d_qk``, ``d_v``,
      ``bytes_per_token``, the cache ``dtype``, the head range ``heads`` (inclusive), ``min_topk``, the
      candidate ``window`` (None when there is none), ``page_size_rules`` (text), ``dual_cache`` and
      ``platforms`` (per platform, its kernel ``variants`` and, for ``cuda``, the ``archs`` built).
    """
    configs = {}
    for key, fmt in FORMATS.items():
        configs[key] = {
            "d_qk": fmt.d_qk,
            "d_v": fmt.d_v,
            "bytes_per_token": fmt.bytes_per_token,
            "dtype": "uint8" if fmt.quantized else "bfloat16",
            "heads": (ENVELOPE["min_heads"], ENVELOPE["max_heads"]),
            "min_topk": ENVELOPE["min_topk"],
            "window": fmt.max_candidates or None,
            "page_size_rules": _page_rules(fmt),
            "dual_cache": fmt.dual_cache,
            "extra_formats": list(extra_formats(key)),
            "platforms": {
                "cpu": {"variants": list(ENVELOPE["platforms"]["cpu"]["variants"])},
                "cuda": {"variants": list(ENVELOPE["platforms"]["cuda"]["variants"])
                         if kernel_tables.has_cuda_kernels(key) else [],
                         "archs": list(ENVELOPE["platforms"]["cuda"]["archs"])},
                "xla": {"variants": ["reference"]},
            },
        }
    return configs


def check_supported(kv_format: Union[str, KVFormat], *, num_heads: Optional[int] = None, topk: Optional[int] = None,
                    page_size: Optional[int] = None, platform: Optional[str] = None, impl: str = "auto",
                    dual_cache: bool = False, extra_kv_format: Optional[Union[str, KVFormat]] = None) -> None:
    """Raises ``ValueError`` naming every violated axis (and its allowed values) of a configuration.

    Only the axes given are checked; ``page_size`` is checked for ``>= 1`` (the format's alignment rules
    are checked where a cache is passed).

    Args:
      kv_format: format key or :class:`~jax_sparse_mla.KVFormat`.
      num_heads: heads per shard.
      topk: index row width.
      page_size: tokens per page.
      platform: ``"cpu"`` or ``"cuda"`` (None: any).
      impl: an ``impl=`` value of :func:`~jax_sparse_mla.sparse_mla`.
      dual_cache: whether an extra cache is used.
      extra_kv_format: the extra cache's format, when it differs from ``kv_format`` (implies ``dual_cache``).

    Raises:
      ValueError: the configuration is outside the envelope, or ``kv_format`` is unknown.
    """
    problems = []
    try:
        fmt = get_format(kv_format)
    except (TypeError, ValueError) as e:
        raise ValueError(str(e)) from None
    lo, hi = ENVELOPE["min_heads"], ENVELOPE["max_heads"]
    if num_heads is not None and not lo <= num_heads <= hi:
        problems.append(f"num_heads={num_heads} (allowed {lo}..{hi})")
    if topk is not None and topk < ENVELOPE["min_topk"]:
        problems.append(f"topk={topk} (allowed >= {ENVELOPE['min_topk']})")
    if page_size is not None and page_size < 1:
        problems.append(f"page_size={page_size} (allowed >= 1)")
    if platform is not None and platform not in ENVELOPE["platforms"]:
        problems.append(f"platform={platform!r} (allowed {sorted(ENVELOPE['platforms'])})")
    if impl not in IMPLS:
        problems.append(f"impl={impl!r} (allowed {IMPLS})")
    elif impl in ("decode", "prefill") and platform == "cpu":
        problems.append(f"impl={impl!r} on platform 'cpu' (the CPU runs 'auto' or 'xla')")
    if (dual_cache or extra_kv_format is not None) and not fmt.dual_cache:
        dual = sorted(k for k, f in FORMATS.items() if f.dual_cache)
        problems.append(f"dual_cache for {fmt.key} (allowed for {dual})")
    elif extra_kv_format is not None:
        extra_key = extra_kv_format.key if isinstance(extra_kv_format, KVFormat) else extra_kv_format
        if extra_key not in extra_formats(fmt.key):
            problems.append(f"extra_kv_format={extra_key!r} (allowed {list(extra_formats(fmt.key))})")
    if platform == "cuda" and not kernel_tables.has_cuda_kernels(fmt.key):
        problems.append(f"platform='cuda' for {fmt.key} (no CUDA kernel yet; the CPU kernel and impl='xla' serve it)")
    if problems:
        raise ValueError(f"unsupported configuration for format {fmt.key}: " + "; ".join(problems))
