"""An independent float64 numpy oracle for jax_sparse_mla, written from docs/formats.md and
docs/semantics.md.

Nothing here imports ``jax_sparse_mla``: the format table, cache geometry, byte-level decoding, the
quantizer and the attention semantics are re-derived from the documentation so that the library's
Python and C++ paths are checked against a third, simple implementation.

Conventions: caches are numpy arrays (uint8 / int8 / float8_e4m3fn views of the same bytes, or
``ml_dtypes.bfloat16`` for the ``bf16_*`` formats). A *page image* is the packed bytes of one page
(``page_size * bytes_per_token`` bytes); the accepted cache shapes (docs/formats.md) are built from
page images.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import ml_dtypes
import numpy as np

FP8_MAX = np.float32(448.0)
AMAX_FLOOR = np.float32(1e-4)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One row of the format table (docs/formats.md), with the byte layout spelled out."""

    key: str
    kind: str  # "inline", "footer" or "bf16"
    d_qk: int
    d_v: int
    bytes_per_token: int
    quant_lanes: int  # leading K lanes stored quantized (FP8, or FP4 when bits == 4)
    bf16_lanes: int  # trailing K lanes stored as BF16 (rope), or the whole row for bf16_*
    group: int  # quantized lanes per scale
    scale: Optional[str]  # "fp32", "ue8m0", "e4m3" or None
    pow2: bool  # power-of-two scales from quantize_kv
    quant_offset: int  # byte offset of the quantized lanes in the (data) row
    scale_offset: int  # inline: offset of the scales in the row; footer: offset in the scale row
    bf16_offset: int  # offset of the BF16 lanes in the (data) row
    data_row: int  # footer: bytes of a data row; inline: bytes/token; bf16: 2*d_qk
    scale_row: int  # footer: bytes of a scale row; 0 otherwise
    window: int  # 0 = none
    dual: bool
    bits: int = 8  # bits of a quantized lane: 8 (e4m3) or 4 (e2m1, lane 2i in the low nibble of byte i)

    @property
    def groups(self) -> int:
        return self.quant_lanes // self.group if self.group else 0

    @property
    def quantized(self) -> bool:
        return self.kind != "bf16"

    @property
    def scale_width(self) -> int:
        return {"fp32": 4, "ue8m0": 1, "e4m3": 1, None: 0}[self.scale]


SPECS = {
    s.key: s
    for s in (
        # [0,512) FP8 nope, 4 groups of 128; [512,528) four FP32 scales; [528,656) 64 BF16 rope.
        Spec("dsv3_2", "inline", 576, 512, 656, 512, 64, 128, "fp32", True, 0, 512, 528, 656, 0, 0, False),
        Spec("glm_nsa", "inline", 576, 512, 656, 512, 64, 128, "fp32", False, 0, 512, 528, 656, 0, 0, False),
        # [0,512) FP8, [512,528) four FP32 scales, nothing else.
        Spec("glm53_nope", "inline", 512, 512, 528, 512, 0, 128, "fp32", False, 0, 512, 528, 528, 0, 0, False),
        # data row 576 = FP8 nope(448, 7x64) ++ BF16 rope(64); scale row 8 = 7 UE8M0 + 1 pad.
        Spec("dsv4", "footer", 512, 512, 584, 448, 64, 64, "ue8m0", True, 0, 0, 448, 576, 8, 0, True),
        # data row 512 = FP8(512, 16x32); scale row 16 = 16 UE8M0.
        Spec("dsv4_1", "footer", 512, 512, 528, 512, 0, 32, "ue8m0", True, 0, 0, 512, 512, 16, 0, True),
        # data row 1152 = FP8 nope(1024, 8x128) ++ BF16 rope(64); scale row 8 = 8 UE8M0; window 513.
        Spec("dots3_swa", "footer", 1088, 1024, 1160, 1024, 64, 128, "ue8m0", True, 0, 0, 1024, 1152, 8, 513,
             False),
        Spec("bf16_576", "bf16", 576, 512, 1152, 0, 576, 0, None, False, 0, 0, 0, 1152, 0, 0, False),
        Spec("bf16_512", "bf16", 512, 512, 1024, 0, 512, 0, None, False, 0, 0, 0, 1024, 0, 0, False),
        # data row 352 = FP4 nope(448, 224 bytes) ++ BF16 rope(64); scale row 32 = 28 E4M3 (per 16) + 4 pad.
        Spec("dsv4_nvfp4", "footer", 512, 512, 384, 448, 64, 16, "e4m3", False, 0, 0, 224, 352, 32, 0, True, bits=4),
        # data row 256 = FP4(512); scale row 32 = 32 E4M3 (per 16).
        Spec("dsv4_1_fp4", "footer", 512, 512, 288, 512, 0, 16, "e4m3", False, 0, 0, 256, 256, 32, 0, True, bits=4),
    )
}

