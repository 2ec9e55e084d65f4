"""Trace-time validation of ``sparse_mla`` arguments (docs/errors.md) and the supported-config envelope.

Everything checkable from shapes and dtypes is checked here, before anything is lowered. Wrong dtypes
raise ``TypeError``; every other violation raises ``ValueError``. Messages name the argument, what was
expected and what was given.

:data:`RULES` is the one table of the envelope's rules: :func:`check_supported` reports a configuration
against it, and :func:`normalize` (``sparse_mla``) and ``plan()`` enforce the same predicates on the
values a call implies, so the three cannot disagree.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from . import kernel_tables
from .formats import FORMATS, CacheLayout, KVFormat, cache_layout, get_format, quantize_kv

__all__ = ["ENVELOPE", "IMPLS", "PRECISIONS", "DUAL_CACHE_PAIRS", "extra_formats", "RULES", "RULE", "Rule",
           "Problem", "as_operand", "normalize", "violations", "supported_configs", "check_supported"]

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

#: The limits and platforms of the envelope, used by :data:`RULES`, planning and ``supported_configs()``.
ENVELOPE = {
    "min_heads": kernel_tables.MIN_HEADS,
    "max_heads": kernel_tables.MAX_HEADS,
    "min_topk": kernel_tables.MIN_TOPK,
    "platforms": {
        "cpu": {"variants": ("reference",), "archs": (), "precisions": ("bf16", "fp8")},
        # No CUDA kernel computes in FP8 yet.
        "cuda": {"variants": ("decode", "prefill"), "archs": ("sm_80", "sm_90a", "sm_120a"), "precisions": ("bf16",)},
    },
}


@dataclasses.dataclass(frozen=True)
class Rule:
    """One rule of the envelope: a predicate over one or more configuration axes (the keyword
    arguments of :func:`check_supported`) and the text of what it allows."""

    name: str
    axes: tuple  # the axes it reads; it applies when every one of them is given
    accepts: Callable[..., bool]  # accepts(fmt, *values in the order of axes)
    allowed: Callable[[KVFormat], str]
    #: The violation as text, when "axis=value (allowed ...)" would not say what is missing.
    describe: Optional[Callable[..., str]] = None  # describe(fmt, *values)

    def violation(self, fmt: KVFormat, given: dict) -> Optional[str]:
        """``None`` when the rule accepts ``given`` (or does not apply), else the violation as text."""
        if any(given.get(axis) is None for axis in self.axes):
            return None
        values = [given[axis] for axis in self.axes]
        if self.accepts(fmt, *values):
            return None
        if self.describe is not None:
            return self.describe(fmt, *values)
        return ", ".join(f"{a}={v!r}" for a, v in zip(self.axes, values)) + f" (allowed {self.allowed(fmt)})"


@functools.lru_cache(maxsize=None)
def _quantized_cache_accepted(fmt_key: str, page_size: int) -> bool:
    """Whether the cache ``quantize_kv`` builds with ``page_size`` has a shape ``sparse_mla`` accepts:
    the cache shape check (``cache_layout``) decides, so the page rules live in one place."""
    fmt = get_format(fmt_key)
    rows = jax.ShapeDtypeStruct((page_size, fmt.d_qk), jnp.float32)
    cache = jax.eval_shape(lambda kv: quantize_kv(kv, fmt, page_size=page_size), rows)
    try:
        cache_layout(cache, fmt)
    except ValueError:
        return False
    return True


def _page_size_multiple(fmt: KVFormat) -> int:
    """The smallest page size of a quantize_kv cache that sparse_mla accepts (the page sizes it accepts
    are its multiples: 16-byte aligned pages)."""
    return next(m for m in range(1, 17) if _quantized_cache_accepted(fmt.key, m))


def _page_size_ok(fmt: KVFormat, page_size) -> bool:
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
        return False
    return _quantized_cache_accepted(fmt.key, int(page_size))


def _page_size_allowed(fmt: KVFormat) -> str:
    multiple = _page_size_multiple(fmt)
    if multiple == 1:
        return "any int >= 1"
    return (f"a multiple of {multiple} for the [num_pages, page_size, {fmt.bytes_per_token}] cache quantize_kv "
            f"builds (page_size*{fmt.bytes_per_token} % 16 == 0); the 2-D form [num_pages, page_bytes] with "
            f"padded pages takes any page_size >= 1")


def _impls_on(platform: str) -> tuple:
    """The ``impl=`` values that can run on a platform: 'auto', 'xla' and the platform's kernel variants."""
    return ("auto",) + tuple(v for v in ENVELOPE["platforms"][platform]["variants"] if v in IMPLS) + ("xla",)


