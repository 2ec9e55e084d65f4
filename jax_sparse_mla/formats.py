"""KV-cache formats: the byte layouts (docs/formats.md) and pure-JAX quantize / update / dequantize.

Every format is a :class:`KVFormat` registered under a string key. The C++ header
``kernels/common/formats.h`` holds the same table for the kernels; ``tests/test_formats.py`` checks
that the two agree field by field.

Cache geometry is described by :class:`CacheLayout` (pages, page size, page stride and row stride in
bytes), computed from a cache's shape by :func:`cache_layout`. The same numbers are handed to the
kernels, so Python and C++ address a slot identically.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "KVFormat",
    "Layout",
    "ScaleKind",
    "FORMATS",
    "get_format",
    "CacheLayout",
    "cache_layout",
    "quantize_kv",
    "quantize_query_fp8",
    "update_kv",
    "dequantize_kv",
    "encode_rows",
    "decode_rows",
    "gather_rows",
    "all_rows",
    "bf16_rows",
]


class Layout(enum.IntEnum):
    """How a token's bytes are arranged (values match ``jsmla::Layout``)."""

    INLINE = 0  # each row holds the quantized values, scales and bf16 lanes
    FOOTER = 1  # a page holds all data rows, then all scale rows
    BF16 = 2  # unquantized bfloat16 rows


class ScaleKind(enum.IntEnum):
    """How group scales are stored (values match ``jsmla::ScaleKind``)."""

    NONE = 0
    FP32 = 1  # little-endian float32 per group
    UE8M0 = 2  # one exponent byte per group: 2^(b-127)
    E4M3 = 3  # one float8_e4m3fn byte per group


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """Byte layout of one KV-cache format (docs/formats.md).

    K of a token is ``quant_dim`` quantized lanes (FP8 or FP4, dequantized by their group's scale) followed
    by ``bf16_dim`` BF16 lanes; V is the first ``d_v`` lanes of K. The fields mirror the kernels'
    ``jsmla::FormatTraits``.

    Attributes:
      key: the format's name, e.g. ``"dsv3_2"``.
      id: the format's number in the kernels' table.
      layout: ``Layout.INLINE`` (self-contained rows), ``Layout.FOOTER`` (a page's data rows, then its
        scale rows) or ``Layout.BF16`` (unquantized rows).
      scale_kind: ``ScaleKind.FP32`` (little-endian float32 per group), ``ScaleKind.UE8M0`` (one
        exponent byte per group), ``ScaleKind.E4M3`` (one float8_e4m3fn byte per group) or
        ``ScaleKind.NONE``.
      d_qk: query/key width in lanes.
      d_v: value/output width in lanes.
      bytes_per_token: bytes one token occupies (inline: the payload, before any row padding).
      quant_dim: quantized lanes of K (the first lanes).
      quant_bits: 8 (FP8 e4m3, a byte a lane), 4 (FP4 e2m1, two lanes a byte, lane ``2i`` in the low
        nibble of byte ``i``) or 0 (no quantized lanes).
      bf16_dim: BF16 lanes of K after the quantized lanes (the rope lanes; all lanes for ``bf16_*``).
      group_size: quantized lanes per scale (0 without scales).
      num_groups: scales per token.
      data_row_bytes: bytes of a token's data row (inline and bf16: the whole payload).
      scale_offset: byte offset of the first scale in the row that holds the scales (inline: the data
        row; footer: the scale row).
      scale_row_bytes: bytes of a footer scale row (0 for the other layouts).
      bf16_offset: byte offset of the BF16 lanes in the data row.
      max_candidates: the candidate window per query row (0: none; 513 for ``dots3_swa``).
      pow2_scales: the scales are powers of two.
      dual_cache: the format has a dual-cache form (``extra_kv_cache``).
      description: one line about the format.
    """

    key: str
    id: int
    layout: Layout
    scale_kind: ScaleKind
    d_qk: int
    d_v: int
    bytes_per_token: int
    quant_dim: int
    quant_bits: int
    bf16_dim: int
    group_size: int
    num_groups: int
    data_row_bytes: int
    scale_offset: int
    scale_row_bytes: int
    bf16_offset: int
    max_candidates: int
    pow2_scales: bool
    dual_cache: bool
    description: str = dataclasses.field(default="", compare=False)

    @property
    def quantized(self) -> bool:
        """True for the FP8 and FP4 formats (uint8 caches), False for ``bf16_*``."""
        return self.layout != Layout.BF16

    @property
    def scale_bytes(self) -> int:
        """Bytes of one group scale (4 for FP32, 1 for UE8M0 and E4M3, 0 without scales)."""
        return {ScaleKind.NONE: 0, ScaleKind.FP32: 4, ScaleKind.UE8M0: 1, ScaleKind.E4M3: 1}[self.scale_kind]

    @property
    def quant_bytes(self) -> int:
        """Bytes of the quantized lanes at the start of a (data) row."""
        return self.quant_dim * self.quant_bits // 8

    def __str__(self) -> str:
        return self.key


