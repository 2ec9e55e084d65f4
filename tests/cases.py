"""Builders shared by the tests: random inputs, caches in every accepted shape (docs/formats.md), attention cases."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jax_sparse_mla as jsm
import oracle

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


# --------------------------------------------------------------------------------------------------
# Random data
# --------------------------------------------------------------------------------------------------

def random_kv(rng, num_tokens: int, d: int, dtype=np.float32) -> np.ndarray:
    """Latent rows with per-token and per-lane magnitude spread, so groups get different scales."""
    token_scale = np.exp(rng.uniform(-1.5, 1.5, (num_tokens, 1)))
    lane_scale = np.exp(rng.uniform(-1.0, 1.0, (1, d)))
    x = (rng.standard_normal((num_tokens, d)) * token_scale * lane_scale).astype(np.float32)
    return x.astype(dtype)


def random_q(rng, shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(ml_dtypes.bfloat16)


INVALID_INDEX_KINDS = ("-1", "negative", "int32_min", "num_slots", "past_end", "int32_max")


def invalid_index(rng, kind: str, num_slots: int) -> int:
    return {"-1": -1, "negative": int(rng.integers(-1000, -1)), "int32_min": INT32_MIN, "num_slots": num_slots,
            "past_end": num_slots + int(rng.integers(1, 1000)), "int32_max": INT32_MAX}[kind]


def random_indices(rng, num_tokens: int, topk: int, num_slots: int, invalid_fraction: float = 0.25,
                   pool=None) -> np.ndarray:
    """int32 [T, topk] slots from ``pool`` (default: all slots), a fraction replaced by every kind of
    invalid index (-1, other negatives, num_slots, beyond, INT32_MIN/MAX)."""
    pool = np.arange(num_slots) if pool is None else np.asarray(pool)
    indices = rng.choice(pool, size=(num_tokens, topk)).astype(np.int64)
    bad = rng.random((num_tokens, topk)) < invalid_fraction
    kinds = rng.choice(INVALID_INDEX_KINDS, size=(num_tokens, topk))
    for t, j in zip(*np.nonzero(bad)):
        indices[t, j] = invalid_index(rng, kinds[t, j], num_slots)
    return indices.astype(np.int32)


# --------------------------------------------------------------------------------------------------
# Caches
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class CacheCase:
    """A cache built by the oracle: the array handed to the library and how to read it."""

    key: str
    array: np.ndarray
    page_size_arg: Optional[int]  # the page_size= to pass (2-D quantized form only)
    kv: np.ndarray  # the unquantized rows it was built from

    @property
    def geometry(self) -> oracle.Geometry:
        return oracle.geometry(self.array.shape, self.key, self.page_size_arg)

    @property
    def num_slots(self) -> int:
        return self.geometry.num_slots

    def keys(self) -> np.ndarray:
        return oracle.decode(self.array, self.key, self.page_size_arg)

    def poisoned(self, keep_slots) -> "CacheCase":
        return dataclasses.replace(self, array=oracle.poison(self.array, self.key, keep_slots, self.page_size_arg))

    def viewed(self, dtype) -> "CacheCase":
        return dataclasses.replace(self, array=self.array.view(dtype))


def padded_page_bytes(key: str, page_size: int, extra: int = 32) -> int:
    """A 16-aligned page width with a gap of at least ``extra`` bytes after the last token."""
    need = page_size * oracle.SPECS[key].bytes_per_token + extra
    return -(-need // 16) * 16


def build_cache(rng, key: str, num_tokens: int, page_size: int = 64, form: str = "3d", *,
                row_bytes: Optional[int] = None, page_bytes: Optional[int] = None, fill: int = 0xFF,
                kv_dtype=np.float32) -> CacheCase:
    """Quantizes random rows with the oracle and lays them out in ``form`` ("3d", "nhd", "hnd", "2d").

    For the 2-D quantized form ``page_bytes`` defaults to a padded page (a gap after the last token).
    """
    spec = oracle.SPECS[key]
    kv = random_kv(rng, num_tokens, spec.d_qk, kv_dtype)
    pages = oracle.quantize(kv, key, page_size)
    page_size_arg = None
    if form == "2d" and spec.quantized:
        page_bytes = page_bytes or padded_page_bytes(key, page_size)
        page_size_arg = page_size
    array = oracle.make_cache(pages, key, form, row_bytes=row_bytes, page_bytes=page_bytes, fill=fill)
    return CacheCase(key, array, page_size_arg, kv)


# --------------------------------------------------------------------------------------------------
# Attention cases
# --------------------------------------------------------------------------------------------------

STATIC_ARGS = ("kv_format", "sm_scale", "page_size", "extra_page_size", "impl", "batch_invariant", "precision",
               "extra_kv_format")


def call_sparse_mla(q, kv_cache, indices, **kwargs):
    """``sparse_mla`` under ``jax.jit`` (static arguments split off); returns numpy (out, lse)."""
    static = {k: kwargs.pop(k) for k in STATIC_ARGS if k in kwargs}
    arrays = {k: (None if v is None else jnp.asarray(v)) for k, v in kwargs.items()}

    @jax.jit
    def run(q, kv_cache, indices, arrays):
        return jsm.sparse_mla(q, kv_cache, indices, **static, **arrays)

    out, lse = run(jnp.asarray(q), jnp.asarray(kv_cache), jnp.asarray(indices), arrays)
    return np.asarray(out), np.asarray(lse)


@dataclasses.dataclass
class AttentionCase:
    key: str
    q: np.ndarray
    main: CacheCase
    indices: np.ndarray
    sm_scale: float
    topk_length: Optional[np.ndarray] = None
    attn_sink: Optional[np.ndarray] = None
    extra: Optional[CacheCase] = None
    extra_indices: Optional[np.ndarray] = None
    extra_topk_length: Optional[np.ndarray] = None
    valid_tokens: Optional[np.ndarray] = None

    def sources(self):
        sources = [oracle.CandidateSource(self.main.keys(), self.indices, self.topk_length)]
        if self.extra is not None:
            sources.append(oracle.CandidateSource(self.extra.keys(), self.extra_indices, self.extra_topk_length))
        return sources

    def reference(self):
        return oracle.attention(self.q, self.sources(), key=self.key, sm_scale=self.sm_scale,
                                attn_sink=self.attn_sink, valid_tokens=self.valid_tokens)

    def kwargs(self, impl: str) -> dict:
        kw = dict(kv_format=self.key, sm_scale=self.sm_scale, impl=impl, topk_length=self.topk_length,
                  attn_sink=self.attn_sink, valid_tokens=self.valid_tokens)
        if self.main.page_size_arg is not None:
            kw["page_size"] = self.main.page_size_arg
        if self.extra is not None:
            kw.update(extra_kv_cache=self.extra.array, extra_indices=self.extra_indices,
                      extra_topk_length=self.extra_topk_length)
            if self.extra.key != self.key:
                kw["extra_kv_format"] = self.extra.key
            if self.extra.page_size_arg is not None:
                kw["extra_page_size"] = self.extra.page_size_arg
        return kw

    def run(self, impl: str):
        return call_sparse_mla(self.q, self.main.array, self.indices, **self.kwargs(impl))

    def check(self, impl: str):
        """Runs the library and asserts the accuracy contract (docs/semantics.md) against the float64 oracle."""
        out, lse = self.run(impl)
        ref_out, ref_lse = self.reference()
        oracle.check_accuracy(out, lse, ref_out, ref_lse)
        return out, lse, ref_out, ref_lse

    def poison_unused(self) -> "AttentionCase":
        """Every slot not referenced by a valid candidate (and every padding byte) becomes 0xFF."""
        window = oracle.SPECS[self.key].window
        keep = self.indices[oracle.valid_candidates(self.indices, self.main.num_slots, self.topk_length, window)]
        replaced = dataclasses.replace(self, main=self.main.poisoned(keep))
        if self.extra is not None:
            extra_keep = self.extra_indices[oracle.valid_candidates(
                self.extra_indices, self.extra.num_slots, self.extra_topk_length, window)]
            replaced = dataclasses.replace(replaced, extra=self.extra.poisoned(extra_keep))
        return replaced


def make_case(rng, key: str, *, num_tokens: int = 3, num_heads: int = 4, topk: int = 16, page_size: int = 64,
              cache_tokens: Optional[int] = None, form: str = "3d", row_bytes: Optional[int] = None,
              page_bytes: Optional[int] = None, invalid_fraction: float = 0.25, topk_length="random",
              attn_sink=None, valid_tokens=None, extra: Optional[dict] = None, poison: bool = True,
              sm_scale: Optional[float] = None, indices: Optional[np.ndarray] = None) -> AttentionCase:
    """A random attention case. ``topk_length``: "random" (values in [-2, topk+2]), None, or an array.

    ``extra``: dual-cache options (page_size, cache_tokens, form, topk, topk_length, page_bytes, kv_format).
    With ``poison`` every unused slot and padding byte of the caches is 0xFF (NaN everywhere).
    """
    spec = oracle.SPECS[key]
    cache_tokens = cache_tokens or max(3 * page_size + page_size // 2 + 1, 40)
    main = build_cache(rng, key, cache_tokens, page_size, form, row_bytes=row_bytes, page_bytes=page_bytes)
    if indices is None:
        indices = random_indices(rng, num_tokens, topk, main.num_slots, invalid_fraction)
    if isinstance(topk_length, str):
        topk_length = rng.integers(-2, topk + 3, num_tokens).astype(np.int32)
    if attn_sink is not None:
        attn_sink = np.asarray(attn_sink, np.float32)
    case = AttentionCase(key=key, q=random_q(rng, (num_tokens, num_heads, spec.d_qk)), main=main, indices=indices,
                         sm_scale=float(sm_scale if sm_scale is not None else spec.d_qk ** -0.5),
                         topk_length=topk_length, attn_sink=attn_sink, valid_tokens=valid_tokens)
    if extra is not None:
        extra = dict(extra)
        extra_page = extra.pop("page_size", 2)
        extra_tokens = extra.pop("cache_tokens", 3 * extra_page + 1)
        extra_topk = extra.pop("topk", 5)
        extra_length = extra.pop("topk_length", "random")
        extra_cache = build_cache(rng, extra.pop("kv_format", key), extra_tokens, extra_page, extra.pop("form", "3d"),
                                  page_bytes=extra.pop("page_bytes", None))
        assert not extra, extra
        if isinstance(extra_length, str):
            extra_length = rng.integers(-1, extra_topk + 2, num_tokens).astype(np.int32)
        case = dataclasses.replace(
            case, extra=extra_cache,
            extra_indices=random_indices(rng, num_tokens, extra_topk, extra_cache.num_slots, invalid_fraction),
            extra_topk_length=extra_length)
    return case.poison_unused() if poison else case


def rising_max_case(rng, key: str, *, num_heads: int):
    """Every head sees its candidates in ascending score order, ``sm_scale`` chosen so that each
    32-candidate tile's max exceeds the previous tile's by more than the kernels' lazy-max lag (8 in
    log2 units): the running max moves and the output accumulators are rescaled on every tile (on the
    Hopper kernels: on both halves of d_v)."""
    case = make_case(rng, key, num_tokens=2, num_heads=num_heads, topk=256, cache_tokens=700,
                     topk_length=None, invalid_fraction=0.0, poison=False)
    q = np.broadcast_to(case.q[:, :1], case.q.shape).copy()  # one query per token, every head
    keys = case.main.keys()
    indices = np.stack([rng.choice(case.main.num_slots, 256, replace=False) for _ in range(2)]).astype(np.int32)
    steps = []
    for t in range(2):
        scores = keys[indices[t]] @ q[t, 0].astype(np.float64)
        order = np.argsort(scores, kind="stable")
        indices[t] = indices[t][order]
        steps.append(np.diff(scores[order].reshape(-1, 32).max(axis=1)))
    # The smallest rise of a tile's max becomes 9 in the kernels' log2 domain (the lag is 8).
    sm_scale = 9.0 / np.log2(np.e) / float(np.min(steps))
    return dataclasses.replace(case, q=q, indices=indices, sm_scale=sm_scale)


EMPTY_ROWS = 5  # rows of empty_rows_case without a valid candidate


def empty_rows_case(rng, key: str, *, num_tokens: int, attn_sink=None) -> AttentionCase:
    """A case (topk 6, 3 heads) whose first EMPTY_ROWS rows have no valid candidate: rows 0-2 by junk
    indices (-1, past the cache, every invalid kind), rows 3 and 4 by lengths <= 0 over valid indices;
    later rows keep their 6 candidates. Unused slots are poisoned."""
    assert num_tokens >= EMPTY_ROWS
    case = make_case(rng, key, num_tokens=num_tokens, num_heads=3, topk=6, page_size=4, topk_length=None,
                     attn_sink=attn_sink, poison=False)
    num_slots = case.main.num_slots
    indices = case.indices.copy()
    indices[0] = -1
    indices[1] = num_slots + np.arange(6)
    indices[2] = [-7, num_slots, -1, INT32_MIN, INT32_MAX, -2]
    topk_length = np.full(num_tokens, 6, np.int32)
    topk_length[3:EMPTY_ROWS] = [0, -3]
    return dataclasses.replace(case, indices=indices, topk_length=topk_length).poison_unused()