def _precision_runs(fmt: KVFormat, precision: str, impl: str, platform: str) -> bool:
    if precision not in PRECISIONS or platform not in ENVELOPE["platforms"]:
        return True  # reported by the precision and platform rules
    return impl == "xla" or precision in ENVELOPE["platforms"][platform]["precisions"]


def _dual_formats() -> list:
    return sorted(k for k, f in FORMATS.items() if f.dual_cache)


#: Every rule of the supported envelope, in the order check_supported reports violations.
RULES = (
    Rule("num_heads", ("num_heads",),
         lambda fmt, h: ENVELOPE["min_heads"] <= h <= ENVELOPE["max_heads"],
         lambda fmt: f"{ENVELOPE['min_heads']}..{ENVELOPE['max_heads']}"),
    Rule("topk", ("topk",), lambda fmt, k: k >= ENVELOPE["min_topk"], lambda fmt: f">= {ENVELOPE['min_topk']}"),
    Rule("page_size", ("page_size",), _page_size_ok, _page_size_allowed),
    Rule("platform", ("platform",), lambda fmt, p: p in ENVELOPE["platforms"],
         lambda fmt: str(sorted(ENVELOPE["platforms"]))),
    Rule("impl", ("impl",), lambda fmt, impl: impl in IMPLS, lambda fmt: str(IMPLS)),
    Rule("impl_on_platform", ("impl", "platform"),
         lambda fmt, impl, p: impl not in IMPLS or p not in ENVELOPE["platforms"] or impl in _impls_on(p),
         lambda fmt: "; ".join(f"{p}: {', '.join(map(repr, _impls_on(p)))}" for p in ENVELOPE["platforms"])),
    Rule("precision", ("precision",), lambda fmt, p: p in PRECISIONS, lambda fmt: str(PRECISIONS)),
    Rule("precision_on_platform", ("precision", "impl", "platform"), _precision_runs,
         lambda fmt: "; ".join(f"{p}: {', '.join(map(repr, v['precisions']))}" for p, v in ENVELOPE["platforms"].items())
         + "; any with impl 'xla'"),
    Rule("format_on_platform", ("platform", "impl"),
         lambda fmt, platform, impl: impl == "xla" or platform != "cuda" or kernel_tables.has_cuda_kernels(fmt.key),
         lambda fmt: "the CPU kernel and impl='xla' for every format; CUDA for the formats with kernels",
         lambda fmt, platform, impl: (f"platform='cuda' for {fmt.key} (no CUDA kernel yet; the CPU kernel and "
                                      f"impl='xla' serve it)")),
    Rule("dual_cache", ("dual_cache",), lambda fmt, dual: not dual or fmt.dual_cache,
         lambda fmt: f"only for {_dual_formats()}"),
    Rule("extra_kv_format", ("extra_kv_format",),
         lambda fmt, extra: not fmt.dual_cache or extra in extra_formats(fmt.key),  # else: the dual_cache rule
         lambda fmt: str(list(extra_formats(fmt.key)))),
    Rule("batch_invariant", ("batch_invariant", "impl"),
         lambda fmt, invariant, impl: not invariant or impl in ("auto", "decode"),
         lambda fmt: "only with impl 'auto' or 'decode' (the split-K kernel fixes its reduction order; "
                     "'prefill' reduces the whole list in one pass, 'xla' leaves the order to XLA)"),
)
#: RULES by name.
RULE = {rule.name: rule for rule in RULES}


def violations(kv_format: Union[str, KVFormat], **given) -> list:
    """The violated :data:`RULES` of a configuration, as text (the axes not given are not checked)."""
    fmt = get_format(kv_format)
    return [text for text in (rule.violation(fmt, given) for rule in RULES) if text is not None]


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


#: The dtype of each operand that also takes Python numbers and (nested) lists, which carry no dtype.
_PYTHON_VALUE_DTYPES = {"indices": np.int32, "topk_length": np.int32, "attn_sink": np.float32,
                        "extra_indices": np.int32, "extra_topk_length": np.int32, "valid_tokens": np.int32}