def _format(*, quant_dim: int, group_size: int, **fields) -> KVFormat:
    """A :class:`KVFormat` from its fields; ``num_groups`` follows from the quantized lanes and the group size."""
    return KVFormat(quant_dim=quant_dim, group_size=group_size,
                    num_groups=quant_dim // group_size if group_size else 0, **fields)


#: All formats by key (the byte layouts of docs/formats.md).
FORMATS: dict[str, KVFormat] = {
    f.key: f
    for f in (
        _format(key="dsv3_2", id=0, layout=Layout.INLINE, scale_kind=ScaleKind.FP32,
                d_qk=576, d_v=512, bytes_per_token=656, quant_dim=512, quant_bits=8, bf16_dim=64, group_size=128,
                data_row_bytes=656, scale_offset=512, scale_row_bytes=0, bf16_offset=528,
                max_candidates=0, pow2_scales=True, dual_cache=False,
                description="DeepSeek-V3.2: FP8 nope(512) + 4 power-of-two FP32 scales + BF16 rope(64), inline"),
        _format(key="glm_nsa", id=1, layout=Layout.INLINE, scale_kind=ScaleKind.FP32,
                d_qk=576, d_v=512, bytes_per_token=656, quant_dim=512, quant_bits=8, bf16_dim=64, group_size=128,
                data_row_bytes=656, scale_offset=512, scale_row_bytes=0, bf16_offset=528,
                max_candidates=0, pow2_scales=False, dual_cache=False,
                description="GLM-5 NSA: FP8 nope(512) + 4 FP32 scales + BF16 rope(64), inline"),
        _format(key="glm53_nope", id=2, layout=Layout.INLINE, scale_kind=ScaleKind.FP32,
                d_qk=512, d_v=512, bytes_per_token=528, quant_dim=512, quant_bits=8, bf16_dim=0, group_size=128,
                data_row_bytes=528, scale_offset=512, scale_row_bytes=0, bf16_offset=528,
                max_candidates=0, pow2_scales=False, dual_cache=False,
                description="GLM-5.3 no-RoPE: FP8(512) + 4 FP32 scales, inline (wider legacy rows accepted)"),
        _format(key="dsv4", id=3, layout=Layout.FOOTER, scale_kind=ScaleKind.UE8M0,
                d_qk=512, d_v=512, bytes_per_token=584, quant_dim=448, quant_bits=8, bf16_dim=64, group_size=64,
                data_row_bytes=576, scale_offset=0, scale_row_bytes=8, bf16_offset=448,
                max_candidates=0, pow2_scales=True, dual_cache=True,
                description="DeepSeek-V4: FP8 nope(448) + BF16 rope(64); UE8M0 per 64 in a page footer"),
        _format(key="dsv4_1", id=4, layout=Layout.FOOTER, scale_kind=ScaleKind.UE8M0,
                d_qk=512, d_v=512, bytes_per_token=528, quant_dim=512, quant_bits=8, bf16_dim=0, group_size=32,
                data_row_bytes=512, scale_offset=0, scale_row_bytes=16, bf16_offset=512,
                max_candidates=0, pow2_scales=True, dual_cache=True,
                description="DeepSeek-V4.1: FP8(512); UE8M0 per 32 in a page footer"),
        _format(key="dots3_swa", id=5, layout=Layout.FOOTER, scale_kind=ScaleKind.UE8M0,
                d_qk=1088, d_v=1024, bytes_per_token=1160, quant_dim=1024, quant_bits=8, bf16_dim=64, group_size=128,
                data_row_bytes=1152, scale_offset=0, scale_row_bytes=8, bf16_offset=1024,
                max_candidates=513, pow2_scales=True, dual_cache=False,
                description="DOTS3 sliding-window MLA: FP8 nope(1024) + BF16 rope(64); UE8M0 per 128 in a page footer"),
        _format(key="bf16_576", id=6, layout=Layout.BF16, scale_kind=ScaleKind.NONE,
                d_qk=576, d_v=512, bytes_per_token=1152, quant_dim=0, quant_bits=0, bf16_dim=576, group_size=0,
                data_row_bytes=1152, scale_offset=0, scale_row_bytes=0, bf16_offset=0,
                max_candidates=0, pow2_scales=False, dual_cache=False,
                description="unquantized BF16 rows, DeepSeek shape (V = first 512 lanes)"),
        _format(key="bf16_512", id=7, layout=Layout.BF16, scale_kind=ScaleKind.NONE,
                d_qk=512, d_v=512, bytes_per_token=1024, quant_dim=0, quant_bits=0, bf16_dim=512, group_size=0,
                data_row_bytes=1024, scale_offset=0, scale_row_bytes=0, bf16_offset=0,
                max_candidates=0, pow2_scales=False, dual_cache=False,
                description="unquantized BF16 rows, no-rope shape"),
        _format(key="dsv4_nvfp4", id=8, layout=Layout.FOOTER, scale_kind=ScaleKind.E4M3,
                d_qk=512, d_v=512, bytes_per_token=384, quant_dim=448, quant_bits=4, bf16_dim=64, group_size=16,
                data_row_bytes=352, scale_offset=0, scale_row_bytes=32, bf16_offset=224,
                max_candidates=0, pow2_scales=False, dual_cache=True,
                description="DeepSeek-V4 NVFP4: FP4 nope(448) + BF16 rope(64); E4M3 per 16 in a page footer"),
        _format(key="dsv4_1_fp4", id=9, layout=Layout.FOOTER, scale_kind=ScaleKind.E4M3,
                d_qk=512, d_v=512, bytes_per_token=288, quant_dim=512, quant_bits=4, bf16_dim=0, group_size=16,
                data_row_bytes=256, scale_offset=0, scale_row_bytes=32, bf16_offset=256,
                max_candidates=0, pow2_scales=False, dual_cache=True,
                description="DeepSeek-V4.1 FP4: FP4(512); E4M3 per 16 in a page footer"),
    )
}


def get_format(kv_format: Union[str, KVFormat]) -> KVFormat:
    """Returns the :class:`KVFormat` for a key or format object.

    Raises:
      ValueError: an unknown key, or a ``KVFormat`` that is not registered.
      TypeError: anything other than a str or ``KVFormat``.
    """
    if isinstance(kv_format, KVFormat):
        if FORMATS.get(kv_format.key) != kv_format:
            raise ValueError(f"kv_format: expected a registered format, got an unregistered {kv_format!r}")
        return kv_format
    if not isinstance(kv_format, str):
        raise TypeError(f"kv_format: expected a str key or KVFormat, got {type(kv_format).__name__}")
    try:
        return FORMATS[kv_format]
    except KeyError:
        raise ValueError(f"kv_format: expected one of {sorted(FORMATS)}, got {kv_format!r}") from None


# --------------------------------------------------------------------------------------------------
# Cache geometry
# --------------------------------------------------------------------------------------------------

_QUANTIZED_DTYPES = (np.dtype(np.uint8), np.dtype(np.int8), np.dtype(jnp.float8_e4m3fn))


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Static geometry of a cache, in bytes (mirrors ``jsmla::CacheView``).

    A slot ``s`` lives in page ``s // page_size`` at row ``s % page_size``. Pages start
    ``page_stride`` bytes apart; rows (inline, bf16) or data rows (footer) start ``row_stride``
    bytes apart inside a page; footer scale rows follow the ``page_size`` data rows.
    """

    num_pages: int
    page_size: int
    page_stride: int
    row_stride: int

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size


def _shape_text(x) -> str:
    return f"{np.dtype(x.dtype).name} [{', '.join(str(d) for d in x.shape)}]"


def cache_layout(cache, kv_format: Union[str, KVFormat], page_size: Optional[int] = None,
                 name: str = "kv_cache") -> CacheLayout:
    """Validates a cache's shape and dtype (docs/formats.md, cache shapes) and returns its :class:`CacheLayout`.

    Accepts any object with ``shape`` and ``dtype`` (arrays, ShapeDtypeStructs, tracers).

    Raises:
      TypeError: wrong dtype.
      ValueError: any shape or page-size violation.
    """
    fmt = get_format(kv_format)
    shape = tuple(int(d) for d in cache.shape)
    dtype = np.dtype(cache.dtype)
    if page_size is not None:
        if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)):
            raise TypeError(f"page_size: expected an int, got {type(page_size).__name__}")
        page_size = int(page_size)
        if page_size < 1:
            raise ValueError(f"page_size: expected an int >= 1, got {page_size}")

    if not fmt.quantized:
        if dtype != np.dtype(jnp.bfloat16):
            raise TypeError(f"{name}: expected bfloat16 for format {fmt.key}, got {_shape_text(cache)}")
        row_bytes = 2 * fmt.d_qk
        if len(shape) == 2 and shape[1] == fmt.d_qk:
            if page_size not in (None, 1):
                raise ValueError(f"{name}: a [num_slots, {fmt.d_qk}] bf16 cache has page_size 1, got page_size={page_size}")
            return CacheLayout(shape[0], 1, row_bytes, row_bytes)
        dims = _squeeze_head_axis(shape)
        if dims is not None and len(dims) == 3 and dims[2] == fmt.d_qk:
            _check_page_size_matches(name, page_size, dims[1])
            return CacheLayout(dims[0], dims[1], dims[1] * row_bytes, row_bytes)
        raise ValueError(
            f"{name}: expected bfloat16 [num_slots, {fmt.d_qk}] or [num_pages, page_size, {fmt.d_qk}] "
            f"(unit head axis allowed) for format {fmt.key}, got {_shape_text(cache)}")

    if dtype not in _QUANTIZED_DTYPES:
        raise TypeError(f"{name}: expected uint8 (or int8/float8_e4m3fn views) for format {fmt.key}, "
                        f"got {_shape_text(cache)}")
    bpt = fmt.bytes_per_token
    footer = fmt.layout == Layout.FOOTER
    if len(shape) == 2:
        if page_size is None:
            raise ValueError(f"{name}: a 2-D cache [num_pages, page_bytes] needs page_size=, got none "
                             f"(shape {_shape_text(cache)})")
        page_bytes = shape[1]
        need = page_size * bpt
        if page_bytes < need or page_bytes % 16:
            raise ValueError(
                f"{name}: expected page_bytes >= page_size*bytes_per_token = {page_size}*{bpt} = {need} and a "
                f"multiple of 16 for format {fmt.key}, got [{shape[0]}, {page_bytes}]")
        row_stride = fmt.data_row_bytes if footer else bpt
        return CacheLayout(shape[0], page_size, page_bytes, row_stride)

    dims = _squeeze_head_axis(shape)
    if dims is None or len(dims) != 3:
        raise ValueError(
            f"{name}: expected uint8 [num_pages, page_size, row_bytes], [num_pages, page_size, 1, row_bytes], "
            f"[num_pages, 1, page_size, row_bytes] or [num_pages, page_bytes] (with page_size=) for format "
            f"{fmt.key}, got {_shape_text(cache)}")
    num_pages, tokens, row_bytes = dims
    _check_page_size_matches(name, page_size, tokens)
    if footer:
        if row_bytes != bpt:
            raise ValueError(f"{name}: footer format {fmt.key} needs row_bytes == {bpt} (rows are packed), "
                             f"got row_bytes={row_bytes}")
        if (tokens * bpt) % 16:
            raise ValueError(
                f"{name}: footer format {fmt.key} needs page_size*{bpt} to be a multiple of 16 so pages stay "
                f"16-byte aligned, got page_size={tokens}; use the 2-D form [num_pages, page_bytes] with padded pages")
        return CacheLayout(num_pages, tokens, tokens * bpt, fmt.data_row_bytes)
    if row_bytes < bpt or row_bytes % 16:
        raise ValueError(f"{name}: inline format {fmt.key} needs row_bytes >= {bpt} and a multiple of 16, "
                         f"got row_bytes={row_bytes}")
    return CacheLayout(num_pages, tokens, tokens * row_bytes, row_bytes)


def _squeeze_head_axis(shape):
    if len(shape) == 3:
        return shape
    if len(shape) == 4:
        if shape[2] == 1:  # NHD
            return (shape[0], shape[1], shape[3])
        if shape[1] == 1:  # HND
            return (shape[0], shape[2], shape[3])
    return None


def _check_page_size_matches(name, page_size, tokens):
    if page_size is not None and page_size != tokens:
        raise ValueError(f"{name}: page_size={page_size} does not match the cache's page axis of {tokens}")


def _as_pages(cache, layout: CacheLayout):
    """Byte view [num_pages, page_stride] (uint8) of a quantized cache, or [num_pages, page_size*d] bf16."""
    if cache.dtype == jnp.bfloat16:
        return cache.reshape(layout.num_pages, -1)
    if cache.dtype != jnp.uint8:
        cache = jax.lax.bitcast_convert_type(cache, jnp.uint8)
    return cache.reshape(layout.num_pages, layout.page_stride)


# --------------------------------------------------------------------------------------------------
# Encoding (quantization) of rows, bit-exact (docs/formats.md, quantize_kv)
# --------------------------------------------------------------------------------------------------

_FP8_MAX = 448.0
_FP4_MAX = 6.0  # the largest E2M1 magnitude
_FP4_SCALE_MIN = 2.0 ** -9  # the smallest E4M3 scale of an FP4 group (E4M3's smallest subnormal)
# The rounding thresholds between neighbouring E2M1 codes (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6): a magnitude
# exactly on a threshold goes to the even code (> for a threshold above an even code, >= above an odd one).
_E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _divide(numerator, denominator):
    """IEEE float32 ``numerator / denominator`` (correctly rounded), elementwise.

    XLA's simplifier rewrites a division by a constant or by a broadcast into a multiplication by
    the reciprocal, which is not bit-exact. Materialising the divisor at full shape behind an
    optimization barrier keeps a true division, as quantization requires (docs/formats.md, quantize_kv).
    """
    denominator = jnp.broadcast_to(jnp.asarray(denominator, jnp.float32), numerator.shape)
    return numerator / jax.lax.optimization_barrier(denominator)


def _pow2_scale_bits(amax):
    """Exponent field of 2^ceil(log2(amax/448)) computed from the float32 bits of amax/448."""
    ratio = _divide(amax, _FP8_MAX)
    bits = jax.lax.bitcast_convert_type(ratio, jnp.uint32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    return exponent + (mantissa != 0).astype(jnp.uint32)


def _e2m1_codes(x):
    """Round-to-nearest-even of float32 ``x`` onto the E2M1 grid, saturating at ±6: uint8 codes 0..15
    (sign in bit 3; a negative value that rounds to zero keeps its sign, as IEEE rounding does)."""
    magnitude = jnp.abs(x)
    code = jnp.zeros(x.shape, jnp.uint8)
    for threshold, inclusive in _E2M1_THRESHOLDS:
        code = code + (magnitude >= threshold if inclusive else magnitude > threshold).astype(jnp.uint8)
    return code | (jnp.signbit(x).astype(jnp.uint8) << 3)


def _e2m1_values(codes):
    """float32 values of E2M1 codes (uint8, the low 4 bits), built from their bits (elementwise integer
    operations, which XLA fuses into the surrounding pass; a lookup in a table of the values would be a
    gather): exponent field e and mantissa bit m give m / 2 for e = 0 and 2^(e - 1) (1 + m / 2) otherwise,
    the sign in bit 3."""
    c = codes.astype(jnp.uint32)
    exponent, mantissa = (c >> 1) & 3, c & 1
    bits = jnp.where(exponent == 0, mantissa * jnp.uint32(126 << 23), ((exponent + 126) << 23) | (mantissa << 22))
    return jax.lax.bitcast_convert_type(bits | ((c & 8) << 28), jnp.float32)


def _to_bytes(x, dtype):
    """[..., n] values -> [..., n * itemsize] little-endian bytes."""
    x = x.astype(dtype)
    if np.dtype(dtype).itemsize == 1:
        return jax.lax.bitcast_convert_type(x, jnp.uint8)
    b = jax.lax.bitcast_convert_type(x, jnp.uint8)
    return b.reshape(*x.shape[:-1], -1)


def encode_rows(kv, kv_format: Union[str, KVFormat]):
    """Quantizes rows as ``quantize_kv`` does (docs/formats.md, quantize_kv).

    Args:
      kv: ``[n, d_qk]`` float32 or bfloat16, finite.
    Returns:
      ``(data, scales)``: for quantized formats uint8 ``[n, data_row_bytes]`` (inline: the whole
      row payload including scales) and uint8 ``[n, scale_row_bytes]`` (footer scale rows; an
      empty ``[n, 0]`` otherwise). For ``bf16_*``: ``(kv as bfloat16, None)``.
    """
    fmt = get_format(kv_format)
    if kv.ndim != 2 or kv.shape[-1] != fmt.d_qk:
        raise ValueError(f"kv: expected [num_tokens, {fmt.d_qk}] for format {fmt.key}, got {_shape_text(kv)}")
    if kv.dtype not in (jnp.float32, jnp.bfloat16):
        raise TypeError(f"kv: expected float32 or bfloat16, got {_shape_text(kv)}")
    if not fmt.quantized:
        return kv.astype(jnp.bfloat16), None
    n = kv.shape[0]
    x = kv.astype(jnp.float32)
    nope = x[:, : fmt.quant_dim].reshape(n, fmt.num_groups, fmt.group_size)
    amax = jnp.maximum(jnp.max(jnp.abs(nope), axis=-1), jnp.float32(1e-4))
    if fmt.quant_bits == 4:
        scale_e4m3 = jnp.clip(_divide(amax, _FP4_MAX), _FP4_SCALE_MIN, _FP8_MAX).astype(jnp.float8_e4m3fn)
        codes = _e2m1_codes(_divide(nope, scale_e4m3.astype(jnp.float32)[..., None])).reshape(n, fmt.quant_dim)
        pieces = [codes[:, 0::2] | (codes[:, 1::2] << 4)]  # lane 2i in the low nibble of byte i
        scale_bytes = jax.lax.bitcast_convert_type(scale_e4m3, jnp.uint8)
    else:
        if fmt.pow2_scales:
            exponent = _pow2_scale_bits(amax)
            scale = jax.lax.bitcast_convert_type(exponent << 23, jnp.float32)
        else:
            scale = _divide(amax, _FP8_MAX)
        scaled = jnp.clip(_divide(nope, scale[..., None]), -_FP8_MAX, _FP8_MAX)
        pieces = [_to_bytes(scaled.reshape(n, fmt.quant_dim), jnp.float8_e4m3fn)]
        if fmt.scale_kind == ScaleKind.FP32:
            scale_bytes = _to_bytes(scale, jnp.float32)
        else:
            scale_bytes = exponent.astype(jnp.uint8)
    if fmt.layout == Layout.INLINE:
        pieces.append(scale_bytes)
    if fmt.bf16_dim:
        pieces.append(_to_bytes(x[:, fmt.quant_dim:], jnp.bfloat16))
    data = jnp.concatenate(pieces, axis=-1)
    if fmt.layout == Layout.INLINE:
        return data, jnp.zeros((n, 0), jnp.uint8)
    pad = fmt.scale_row_bytes - scale_bytes.shape[-1]
    scales = jnp.pad(scale_bytes, ((0, 0), (0, pad)))
    return data, scales


#: Query lanes that share one scale in ``precision="fp8"``.
QUERY_FP8_GROUP = 64
_QUERY_AMAX_FLOOR = 1e-30


def quantize_query_fp8(q):
    """The query of ``precision="fp8"``: FP8-quantized and dequantized, exactly (docs/semantics.md).

    Per (row, head, group of 64 lanes): ``amax = max|q|`` clamped below at 1e-30,
    ``scale = 2^ceil(log2(amax / 448))`` from the float32 bits, FP8 e4m3 = saturating round-to-nearest-even
    of ``q / scale`` (a float32 division); the result is ``fp8 * scale``, which bfloat16 holds exactly.

    Args:
      q: bfloat16 ``[..., d]`` with ``d`` a multiple of 64.
    Returns:
      bfloat16, the shape of ``q``.
    """
    if q.shape[-1] % QUERY_FP8_GROUP:
        raise ValueError(f"q: expected a last axis that is a multiple of {QUERY_FP8_GROUP}, got {_shape_text(q)}")
    x = q.astype(jnp.float32).reshape(*q.shape[:-1], q.shape[-1] // QUERY_FP8_GROUP, QUERY_FP8_GROUP)
    amax = jnp.maximum(jnp.max(jnp.abs(x), axis=-1), jnp.float32(_QUERY_AMAX_FLOOR))
    scale = jax.lax.bitcast_convert_type(_pow2_scale_bits(amax) << 23, jnp.float32)[..., None]
    fp8 = jnp.clip(_divide(x, scale), -_FP8_MAX, _FP8_MAX).astype(jnp.float8_e4m3fn)
    return (fp8.astype(jnp.float32) * scale).astype(jnp.bfloat16).reshape(q.shape)


def quantize_kv(kv, kv_format: Union[str, KVFormat], page_size: int = 64):
    """Builds a whole cache from unquantized latent rows, bit-exact and jittable (docs/formats.md).

    Args:
      kv: ``[num_tokens, d_qk]`` float32 or bfloat16 (nope lanes then rope lanes), finite.
      kv_format: format key or :class:`KVFormat`.
      page_size: tokens per page; ``num_tokens`` is padded with zero tokens to a whole page.

    Returns:
      uint8 ``[num_pages, page_size, bytes_per_token]``, or bfloat16 ``[num_pages, page_size, d_qk]``
      for ``bf16_*`` formats. Footer pages hold the data rows then the scale rows.

    Raises:
      TypeError: ``kv`` neither float32 nor bfloat16.
      ValueError: ``kv`` not ``[num_tokens, d_qk]``, or ``page_size`` not a positive int.
    """
    fmt = get_format(kv_format)
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise ValueError(f"page_size: expected an int >= 1, got {page_size!r}")
    if kv.ndim != 2 or kv.shape[-1] != fmt.d_qk:
        raise ValueError(f"kv: expected [num_tokens, {fmt.d_qk}] for format {fmt.key}, got {_shape_text(kv)}")
    n = kv.shape[0]
    num_pages = max(1, -(-n // page_size))
    kv = jnp.pad(kv, ((0, num_pages * page_size - n), (0, 0)))
    data, scales = encode_rows(kv, fmt)
    if not fmt.quantized:
        return data.reshape(num_pages, page_size, fmt.d_qk)
    # Padding tokens are all-zero bytes (docs/formats.md), not encoded zero rows (whose scales are nonzero).
    real = (jnp.arange(num_pages * page_size) < n)[:, None]
    data = jnp.where(real, data, jnp.uint8(0))
    scales = jnp.where(real, scales, jnp.uint8(0))
    if fmt.layout == Layout.INLINE:
        return data.reshape(num_pages, page_size, fmt.bytes_per_token)
    page = jnp.concatenate([data.reshape(num_pages, -1), scales.reshape(num_pages, -1)], axis=-1)
    return page.reshape(num_pages, page_size, fmt.bytes_per_token)


def update_kv(cache, slots, kv, kv_format: Union[str, KVFormat], page_size: Optional[int] = None):
    """Writes the quantized rows of ``kv`` at global ``slots`` (the per-step cache write).

    Args:
      cache: a cache of ``kv_format`` in any accepted shape (docs/formats.md, cache shapes).
      slots: int32 ``[n]`` global slots; negative or out-of-range slots are skipped.
      kv: ``[n, d_qk]`` float32 or bfloat16.
      kv_format: format key or :class:`KVFormat`.
      page_size: required for the 2-D quantized form.

    Returns:
      The cache (same shape and dtype) with those rows replaced and every other byte unchanged.
      Donate ``cache`` to ``jax.jit`` to update it in place.

    Raises:
      TypeError: a wrong dtype of ``cache``, ``slots`` or ``kv``.
      ValueError: a cache shape the format does not accept, or ``slots``/``kv`` not ``[n]``/``[n, d_qk]``.
    """
    fmt = get_format(kv_format)
    layout = cache_layout(cache, fmt, page_size)
    slots = jnp.asarray(slots)
    if slots.dtype != jnp.int32:
        raise TypeError(f"slots: expected int32 [n], got {_shape_text(slots)}")
    if slots.ndim != 1 or kv.ndim != 2 or kv.shape[0] != slots.shape[0]:
        raise ValueError(f"slots/kv: expected int32 [n] and [n, {fmt.d_qk}], got {_shape_text(slots)} and "
                         f"{_shape_text(kv)}")
    data, scales = encode_rows(kv, fmt)
    pages = _as_pages(cache, layout)
    valid = (slots >= 0) & (slots < layout.num_slots)
    page = jnp.where(valid, slots // layout.page_size, layout.num_pages)  # out of range: dropped
    row = slots % layout.page_size
    if not fmt.quantized:
        cols = row[:, None] * fmt.d_qk + jnp.arange(fmt.d_qk)[None, :]
        pages = pages.at[page[:, None], cols].set(data, mode="drop")
    else:
        cols = row[:, None] * layout.row_stride + jnp.arange(data.shape[-1])[None, :]
        pages = pages.at[page[:, None], cols].set(data, mode="drop")
        if fmt.layout == Layout.FOOTER:
            base = layout.page_size * layout.row_stride
            cols = base + row[:, None] * fmt.scale_row_bytes + jnp.arange(fmt.scale_row_bytes)[None, :]
            pages = pages.at[page[:, None], cols].set(scales, mode="drop")
        if cache.dtype != jnp.uint8:
            pages = jax.lax.bitcast_convert_type(pages, cache.dtype)
    return pages.reshape(cache.shape)


# --------------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------------

def gather_rows(cache, layout: CacheLayout, kv_format: Union[str, KVFormat], slots):
    """Gathers the raw bytes of ``slots`` (any shape, must be valid or will be clamped).

    Returns ``(data, scales)``: uint8 ``[..., data_row_bytes]`` and ``[..., scale_row_bytes]`` (footer;
    ``None`` otherwise). For ``bf16_*`` returns ``(bfloat16 [..., d_qk], None)``.
    """
    fmt = get_format(kv_format)
    pages = _as_pages(cache, layout)
    slots = jnp.clip(slots, 0, max(layout.num_slots - 1, 0))
    page = slots // layout.page_size
    row = slots % layout.page_size
    if not fmt.quantized:
        cols = row[..., None] * fmt.d_qk + jnp.arange(fmt.d_qk)
        return pages[page[..., None], cols], None
    cols = row[..., None] * layout.row_stride + jnp.arange(fmt.data_row_bytes)
    data = pages[page[..., None], cols]
    scales = None
    if fmt.layout == Layout.FOOTER:
        base = layout.page_size * layout.row_stride
        cols = base + row[..., None] * fmt.scale_row_bytes + jnp.arange(fmt.scale_row_bytes)
        scales = pages[page[..., None], cols]
    return data, scales


def decode_rows(data, scales, kv_format: Union[str, KVFormat]):
    """Dequantizes gathered rows (see :func:`gather_rows`) to float32 ``[..., d_qk]``."""
    fmt = get_format(kv_format)
    if not fmt.quantized:
        return data.astype(jnp.float32)
    lead = data.shape[:-1]
    if fmt.quant_bits == 4:
        packed = data[..., : fmt.quant_bytes]
        codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*lead, fmt.quant_dim)
        quant = _e2m1_values(codes)
    else:
        quant = jax.lax.bitcast_convert_type(data[..., : fmt.quant_dim], jnp.float8_e4m3fn).astype(jnp.float32)
    source = data if fmt.layout == Layout.INLINE else scales
    offset = fmt.scale_offset
    raw = source[..., offset: offset + fmt.num_groups * fmt.scale_bytes]
    if fmt.scale_kind == ScaleKind.FP32:
        scale = jax.lax.bitcast_convert_type(raw.reshape(*lead, fmt.num_groups, 4), jnp.float32)
    elif fmt.scale_kind == ScaleKind.E4M3:
        scale = jax.lax.bitcast_convert_type(raw, jnp.float8_e4m3fn).astype(jnp.float32)
    else:
        exponent = raw.astype(jnp.uint32)
        scale = jnp.where(exponent == 0,
                          jnp.float32(2.0 ** -127),
                          jax.lax.bitcast_convert_type(exponent << 23, jnp.float32))
        scale = jnp.where(exponent == 255, jnp.float32(jnp.nan), scale)
    k = (quant.reshape(*lead, fmt.num_groups, fmt.group_size) * scale[..., None]).reshape(*lead, fmt.quant_dim)
    if fmt.bf16_dim:
        raw16 = data[..., fmt.bf16_offset: fmt.bf16_offset + 2 * fmt.bf16_dim].reshape(*lead, fmt.bf16_dim, 2)
        rope = jax.lax.bitcast_convert_type(raw16, jnp.bfloat16).astype(jnp.float32)
        k = jnp.concatenate([k, rope], axis=-1)
    return k


def all_rows(cache, layout: CacheLayout, kv_format: Union[str, KVFormat]):
    """The raw bytes of every slot, in slot order, without a gather (static slices of the pages).

    Returns ``(data, scales)`` like :func:`gather_rows` over ``arange(num_slots)``: uint8
    ``[num_slots, data_row_bytes]`` and ``[num_slots, scale_row_bytes]`` (footer; ``None`` otherwise);
    for ``bf16_*`` ``(bfloat16 [num_slots, d_qk], None)``. Bytes past a page's last row are not used.
    """
    fmt = get_format(kv_format)
    pages = _as_pages(cache, layout)
    num_pages, page_size = layout.num_pages, layout.page_size
    if not fmt.quantized:
        return pages.reshape(num_pages * page_size, fmt.d_qk), None
    rows = page_size * layout.row_stride
    data = pages[:, :rows].reshape(num_pages, page_size, layout.row_stride)[..., : fmt.data_row_bytes]
    scales = None
    if fmt.layout == Layout.FOOTER:
        tail = pages[:, rows: rows + page_size * fmt.scale_row_bytes]
        scales = tail.reshape(num_pages * page_size, fmt.scale_row_bytes)
    return data.reshape(num_pages * page_size, fmt.data_row_bytes), scales


def bf16_rows(cache, layout: CacheLayout, kv_format: Union[str, KVFormat]):
    """Every slot of a cache dequantized and rounded to bfloat16 ``[num_slots, d_qk]``, in slot order: the
    copy a staged CUDA plan reads (docs/planning.md). Exact for the formats whose values BF16 holds
    (``planner.staging_format``)."""
    return decode_rows(*all_rows(cache, layout, kv_format), kv_format).astype(jnp.bfloat16)


def dequantize_kv(cache, kv_format: Union[str, KVFormat], page_size: Optional[int] = None):
    """Dequantizes every slot of a cache.

    Args:
      cache: a cache of ``kv_format`` in any accepted shape (docs/formats.md, cache shapes).
      kv_format: format key or :class:`KVFormat`.
      page_size: required for the 2-D quantized form.

    Returns:
      ``(k, v)``: float32 ``[num_slots, d_qk]`` and ``[num_slots, d_v]`` (``v = k[:, :d_v]``).
    """
    fmt = get_format(kv_format)
    layout = cache_layout(cache, fmt, page_size)
    slots = jnp.arange(layout.num_slots, dtype=jnp.int32)
    k = decode_rows(*gather_rows(cache, layout, fmt, slots), fmt)
    return k, k[:, : fmt.d_v]