QUANTIZED = [k for k, s in SPECS.items() if s.quantized]
INLINE = [k for k, s in SPECS.items() if s.kind == "inline"]
FOOTER = [k for k, s in SPECS.items() if s.kind == "footer"]
BF16 = [k for k, s in SPECS.items() if s.kind == "bf16"]
DUAL = [k for k, s in SPECS.items() if s.dual]


def min_3d_page_multiple(key: str) -> int:
    """Smallest page size step for which the 3-D/4-D form is legal (footer: page bytes % 16 == 0)."""
    spec = SPECS[key]
    if spec.kind != "footer":
        return 1
    return 16 // np.gcd(spec.bytes_per_token, 16)


# --------------------------------------------------------------------------------------------------
# Geometry (docs/formats.md, cache shapes and page rules)
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Geometry:
    num_pages: int
    page_size: int
    page_stride: int  # bytes between pages
    row_stride: int  # bytes between (data) rows inside a page

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size


def _page_axis_dims(shape):
    """[N, P, R], NHD [N, P, 1, R] or HND [N, 1, P, R] -> (N, P, R)."""
    if len(shape) == 3:
        return tuple(shape)
    if len(shape) == 4 and shape[2] == 1:
        return shape[0], shape[1], shape[3]
    if len(shape) == 4 and shape[1] == 1:
        return shape[0], shape[2], shape[3]
    raise ValueError(f"not a cache shape: {shape}")


def geometry(shape, key: str, page_size: Optional[int] = None) -> Geometry:
    """Where the slots of a cache of this shape live, derived from docs/formats.md alone (no validation)."""
    spec = SPECS[key]
    shape = tuple(int(d) for d in shape)
    if spec.kind == "bf16":
        row = 2 * spec.d_qk
        if len(shape) == 2:
            return Geometry(shape[0], 1, row, row)
        pages, tokens, _ = _page_axis_dims(shape)
        return Geometry(pages, tokens, tokens * row, row)
    data_row = spec.data_row if spec.kind == "footer" else spec.bytes_per_token
    if len(shape) == 2:
        assert page_size is not None
        return Geometry(shape[0], page_size, shape[1], data_row)
    pages, tokens, row_bytes = _page_axis_dims(shape)
    if spec.kind == "footer":
        return Geometry(pages, tokens, tokens * spec.bytes_per_token, data_row)
    return Geometry(pages, tokens, tokens * row_bytes, row_bytes)


def slot_byte_ranges(geom: Geometry, key: str, slot: int):
    """The [start, stop) byte ranges a slot's payload occupies in the flattened cache."""
    spec = SPECS[key]
    page, row = divmod(int(slot), geom.page_size)
    base = page * geom.page_stride
    if spec.kind == "footer":
        data = base + row * geom.row_stride
        scales = base + geom.page_size * geom.row_stride + row * spec.scale_row
        return [(data, data + spec.data_row), (scales, scales + spec.scale_row)]
    start = base + row * geom.row_stride
    return [(start, start + (spec.data_row if spec.kind == "bf16" else spec.bytes_per_token))]


