"""Pure-JAX sparse MLA (``impl="xla"``): the semantics of docs/semantics.md with float32 accumulation.

Candidates are gathered with clamped slots, but every gathered value is masked (``jnp.where``) before
use, so NaN/Inf in unreferenced slots, padding or past ``topk_length`` never reaches the result. XLA's
autodiff of this function is ``impl="xla"``'s gradient, so it is written to be differentiated too: masked
and non-finite values are replaced *before* any arithmetic (a ``where`` after it would still send NaN into
the gradient, as 0 · inf), the empty state's ``-inf`` is a constant, and a bf16 cache's gradient is summed
in float32.
"""

from __future__ import annotations

import functools
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
    if fmt.quantized:
        keys = decode_rows(*gather_rows(cache, layout, fmt, slots), fmt)
    else:
        keys = _bf16_rows(layout, fmt, cache, slots)
    return jnp.where(valid[..., None], keys, 0.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _bf16_rows(layout, fmt, cache, slots):
    """The float32 K rows of ``slots`` of a ``bf16_*`` cache. Its gradient adds every row's cotangents in
    float32 and rounds the sum to the cache's bfloat16 once: XLA's own transpose of the gather would add
    them in bfloat16, which loses most of a slot's gradient when many queries share it."""
    return decode_rows(*gather_rows(cache, layout, fmt, slots), fmt)


def _bf16_rows_forward(layout, fmt, cache, slots):
    return _bf16_rows(layout, fmt, cache, slots), (cache, slots)


def _bf16_rows_backward(layout, fmt, residuals, d_rows):
    cache, slots = residuals
    # Every accepted bf16 cache shape holds dense rows in slot order.
    rows = jnp.zeros((layout.num_slots, fmt.d_qk), jnp.float32).at[slots.reshape(-1)].add(d_rows.reshape(-1, fmt.d_qk))
    return rows.reshape(cache.shape).astype(cache.dtype), None


_bf16_rows.defvjp(_bf16_rows_forward, _bf16_rows_backward)


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
    if valid_tokens is not None:
        row_valid = jnp.arange(num_tokens) < jnp.clip(valid_tokens, 0, num_tokens)
        qf = jnp.where(row_valid[:, None, None], qf, 0.0)  # padding rows reach nothing, gradients included
    scores = jnp.einsum("thd,tnd->thn", qf, keys, precision=jax.lax.Precision.HIGHEST) * jnp.float32(sm_scale)
    scores = jnp.where(valid[:, None, :], scores, -jnp.inf)
    if attn_sink is not None:
        sink = jnp.broadcast_to(attn_sink.astype(jnp.float32)[None, :, None], (num_tokens, num_heads, 1))
    else:
        sink = jnp.full((num_tokens, num_heads, 1), -jnp.inf, jnp.float32)
    logits = jnp.concatenate([scores, sink], axis=-1)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    finite_max = jnp.isfinite(row_max)
    shift = jax.lax.stop_gradient(jnp.where(finite_max, row_max, 0.0))  # lse's gradient is the softmax alone
    # A row without a finite maximum sums exp(0)s that lse does not use: exp(+inf) there would make the
    # gradient of the unused branch 0 * inf = NaN.
    total = jnp.sum(jnp.exp(jnp.where(finite_max, logits - shift, 0.0)), axis=-1, keepdims=True)
    # Not finite: +inf (a +inf sink; d lse / d sink = 1, through the max) or a constant -inf (an empty state).
    lse = jnp.where(finite_max, shift + jnp.log(total), jnp.where(row_max > 0, row_max, -jnp.inf))
    # Masked before and after the exp: the exp of a masked or non-finite-row value is never taken, so
    # neither the weight nor its gradient can be NaN.
    weighted = finite_max & valid[:, None, :]
    weights = jnp.where(weighted, jnp.exp(jnp.where(weighted, scores - jnp.where(finite_max, lse, 0.0), 0.0)), 0.0)
    values = keys[..., : fmt.d_v]
    out = jnp.einsum("thn,tnd->thd", weights, values, precision=jax.lax.Precision.HIGHEST)
    lse = lse[..., 0]
    if valid_tokens is not None:
        out = jnp.where(row_valid[:, None, None], out, 0.0)
        lse = jnp.where(row_valid[:, None], lse, -jnp.inf)
    return out.astype(jnp.bfloat16), lse