def as_operand(name: str, x):
    """Operand ``name`` of ``sparse_mla`` as an array: Python numbers and (nested) lists/tuples become NumPy
    arrays of the operand's dtype (int32, or float32 for ``attn_sink``); arrays, tracers and anything
    else with a shape and dtype are returned unchanged (their dtype is checked as given).

    Raises:
      TypeError: a Python value that is not numbers of the operand's kind (or not rectangular), or a
        Python value for an operand that needs an array (``q``, the caches).
      ValueError: Python integers outside the int32 range.
    """
    if x is None or (hasattr(x, "shape") and hasattr(x, "dtype")):
        return x
    dtype = _PYTHON_VALUE_DTYPES.get(name)
    if dtype is None or not isinstance(x, (int, float, list, tuple)) or isinstance(x, bool):
        kind = "an array" if dtype is None else f"an array, a Python number or a list of them ({np.dtype(dtype).name})"
        raise TypeError(f"{name}: expected {kind}, got {type(x).__name__}")
    try:
        values = np.asarray(x)
    except ValueError:  # ragged nesting
        raise TypeError(f"{name}: expected a rectangular list of numbers, got {type(x).__name__} {x!r}") from None
    kinds = "iu" if np.dtype(dtype).kind == "i" else "iuf"
    if values.size and values.dtype.kind not in kinds:
        expected = "integers" if kinds == "iu" else "numbers"
        raise TypeError(f"{name}: expected Python {expected} (for {np.dtype(dtype).name}), got "
                        f"{type(x).__name__} of {values.dtype.name}: {x!r}")
    if values.size and kinds == "iu":
        info = np.iinfo(dtype)
        if values.min() < info.min or values.max() > info.max:
            raise ValueError(f"{name}: expected {np.dtype(dtype).name} values, got {x!r} (out of range)")
    return values.astype(dtype)


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
        topk = shape[-1]
    elif allow_unit_axis and len(lead) == 1 and len(shape) == 3 and shape[0] == lead[0] and shape[1] == 1:
        topk = shape[-1]
    else:
        raise ValueError(f"{name}: expected {expected}, got {_describe(x)}")
    return topk


def _check_topk(name, x, topk, fmt):
    if not RULE["topk"].accepts(fmt, topk):
        raise ValueError(f"{name}: expected topk {RULE['topk'].allowed(fmt)}, got {_describe(x)}")


def _check_lengths(name, x, lead):
    expected = f"int32 [{', '.join(('B', 'S') if len(lead) == 2 else ('T',))}] with {_lead_text(lead)}"
    _check_dtype(name, x, jnp.int32, expected)
    if tuple(x.shape) != tuple(lead):
        raise ValueError(f"{name}: expected {expected}, got {_describe(x)}")


def normalize(q, kv_cache, indices, *, kv_format, sm_scale, page_size=None, topk_length=None, attn_sink=None,
              extra_kv_cache=None, extra_indices=None, extra_topk_length=None, extra_page_size=None,
              valid_tokens=None, impl="auto", batch_invariant=False, precision="bf16",
              extra_kv_format=None) -> Problem:
    """Validates every argument of :func:`jax_sparse_mla.sparse_mla` and returns the static :class:`Problem`.

    Array arguments are arrays (or ShapeDtypeStructs); :func:`as_operand` converts Python values first.
    """
    fmt = get_format(kv_format)
    if not isinstance(impl, str):
        raise TypeError(f"impl: expected one of {IMPLS}, got {type(impl).__name__}")
    if not RULE["impl"].accepts(fmt, impl):
        raise ValueError(f"impl: expected one of {RULE['impl'].allowed(fmt)}, got {impl!r}")
    if not isinstance(precision, str):
        raise TypeError(f"precision: expected one of {PRECISIONS}, got {type(precision).__name__}")
    if not RULE["precision"].accepts(fmt, precision):
        raise ValueError(f"precision: expected one of {RULE['precision'].allowed(fmt)}, got {precision!r}")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"sm_scale: expected a Python float (static), got {_describe(sm_scale)}")
    sm_scale = float(sm_scale)
    if not isinstance(batch_invariant, (bool, np.bool_)):
        raise TypeError(f"batch_invariant: expected a bool, got {_describe(batch_invariant)}")
    if not RULE["batch_invariant"].accepts(fmt, batch_invariant, impl):
        raise ValueError(f"batch_invariant: True is served {RULE['batch_invariant'].allowed(fmt)}, got "
                         f"impl={impl!r}")
    if not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale: expected a finite float, got {sm_scale}")

    for name, x in (("q", q), ("kv_cache", kv_cache), ("indices", indices)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name}: expected an array, got {_describe(x)}")
    heads = RULE["num_heads"]
    q_expected = (f"bfloat16 [T, H, {fmt.d_qk}] or [B, S, H, {fmt.d_qk}] with H in {heads.allowed(fmt)} "
                  f"(format {fmt.key})")
    _check_dtype("q", q, jnp.bfloat16, q_expected)
    if q.ndim not in (3, 4) or q.shape[-1] != fmt.d_qk:
        raise ValueError(f"q: expected {q_expected}, got {_describe(q)}")
    num_heads = int(q.shape[-2])
    if not heads.accepts(fmt, num_heads):
        raise ValueError(f"q: expected {q_expected}, got H={num_heads} in {_describe(q)}")
    lead = tuple(int(d) for d in q.shape[:-2])
    num_tokens = int(np.prod(lead))

    topk = _row_array("indices", indices, lead, allow_unit_axis=True)
    _check_topk("indices", indices, topk, fmt)
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

    # The page rules of RULES["page_size"] are cache_layout's (see _quantized_cache_accepted).
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
        if not RULE["dual_cache"].accepts(fmt, True):
            raise ValueError(f"extra_kv_cache: format {fmt.key} has no dual-cache form (formats with one: "
                             f"{_dual_formats()})")
        for name, x in (("extra_kv_cache", extra_kv_cache), ("extra_indices", extra_indices)):
            if not hasattr(x, "shape") or not hasattr(x, "dtype"):
                raise TypeError(f"{name}: expected an array, got {_describe(x)}")
        extra_topk = _row_array("extra_indices", extra_indices, lead, allow_unit_axis=True)
        _check_topk("extra_indices", extra_indices, extra_topk, fmt)
        if extra_topk_length is not None:
            _check_lengths("extra_topk_length", extra_topk_length, lead)
        extra_fmt = fmt if extra_kv_format is None else get_format(extra_kv_format)
        if not RULE["extra_kv_format"].accepts(fmt, extra_fmt.key):
            raise ValueError(f"extra_kv_format: expected one of {RULE['extra_kv_format'].allowed(fmt)} for a "
                             f"{fmt.key} main cache, got {extra_fmt.key!r}")
        extra_layout = cache_layout(extra_kv_cache, extra_fmt, extra_page_size, name="extra_kv_cache")

    return Problem(fmt=fmt, lead_shape=lead, num_tokens=num_tokens, num_heads=num_heads, topk=int(topk),
                   extra_topk=int(extra_topk), layout=layout, extra_layout=extra_layout, sm_scale=sm_scale,
                   impl=impl, batch_invariant=bool(batch_invariant), precision=precision, extra_fmt=extra_fmt)