def cache_bytes(cache: np.ndarray) -> np.ndarray:
    """The flattened little-endian bytes of a cache of any accepted dtype."""
    return np.ascontiguousarray(cache).view(np.uint8).reshape(-1)


# --------------------------------------------------------------------------------------------------
# Byte-level decoding
# --------------------------------------------------------------------------------------------------

def _fp8_to_f64(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _bf16_to_f64(b: np.ndarray) -> np.ndarray:
    """Little-endian byte pairs [..., 2n] -> float64 [..., n] (bf16 is the top half of a float32)."""
    b = b.astype(np.uint32)
    bits = (b[..., 0::2] | (b[..., 1::2] << 8)) << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def _fp32_to_f64(b: np.ndarray) -> np.ndarray:
    b = b.astype(np.uint32)
    bits = b[..., 0::4] | (b[..., 1::4] << 8) | (b[..., 2::4] << 16) | (b[..., 3::4] << 24)
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _fp4_to_f64(b: np.ndarray) -> np.ndarray:
    """Packed FP4 bytes [..., n] -> float64 [..., 2n]: lane 2i is the low nibble of byte i."""
    b = np.asarray(b, np.uint8)
    codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], -1)
    return np.where(codes & 8, -1.0, 1.0) * E2M1_MAGNITUDES[codes & 7]


def _ue8m0_to_f64(b: np.ndarray) -> np.ndarray:
    return np.where(b == 255, np.nan, np.ldexp(1.0, b.astype(np.int64) - 127))


