"""Pure-JAX sparse MLA (``impl="xla"``): the semantics of docs/semantics.md with float32 accumulation.

Candidates are gathered with clamped slots, but every gathered value is masked (``jnp.where``) before
use, so NaN/Inf in unreferenced slots, padding or past ``topk_length`` never reaches the result.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from .formats import CacheLayout, KVFormat, decode_rows, gather_rows

__all__ = ["candidate_mask", "sparse_mla_reference"]


def candidate_mask(indices, layout: CacheLayout, fmt: KVFormat, topk_length=None):
    """Validity of each candidate of ``indices [T, k]`` (docs/semantics.md, which candidates count)."""
    k = indices.shape[-1]
    position = jnp.arange(k, dtype=jnp.int32)
    valid = (indices >= 0) & (indices < layout.num_slots)
    if topk_length is not None:
        valid &= position[None, :] < jnp.clip(topk_length, 0, k)[:, None]
    if fmt.max_candidates:
        valid &= position[None, :] < fmt.max_candidates
    return valid


def _gather_keys(cache, layout, fmt, indices, valid):
    slots = jnp.where(valid, indices, 0)
    keys = decode_rows(*gather_rows(cache, layout, fmt, slots), fmt)
    return jnp.where(valid[..., None], keys, 0.0)


def sparse_mla_reference(q, kv_cache, indices, *, fmt: KVFormat, layout: CacheLayout, sm_scale: float,
                         topk_length=None, attn_sink=None, extra_kv_cache=None, extra_indices=None,
                         extra_topk_length=None, extra_layout: Optional[CacheLayout] = None, valid_tokens=None,
                         extra_fmt: Optional[KVFormat] = None):
    """Sparse MLA on flattened rows.

    Args:
      q: bfloat16 ``[T, H, d_qk]``. indices: int32 ``[T, topk]``. Other arguments as in
        :func:`jax_sparse_mla.sparse_mla`, already validated and flattened; ``valid_tokens`` is an
        int32 scalar or None.
    Returns:
      ``(out bfloat16 [T, H, d_v], lse float32 [T, H])``.
    """
    num_tokens, num_heads, _ = q.shape
    valid = candidate_mask(indices, layout, fmt, topk_length)
    keys = _gather_keys(kv_cache, layout, fmt, indices, valid)
    if extra_kv_cache is not None:
        extra_fmt = fmt if extra_fmt is None else extra_fmt
        extra_valid = candidate_mask(extra_indices, extra_layout, extra_fmt, extra_topk_length)
        extra_keys = _gather_keys(extra_kv_cache, extra_layout, extra_fmt, extra_indices, extra_valid)
        valid = jnp.concatenate([valid, extra_valid], axis=1)
        keys = jnp.concatenate([keys, extra_keys], axis=1)

    qf = q.astype(jnp.float32)
    scores = jnp.einsum("thd,tnd->thn", qf, keys, precision=jax.lax.Precision.HIGHEST) * jnp.float32(sm_scale)
    scores = jnp.where(valid[:, None, :], scores, -jnp.inf)
    if attn_sink is not None:
        sink = jnp.broadcast_to(attn_sink.astype(jnp.float32)[None, :, None], (num_tokens, num_heads, 1))
    else:
        sink = jnp.full((num_tokens, num_heads, 1), -jnp.inf, jnp.float32)
    logits = jnp.concatenate([scores, sink], axis=-1)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    finite_max = jnp.isfinite(row_max)
    shift = jnp.where(finite_max, row_max, 0.0)
    total = jnp.sum(jnp.exp(logits - shift), axis=-1, keepdims=True)
    lse = jnp.where(finite_max, shift + jnp.log(total), row_max)  # -inf (empty) or +inf (sink = +inf)
    weights = jnp.where(finite_max & valid[:, None, :], jnp.exp(scores - jnp.where(finite_max, lse, 0.0)), 0.0)
    values = keys[..., : fmt.d_v]
    out = jnp.einsum("thn,tnd->thd", weights, values, precision=jax.lax.Precision.HIGHEST)
    lse = lse[..., 0]
    if valid_tokens is not None:
        row_valid = jnp.arange(num_tokens) < jnp.clip(valid_tokens, 0, num_tokens)
        out = jnp.where(row_valid[:, None, None], out, 0.0)
        lse = jnp.where(row_valid[:, None], lse, -jnp.inf)
    return out.astype(jnp.bfloat16), lse