def _page_rules(fmt: KVFormat) -> str:
    if not fmt.quantized:
        return "any page_size >= 1; [num_slots, d_qk] or [num_pages, page_size, d_qk] bfloat16"
    two_d = (f"2-D [num_pages, page_bytes] form with page_bytes >= page_size*{fmt.bytes_per_token}, % 16 == 0")
    if fmt.layout.name == "FOOTER":
        return (f"any page_size >= 1; 3-D/4-D form needs page_size % {_page_size_multiple(fmt)} == 0 "
                f"(page_size*{fmt.bytes_per_token} % 16 == 0); " + two_d)
    return f"any page_size >= 1; rows of >= {fmt.bytes_per_token} bytes, % 16 == 0 (padding ignored); " + two_d


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
                    dual_cache: bool = False, extra_kv_format: Optional[Union[str, KVFormat]] = None,
                    batch_invariant: bool = False, precision: str = "bf16") -> None:
    """Raises ``ValueError`` naming every violated axis (and its allowed values) of a configuration.

    Only the axes given are checked, against the same rules ``sparse_mla`` and ``plan`` enforce.

    Args:
      kv_format: format key or :class:`~jax_sparse_mla.KVFormat`.
      num_heads: heads per shard.
      topk: index row width.
      page_size: tokens per page of the ``[num_pages, page_size, row_bytes]`` cache that
        :func:`~jax_sparse_mla.quantize_kv` builds (footer formats need 16-byte aligned pages there; the
        2-D ``[num_pages, page_bytes]`` form with padded pages takes any page size).
      platform: ``"cpu"`` or ``"cuda"`` (None: any).
      impl: an ``impl=`` value of :func:`~jax_sparse_mla.sparse_mla`.
      dual_cache: whether an extra cache is used.
      extra_kv_format: the extra cache's format, when it differs from ``kv_format`` (implies ``dual_cache``).
      batch_invariant: the ``batch_invariant=`` value of :func:`~jax_sparse_mla.sparse_mla`.
      precision: the ``precision=`` value of :func:`~jax_sparse_mla.sparse_mla`.

    Raises:
      ValueError: the configuration is outside the envelope, or ``kv_format`` is unknown.
    """
    try:
        fmt = get_format(kv_format)
    except (TypeError, ValueError) as e:
        raise ValueError(str(e)) from None
    if isinstance(extra_kv_format, KVFormat):
        extra_kv_format = extra_kv_format.key
    problems = violations(fmt, num_heads=num_heads, topk=topk, page_size=page_size, platform=platform, impl=impl,
                          dual_cache=dual_cache or extra_kv_format is not None, extra_kv_format=extra_kv_format,
                          batch_invariant=batch_invariant, precision=precision)
    if problems:
        raise ValueError(f"unsupported configuration for format {fmt.key}: " + "; ".join(problems))