def decode_tokens(data: np.ndarray, scales: Optional[np.ndarray], key: str) -> np.ndarray:
    """Dequantizes token payloads: data [n, data_row] (inline: the whole row), scales [n, scale_row]."""
    spec = SPECS[key]
    n = data.shape[0]
    if spec.kind == "bf16":
        return _bf16_to_f64(data[:, : 2 * spec.d_qk])
    if spec.bits == 4:
        quant = _fp4_to_f64(data[:, spec.quant_offset: spec.quant_offset + spec.quant_lanes // 2])
    else:
        quant = _fp8_to_f64(data[:, spec.quant_offset: spec.quant_offset + spec.quant_lanes])
    source = data if spec.kind == "inline" else scales
    raw = source[:, spec.scale_offset: spec.scale_offset + spec.groups * spec.scale_width]
    scale = {"fp32": _fp32_to_f64, "ue8m0": _ue8m0_to_f64, "e4m3": _fp8_to_f64}[spec.scale](raw)
    k = (quant.reshape(n, spec.groups, spec.group) * scale[:, :, None]).reshape(n, spec.quant_lanes)
    if spec.bf16_lanes:
        rope = _bf16_to_f64(data[:, spec.bf16_offset: spec.bf16_offset + 2 * spec.bf16_lanes])
        k = np.concatenate([k, rope], axis=1)
    return k


def read_slots(cache: np.ndarray, key: str, slots, page_size: Optional[int] = None):
    """Raw (data, scales) bytes of ``slots`` read through the cache geometry (docs/formats.md)."""
    spec = SPECS[key]
    geom = geometry(cache.shape, key, page_size)
    raw = cache_bytes(cache)
    slots = np.asarray(slots, np.int64)
    page, row = slots // geom.page_size, slots % geom.page_size
    base = page * geom.page_stride
    data_width = spec.data_row if spec.kind != "inline" else spec.bytes_per_token
    data = raw[(base + row * geom.row_stride)[:, None] + np.arange(data_width)[None, :]]
    scales = None
    if spec.kind == "footer":
        start = base + geom.page_size * geom.row_stride + row * spec.scale_row
        scales = raw[start[:, None] + np.arange(spec.scale_row)[None, :]]
    return data, scales


def decode(cache: np.ndarray, key: str, page_size: Optional[int] = None) -> np.ndarray:
    """float64 K [num_slots, d_qk] of every slot of a cache (V is the first d_v lanes)."""
    geom = geometry(cache.shape, key, page_size)
    return decode_tokens(*read_slots(cache, key, np.arange(geom.num_slots), page_size), key)


# --------------------------------------------------------------------------------------------------
# Quantization (docs/formats.md, building, updating and reading caches)
# --------------------------------------------------------------------------------------------------

def pow2_exponent(ratio: np.ndarray) -> np.ndarray:
    """k with 2^k = 2^ceil(log2(ratio)), exactly, for positive normal float32 ratios (via frexp)."""
    mantissa, exponent = np.frexp(ratio.astype(np.float64))  # ratio = mantissa * 2^exponent, m in [0.5, 1)
    return np.where(mantissa == 0.5, exponent - 1, exponent).astype(np.int64)


def quantize_query_fp8(q: np.ndarray) -> np.ndarray:
    """The query of precision="fp8" (docs/semantics.md) as float64: per (row, head, 64 lanes) a
    power-of-two scale from amax (floor 1e-30) and saturating round-to-nearest-even e4m3 values."""
    x = np.asarray(q).astype(np.float32)
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // 64, 64)
    amax = np.maximum(np.abs(groups).max(axis=-1), np.float32(1e-30)).astype(np.float32)
    scale = np.ldexp(np.float32(1.0), pow2_exponent((amax / FP8_MAX).astype(np.float32))).astype(np.float32)
    scaled = (groups / scale[..., None]).astype(np.float32)
    fp8 = np.clip(scaled, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return (fp8 * scale[..., None].astype(np.float64)).reshape(x.shape)


def encode_tokens(kv: np.ndarray, key: str):
    """Quantizes rows [n, d_qk] -> (data uint8 [n, data bytes], scales uint8 [n, scale_row]).

    For inline formats ``data`` is the whole bytes/token row and ``scales`` is [n, 0]; for bf16
    formats ``data`` is the little-endian bf16 row.
    """
    spec = SPECS[key]
    x = np.asarray(kv).astype(np.float32)
    n = x.shape[0]
    assert x.shape[1] == spec.d_qk and np.all(np.isfinite(x))
    if spec.kind == "bf16":
        return x.astype(ml_dtypes.bfloat16).view(np.uint8).reshape(n, -1), np.zeros((n, 0), np.uint8)
    nope = x[:, : spec.quant_lanes].reshape(n, spec.groups, spec.group)
    amax = np.maximum(np.abs(nope).max(axis=-1), AMAX_FLOOR).astype(np.float32)
    if spec.bits == 4:
        return _encode_fp4_tokens(x, nope, amax, spec)
    if spec.pow2:
        k = pow2_exponent(amax / FP8_MAX)
        scale = np.ldexp(np.float32(1.0), k).astype(np.float32)
    else:
        scale = (amax / FP8_MAX).astype(np.float32)
    scaled = (nope / scale[:, :, None]).astype(np.float32)
    fp8 = np.clip(scaled, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).reshape(n, -1)
    if spec.scale == "fp32":
        scale_bytes = scale.astype("<f4").view(np.uint8).reshape(n, -1)
    else:
        scale_bytes = (k + 127).astype(np.uint8)
    rope = x[:, spec.quant_lanes:].astype(ml_dtypes.bfloat16).view(np.uint8).reshape(n, -1)
    if spec.kind == "inline":
        row = np.zeros((n, spec.bytes_per_token), np.uint8)
        row[:, spec.quant_offset: spec.quant_offset + spec.quant_lanes] = fp8
        row[:, spec.scale_offset: spec.scale_offset + scale_bytes.shape[1]] = scale_bytes
        row[:, spec.bf16_offset: spec.bf16_offset + rope.shape[1]] = rope
        return row, np.zeros((n, 0), np.uint8)
    data = np.zeros((n, spec.data_row), np.uint8)
    data[:, spec.quant_offset: spec.quant_offset + spec.quant_lanes] = fp8
    data[:, spec.bf16_offset: spec.bf16_offset + rope.shape[1]] = rope
    scales = np.zeros((n, spec.scale_row), np.uint8)  # the dsv4 pad byte stays zero
    scales[:, spec.scale_offset: spec.scale_offset + scale_bytes.shape[1]] = scale_bytes
    return data, scales


def e2m1_round(v: np.ndarray) -> np.ndarray:
    """Codes (uint8, sign in bit 3) of float32 values rounded to the nearest E2M1 value, saturating at ±6;
    a tie goes to the even code (found by distance to every grid value, not by thresholds)."""
    v = np.asarray(v, np.float32)
    magnitude = np.minimum(np.abs(v).astype(np.float64), 6.0)
    distance = np.abs(magnitude[..., None] - E2M1_MAGNITUDES)
    best = distance.min(axis=-1, keepdims=True)
    candidates = np.where(distance == best, np.arange(8), 99)
    even = np.where(candidates % 2 == 0, candidates, 99).min(axis=-1)
    code = np.where(even < 99, even, candidates.min(axis=-1)).astype(np.uint8)
    return code | (np.signbit(v).astype(np.uint8) << 3)


def _encode_fp4_tokens(x, nope, amax, spec):
    """FP4 rows: E4M3 scale = e4m3(clamp(amax / 6, 2^-9, 448)), E2M1 codes of x / scale, packed in pairs."""
    n = x.shape[0]
    ratio = (amax / np.float32(6.0)).astype(np.float32)
    scale8 = np.clip(ratio, np.float32(2.0 ** -9), FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    scale = scale8.astype(np.float32)
    codes = e2m1_round((nope / scale[:, :, None]).astype(np.float32)).reshape(n, -1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    data = np.zeros((n, spec.data_row), np.uint8)
    data[:, spec.quant_offset: spec.quant_offset + packed.shape[1]] = packed
    rope = x[:, spec.quant_lanes:].astype(ml_dtypes.bfloat16).view(np.uint8).reshape(n, -1)
    data[:, spec.bf16_offset: spec.bf16_offset + rope.shape[1]] = rope
    scales = np.zeros((n, spec.scale_row), np.uint8)  # the dsv4_nvfp4 pad bytes stay zero
    scales[:, : spec.groups] = scale8.view(np.uint8)
    return data, scales


def quantize(kv: np.ndarray, key: str, page_size: int = 64) -> np.ndarray:
    """What ``quantize_kv`` must return: uint8 [pages, page_size, bytes/token] (bf16: [.., d_qk]).

    Tokens past ``num_tokens`` (padding up to a whole page) are all-zero bytes.
    """
    spec = SPECS[key]
    n = kv.shape[0]
    pages = max(1, -(-n // page_size))
    data, scales = encode_tokens(kv, key)
    if spec.kind == "bf16":
        out = np.zeros((pages * page_size, spec.d_qk), ml_dtypes.bfloat16)
        out[:n] = np.asarray(kv).astype(np.float32).astype(ml_dtypes.bfloat16)
        return out.reshape(pages, page_size, spec.d_qk)
    if spec.kind == "inline":
        rows = np.zeros((pages * page_size, spec.bytes_per_token), np.uint8)
        rows[:n] = data
        return rows.reshape(pages, page_size, spec.bytes_per_token)
    all_data = np.zeros((pages * page_size, spec.data_row), np.uint8)
    all_scales = np.zeros((pages * page_size, spec.scale_row), np.uint8)
    all_data[:n], all_scales[:n] = data, scales
    image = np.concatenate([all_data.reshape(pages, -1), all_scales.reshape(pages, -1)], axis=1)
    return image.reshape(pages, page_size, spec.bytes_per_token)


# --------------------------------------------------------------------------------------------------
# Cache forms
# --------------------------------------------------------------------------------------------------

def make_cache(pages: np.ndarray, key: str, form: str = "3d", *, row_bytes: Optional[int] = None,
               page_bytes: Optional[int] = None, fill: int = 0xFF) -> np.ndarray:
    """Lays out quantize()'s pages in one of the accepted cache shapes; padding bytes are ``fill``.

    form: "3d", "nhd", "hnd", "2d" (quantized: [pages, page_bytes]; bf16: [slots, d_qk]).
    row_bytes: inline formats, padded row width (3-D/4-D). page_bytes: 2-D quantized page width.
    """
    spec = SPECS[key]
    num_pages, page_size, width = pages.shape
    if spec.kind == "bf16":
        if form == "2d":
            return pages.reshape(num_pages * page_size, width).copy()
        rows = pages.copy()
    elif form == "2d":
        packed = pages.reshape(num_pages, page_size * width)
        page_bytes = page_bytes or packed.shape[1]
        out = np.full((num_pages, page_bytes), fill, np.uint8)
        out[:, : packed.shape[1]] = packed
        return out
    else:
        row_bytes = row_bytes or width
        rows = np.full((num_pages, page_size, row_bytes), fill, np.uint8)
        rows[:, :, :width] = pages
    if form == "3d":
        return rows
    if form == "nhd":
        return rows[:, :, None, :]
    if form == "hnd":
        return rows[:, None, :, :]
    raise ValueError(form)


def poison(cache: np.ndarray, key: str, keep_slots, page_size: Optional[int] = None) -> np.ndarray:
    """Copy of ``cache`` with every byte of every slot not in ``keep_slots`` set to 0xFF (NaN)."""
    geom = geometry(cache.shape, key, page_size)
    out = np.ascontiguousarray(cache).copy()
    raw = cache_bytes(out)
    doomed = np.setdiff1d(np.arange(geom.num_slots), np.asarray(keep_slots, np.int64).reshape(-1))
    for slot in doomed:
        for start, stop in slot_byte_ranges(geom, key, slot):
            raw[start:stop] = 0xFF
    return out


# --------------------------------------------------------------------------------------------------
# Attention semantics (docs/semantics.md)
# --------------------------------------------------------------------------------------------------

def valid_candidates(indices, num_slots: int, topk_length=None, window: int = 0) -> np.ndarray:
    """bool [T, k]: in range, before the clamped topk_length, before the format's window."""
    indices = np.asarray(indices, np.int64)
    k = indices.shape[-1]
    position = np.arange(k)[None, :]
    valid = (indices >= 0) & (indices < num_slots)
    if topk_length is not None:
        valid &= position < np.clip(np.asarray(topk_length, np.int64), 0, k)[:, None]
    if window:
        valid &= position < window
    return valid


@dataclasses.dataclass
class CandidateSource:
    """One candidate list: decoded keys [num_slots, d_qk], indices [T, k], optional lengths [T]."""

    keys: np.ndarray
    indices: np.ndarray
    topk_length: Optional[np.ndarray] = None

    def mask(self, window: int) -> np.ndarray:
        return valid_candidates(self.indices, self.keys.shape[0], self.topk_length, window)


def attention(q, sources: Sequence[CandidateSource], *, key: str, sm_scale: float, attn_sink=None,
              valid_tokens=None, window: Optional[int] = None):
    """float64 (out [T, H, d_v], lse [T, H]) per docs/semantics.md; the softmax is joint over all sources.

    ``window`` overrides the format's candidate window (tests use 0 to show the window matters).
    """
    spec = SPECS[key]
    window = spec.window if window is None else window
    q = np.asarray(q).astype(np.float64)
    num_tokens, num_heads, _ = q.shape
    out = np.zeros((num_tokens, num_heads, spec.d_v))
    lse = np.full((num_tokens, num_heads), -np.inf)
    rows = num_tokens
    if valid_tokens is not None:
        rows = int(np.clip(int(np.asarray(valid_tokens).reshape(())), 0, num_tokens))
    sink = None if attn_sink is None else np.asarray(attn_sink, np.float64)
    masks = [s.mask(window) for s in sources]
    for t in range(rows):
        keys = np.concatenate([s.keys[s.indices[t][m[t]]] for s, m in zip(sources, masks)], axis=0)
        scores = sm_scale * (q[t] @ keys.T)  # [H, n]
        assert np.all(np.isfinite(scores)), "a valid candidate decoded to a non-finite value"
        for h in range(num_heads):
            logits = list(scores[h])
            if sink is not None:
                if sink[h] == np.inf:
                    lse[t, h] = np.inf
                    continue
                if sink[h] > -np.inf:
                    logits.append(sink[h])
            if not logits:
                continue
            logits = np.array(logits)
            top = logits.max()
            lse[t, h] = top + np.log(np.exp(logits - top).sum())
            out[t, h] = np.exp(scores[h] - lse[t, h]) @ keys[:, : spec.d_v]
    return out, lse


def merge_states(out_a, lse_a, out_b, lse_b):
    """float64 merge of two attention states over disjoint candidate sets."""
    out_a, out_b = np.asarray(out_a, np.float64), np.asarray(out_b, np.float64)
    lse_a, lse_b = np.asarray(lse_a, np.float64), np.asarray(lse_b, np.float64)
    lse = np.logaddexp(lse_a, lse_b)
    finite = np.isfinite(lse)
    safe = np.where(finite, lse, 0.0)
    with np.errstate(invalid="ignore"):
        wa = np.where(finite & (lse_a > -np.inf), np.exp(lse_a - safe), 0.0)
        wb = np.where(finite & (lse_b > -np.inf), np.exp(lse_b - safe), 0.0)
    out = np.where(wa[..., None] > 0, wa[..., None] * out_a, 0.0) + np.where(wb[..., None] > 0,
                                                                             wb[..., None] * out_b, 0.0)
    return out, lse


# --------------------------------------------------------------------------------------------------
# The accuracy contract (docs/semantics.md, accuracy contract)
# --------------------------------------------------------------------------------------------------

def check_accuracy(out, lse, ref_out, ref_lse, *, out_tol=2e-2, l2_tol=1e-2, lse_tol=1e-3):
    """Asserts the accuracy contract (docs/semantics.md). Rows whose reference is empty (lse ±inf) must be
    exactly zero."""
    out = np.asarray(out).astype(np.float64)
    lse = np.asarray(lse).astype(np.float64)
    assert out.shape == ref_out.shape, (out.shape, ref_out.shape)
    assert lse.shape == ref_lse.shape, (lse.shape, ref_lse.shape)
    assert not np.isnan(out).any(), "NaN in out"
    assert not np.isnan(lse).any(), "NaN in lse"
    for sign in (np.inf, -np.inf):
        np.testing.assert_array_equal(lse == sign, ref_lse == sign, err_msg=f"lse == {sign} positions differ")
    finite = np.isfinite(ref_lse)
    if finite.any():
        lse_err = np.abs(lse[finite] - ref_lse[finite]).max()
        assert lse_err <= lse_tol, f"max |lse - ref| = {lse_err} > {lse_tol}"
    empty = ~finite
    assert np.all(out[empty] == 0), "rows with an empty reference state must have out == 0"
    err = np.abs(out - ref_out).max() if out.size else 0.0
    bound = out_tol * max(1.0, np.abs(ref_out).max() if out.size else 0.0)
    assert err <= bound, f"max |out - ref| = {err} > {bound}"
    ref_norm = np.linalg.norm(ref_out)
    if ref_norm > 0:
        rel = np.linalg.norm(out - ref_out) / ref_norm
        assert rel <= l2_tol, f"relative L2 error {rel} > {l2_tol}"
    else:
        assert np.all(out == 0)
